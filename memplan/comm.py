"""Communication time of data-parallel training: the collectives DDP and FSDP2 run in a step, and
how much of them the computation hides.

Each collective is timed with the ring algorithm's cost (Thakur, Rabenseifner & Gropp 2005,
"Optimization of Collective Communication Operations in MPICH", §4; the algorithm NCCL and gloo
use for large messages). With W ranks, a message of S bytes, a per-rank bus bandwidth B (bytes
per second each way) and a per-hop latency α:

- all-reduce:     2·(W−1)/W · S/B + 2·(W−1)·α   (a reduce-scatter, then an all-gather)
- all-gather:       (W−1)/W · S/B +   (W−1)·α   (S: the gathered output)
- reduce-scatter:   (W−1)/W · S/B +   (W−1)·α   (S: the input, before scattering)

These factors are the ones nccl-tests uses to turn an operation's time into "bus bandwidth"
(NVIDIA/nccl-tests doc/PERFORMANCE.md: 2(n−1)/n for all-reduce, (n−1)/n for all-gather and
reduce-scatter), so B is what nccl-tests reports as busbw, at best the link's per-direction
bandwidth. B and α come from the profile's ``[interconnect]`` table (``link_of``).

What a step communicates (``step_collectives``), per rank:

- DDP: one all-reduce of every gradient, N·p bytes, bucket by bucket (DDP's first bucket is
  1 MiB, the others 25 MiB), once per step: the micro-batches before the last run in ``no_sync``.
- FSDP2: in each micro-batch, an all-gather of the root's parameters (kept unsharded until the
  backward ends), of every block's in the forward and again in the backward, and a
  reduce-scatter of every block's and the root's gradients; sizes W·pad(G)·c and W·pad(G)·g
  (``memplan.memory.sharding``'s FSDP terms).

Overlap (``communication``). On CUDA and ROCm the collectives run on their own streams while the
computation goes on: DDP all-reduces each bucket as soon as the backward has filled it, so only
what the backward cannot cover is exposed, and at least the last bucket (reduced after the
backward ends); FSDP2 prefetches the next block's all-gather during the current block's compute
and reduce-scatters behind the backward, so exposed are the first all-gathers of each
micro-batch (the root's and the first block's, which nothing precedes), the root's
reduce-scatter at the end, and whatever of the rest exceeds the forward and backward compute.
On the CPU (gloo) FSDP2's collectives are synchronous and DDP's all-reduces compete with the
backward for the same cores, so nothing is counted as hidden there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.errors import InputError
from memplan.hardware import Device
from memplan.memory.sharding import ddp_bucket_bytes, fsdp_gather_bytes, fsdp_group_numel, fsdp_reduce_bytes
from memplan.model import ModelSpec
from memplan.setup import TrainSetup

MIB = 1 << 20
DDP_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed.constants' _DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * MIB  # DistributedDataParallel(bucket_cap_mb=25), the default
OVERLAPPING_FAMILIES = ("cuda", "rocm")  # collectives on their own streams


@dataclass(frozen=True, kw_only=True)
class Link:
    """What one rank gets from the interconnect in a collective over ``world_size`` ranks."""

    kind: str
    bandwidth_bytes_per_second: float  # per direction: the bus bandwidth of a large collective
    latency_seconds: float  # per hop of the ring
    source: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_second > 0:
            raise InputError(f"interconnect {self.kind}: bandwidth_bytes_per_second must be > 0")
        if self.latency_seconds < 0:
            raise InputError(f"interconnect {self.kind}: latency_seconds must be ≥ 0")


def link_of(device: Device, world_size: int) -> Link:
    """The profile's ``[interconnect]`` as seen by a collective over ``world_size`` ranks.

    Where one peer gets less than all of them together (``peer_bandwidth_bytes_per_second``, as
    on MI300X's fully connected Infinity Fabric: 64 GB/s to each of 7 peers), a ring over W ranks
    uses W−1 of the links: min(bandwidth, (W−1)·peer_bandwidth).
    """
    ic = device.interconnect
    if not ic or "bandwidth_bytes_per_second" not in ic:
        raise InputError(f"profile {device.name} has no [interconnect] table with bandwidth_bytes_per_second; "
                         "add one (see memplan/profiles/*.toml) to plan for --world-size > 1")
    bw = float(ic["bandwidth_bytes_per_second"])
    peer = ic.get("peer_bandwidth_bytes_per_second")
    if peer:
        bw = min(bw, (world_size - 1) * float(peer))
    return Link(kind=str(ic.get("kind", "interconnect")), bandwidth_bytes_per_second=bw,
                latency_seconds=float(ic.get("latency_seconds", 0.0)),
                source=device.sources.get("interconnect", ""))


def all_reduce_seconds(nbytes: float, world_size: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes``: 2·(W−1)/W · S/B + 2·(W−1)·α; 0 for one rank."""
    if world_size <= 1 or nbytes <= 0:
        return 0.0
    w = world_size
    return 2 * (w - 1) / w * nbytes / link.bandwidth_bytes_per_second + 2 * (w - 1) * link.latency_seconds


def all_gather_seconds(output_bytes: float, world_size: int, link: Link) -> float:
    """Ring all-gather into ``output_bytes`` (W shards): (W−1)/W · S/B + (W−1)·α; 0 for one rank."""
    if world_size <= 1 or output_bytes <= 0:
        return 0.0
    w = world_size
    return (w - 1) / w * output_bytes / link.bandwidth_bytes_per_second + (w - 1) * link.latency_seconds


def reduce_scatter_seconds(input_bytes: float, world_size: int, link: Link) -> float:
    """Ring reduce-scatter of ``input_bytes`` (W shards): (W−1)/W · S/B + (W−1)·α; 0 for one rank."""
    return all_gather_seconds(input_bytes, world_size, link)


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a step: ``count`` calls of ``nbytes`` each (S in the formulas)."""

    name: str  # e.g. "all-reduce (DDP bucket)", "all-gather (block, forward)"
    op: str  # all-reduce | all-gather | reduce-scatter
    nbytes: int
    count: int
    phase: str  # start (before any compute) | forward | backward | end (after the backward): what can hide it

    def seconds(self, world_size: int, link: Link) -> float:
        one = {"all-reduce": all_reduce_seconds, "all-gather": all_gather_seconds,
               "reduce-scatter": reduce_scatter_seconds}[self.op](self.nbytes, world_size, link)
        return one * self.count


def ddp_buckets(total_bytes: int) -> list[int]:
    """DDP's bucket sizes for ``total_bytes`` of gradients: 1 MiB first, then 25 MiB ones (the
    last smaller). Parameters are not split across buckets, so real buckets can be a little
    larger; the total is exact."""
    if total_bytes <= DDP_FIRST_BUCKET_BYTES:
        return [total_bytes]
    rest = total_bytes - DDP_FIRST_BUCKET_BYTES
    full, last = divmod(rest, DDP_BUCKET_BYTES)
    return [DDP_FIRST_BUCKET_BYTES] + [DDP_BUCKET_BYTES] * full + ([last] if last else [])


def step_collectives(spec: ModelSpec, setup: TrainSetup) -> list[Collective]:
    """Every collective one rank takes part in during a step (all micro-batches)."""
    if setup.world_size <= 1 or setup.sharding == "none":
        return []
    if setup.sharding == "ddp":
        *early, last = ddp_buckets(ddp_bucket_bytes(spec, setup))
        out = [Collective("all-reduce (DDP bucket)", "all-reduce", size, 1, "backward") for size in early]
        # the bucket of the first layers and the embedding is ready last: nothing left to hide it
        return out + [Collective("all-reduce (last DDP bucket)", "all-reduce", last, 1, "end")]
    w, a, c, g = setup.world_size, setup.grad_accum, fsdp_gather_bytes(setup), fsdp_reduce_bytes(setup)
    block = w * fsdp_group_numel(spec, setup, "block")
    root = w * fsdp_group_numel(spec, setup, "root")
    L = spec.layers
    return [
        Collective("all-gather (root, forward)", "all-gather", root * c, a, "start"),
        Collective("all-gather (first block, forward)", "all-gather", block * c, a, "start"),
        Collective("all-gather (blocks, forward)", "all-gather", block * c, a * (L - 1), "forward"),
        Collective("all-gather (blocks, backward)", "all-gather", block * c, a * L, "backward"),
        Collective("reduce-scatter (blocks)", "reduce-scatter", block * g, a * L, "backward"),
        Collective("reduce-scatter (root)", "reduce-scatter", root * g, a, "end"),
    ]


@dataclass(frozen=True)
class Communication:
    """Communication of one step of one rank: every collective's time, their total, and what
    the computation does not hide (``exposed_seconds``, what a step takes longer for it)."""

    link: Link | None
    collectives: tuple[Collective, ...]
    seconds_by_collective: dict[str, float] = field(default_factory=dict)
    total_seconds: float = 0.0
    exposed_seconds: float = 0.0
    overlapped: bool = False
    bytes_per_step: int = 0  # the S of every call, summed

    def to_json(self) -> dict:
        return {"total_seconds": self.total_seconds, "exposed_seconds": self.exposed_seconds,
                "overlapped": self.overlapped, "bytes_per_step": self.bytes_per_step,
                "link": None if self.link is None else {"kind": self.link.kind,
                                                         "bandwidth_bytes_per_second":
                                                             self.link.bandwidth_bytes_per_second,
                                                         "latency_seconds": self.link.latency_seconds},
                "collectives": {k: v for k, v in self.seconds_by_collective.items()}}


def communication(spec: ModelSpec, setup: TrainSetup, device: Device, forward_seconds: float = 0.0,
                  backward_seconds: float = 0.0, overlap: bool | None = None) -> Communication:
    """The step's collectives on ``device``'s interconnect and how much of them is exposed.

    ``forward_seconds`` / ``backward_seconds``: the compute time of the step's forwards and
    backwards (all micro-batches), which overlapping collectives hide behind. ``overlap``
    defaults to whether the device runs collectives on their own streams (CUDA, ROCm).
    """
    colls = step_collectives(spec, setup)
    if not colls:
        return Communication(link=None, collectives=())
    link = link_of(device, setup.world_size)
    w = setup.world_size
    if overlap is None:
        overlap = device.family in OVERLAPPING_FAMILIES
    by_name: dict[str, float] = {}
    by_phase = {"start": 0.0, "forward": 0.0, "backward": 0.0, "end": 0.0}
    for coll in colls:
        s = coll.seconds(w, link)
        by_name[coll.name] = by_name.get(coll.name, 0.0) + s
        by_phase[coll.phase] += s
    total = sum(by_phase.values())
    if overlap:
        exposed = (by_phase["start"] + max(0.0, by_phase["forward"] - forward_seconds)
                   + max(0.0, by_phase["backward"] - backward_seconds) + by_phase["end"])
    else:
        exposed = total
    return Communication(link=link, collectives=tuple(colls), seconds_by_collective=by_name, total_seconds=total,
                         exposed_seconds=exposed, overlapped=overlap,
                         bytes_per_step=sum(c.nbytes * c.count for c in colls))

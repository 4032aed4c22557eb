"""Training on several devices with PyTorch's own engine: DDP or FSDP2, one process per device.

A run is launched by ``torchrun --nproc-per-node N -m trainer ...`` (or ``memplan train --nproc N``,
which runs that). Each process reads its rank from the environment torchrun sets, joins the
process group (NCCL on NVIDIA, RCCL through the same ``nccl`` backend on ROCm, gloo on the CPU)
and wraps the reference model:

- ``ddp``: ``DistributedDataParallel(gradient_as_bucket_view=True)``, no buffer syncing.
  Each rank holds the whole model and optimizer; the gradients live in DDP's flat buckets for the
  whole run (``.grad`` are views into them), all-reduced (averaged) bucket by bucket as the
  backward produces them. Under gradient accumulation every micro-batch but the last runs in
  ``no_sync`` (``trainer.step.train_step``), so a step all-reduces once.
- ``fsdp``: FSDP2, ``fully_shard`` on every block and then on the root (FSDP2's defaults: blocks
  reshard after forward, the root keeps its parameters from forward to backward).
  Parameters, gradients and optimizer states are sharded on dim 0 across ranks; a block's
  parameters are all-gathered before its forward and again before its backward, and its
  gradients reduce-scattered after its backward. Under bf16-mixed / fp16-mixed the
  ``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)`` replaces autocast: the
  all-gathered parameters are in the low precision, the sharded master weights, gradients and
  optimizer states stay fp32.

The memory each rank takes is what ``memplan.memory`` predicts for ``world_size`` and
``sharding`` (``memplan validate --world-size 2`` measures it in each rank with MemTracker).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import re
import time
import weakref
from typing import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.errors import InputError
from memplan.setup import TrainSetup
from trainer import device as devices
from trainer.wrapping import is_ddp, is_fsdp, no_sync, unwrapped  # noqa: F401  (loop and others ask distributed.*)

BACKENDS = {"cuda": "nccl", "rocm": "nccl", "cpu": "gloo", "mps": "gloo"}  # ROCm's torch maps nccl to RCCL
TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class DistContext:
    """This process's place in the run."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """Rank 0: the only one that prints and writes reports."""
        return self.rank == 0


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the variables torchrun sets; (0, 1, 0) without them."""
    def get(name: str, default: int) -> int:
        raw = os.environ.get(name)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise InputError(f"environment variable {name}={raw!r} is not an integer") from None

    return get("RANK", 0), get("WORLD_SIZE", 1), get("LOCAL_RANK", 0)


def init(family: str | None = None) -> DistContext:
    """Join the process group torchrun described (a no-op context for a single process). Each process
    runs on its GPU by local rank on CUDA/ROCm, else on the CPU (gloo has no Apple GPU)."""
    family = family or devices.local_family()
    rank, world_size, local_rank = env_world()
    device = devices.torch_device(family, local_rank) if family in ("cuda", "rocm") else torch.device("cpu")
    backend = BACKENDS[family]
    if world_size > 1 and not dist.is_initialized():
        save_timeout()  # a bad $MEMPLAN_SAVE_TIMEOUT is refused now, not at the first checkpoint
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=TIMEOUT,
                                device_id=device if device.type == "cuda" else None)
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def fsdp_mixed_precision(setup: TrainSetup):
    """FSDP2's policy for a precision: bf16/fp16 all-gathered parameters and fp32 gradient
    reduction under bf16-mixed / fp16-mixed; otherwise parameters and reductions in the storage dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(setup.precision)
    if low is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def wrap_model(model: torch.nn.Module, setup: TrainSetup, device: torch.device, mesh=None) -> torch.nn.Module:
    """DDP or FSDP2 around the reference model, as ``setup.sharding`` says (the model itself for none).

    ``mesh``: FSDP2's device mesh (default: one dimension over the whole process group); the
    FakeTensor trace makes it before entering fake mode."""
    if setup.sharding == "none" or setup.world_size == 1 and not dist.is_initialized():
        return model
    if not dist.is_initialized():
        raise InputError(f"--sharding {setup.sharding} needs a process group: launch with torchrun "
                         f"--nproc-per-node {setup.world_size} -m trainer (or memplan train --nproc N)")
    if dist.get_world_size() != setup.world_size:
        raise InputError(f"the plan's --world-size {setup.world_size} differs from the {dist.get_world_size()} "
                         "processes launched")
    if setup.sharding == "ddp":
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        # The model's only buffers are RoPE's tables, the same in every rank: no buffer syncing.
        params = inspect.signature(DistributedDataParallel).parameters
        no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in params
                          else {"broadcast_buffers": False})
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       gradient_as_bucket_view=True, **no_buffer_sync)
    from torch.distributed.fsdp import fully_shard

    policy = fsdp_mixed_precision(setup)
    for block in model.blocks:  # resharded after forward (FSDP2's default for non-root modules)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root keeps its parameters unsharded from forward to backward
    return model


def mean_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a 0-dim tensor over all ranks (itself in a single process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    out = value.detach().clone().float()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / dist.get_world_size()


# =================================================================================================
# Measuring a rank's memory: for real in W gloo processes, or one rank under FakeTensorMode
# =================================================================================================

WARMUP_STEPS = 2  # DDP rebuilds its buckets in the second step; FSDP2 initialises lazily in the first


def _rank_step_memory(spec, setup: TrainSetup, device: torch.device, seed: int = 0, fake: bool = False):
    """Build, wrap and warm up the model in this rank, then MemTracker one steady-state step.

    Everything that outlives a step (parameters and their shards, gradients, DDP's buckets,
    optimizer state) is registered with ``track_external``; the step's batches are made inside
    the tracker, as ``trainer.measure`` does for a single process.
    """

    from trainer.lora import frozen_params_tracked, lora_for
    from trainer.measure import PeakTracker, StepMemory, _categories, _random_batches, _TermProbe, traced_accumulation
    from trainer.model import apply_checkpointing, build_model
    from trainer.step import make_optimizer, param_dtype, set_matmul_precision, train_step

    asked, setup = setup, (traced_accumulation(setup) if fake else setup)  # fake: the peak of N is the second's
    torch.manual_seed(seed)
    set_matmul_precision(setup.precision)
    mesh = None
    if setup.sharding == "fsdp" and fake:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (setup.world_size,))  # made outside fake mode
    context = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        context = FakeTensorMode(allow_non_fake_inputs=False)
    with context, torch.device(device):
        # as a finetune's model factory builds it (trainer/finetune.py): the base model, its LoRA adapters in the
        # parameters' dtype with every other weight frozen (``lora_for``; none without ``lora_rank``), then the
        # checkpointing wrappers; then wrapped (FSDP2: each block, then the root)
        model = build_model(spec, setup.attention, "none", param_dtype(setup.precision), device=device)
        model = apply_checkpointing(lora_for(model, setup), setup.checkpointing)
        model = wrap_model(model, setup, device, mesh=mesh)
        optimizer = make_optimizer(model, setup.optimizer)
        gen = None if fake else torch.Generator(device).manual_seed(seed + 1 + dist.get_rank())
        for _ in range(WARMUP_STEPS):
            train_step(model, optimizer, _random_batches(spec, setup, device, gen), setup, device.type,
                       check_finite=False)
        tracker = PeakTracker()
        tracker.track_external(model, optimizer)

        def live() -> int:
            return int(sum(snap.get("Total", 0) for snap in tracker.get_tracker_snapshot("current").values()))

        probe = None if fake else _TermProbe(model, optimizer, live)  # fake tensors have no storages to count
        last = setup.grad_accum - 1

        def before(i: int) -> None:
            tracker.reset_mod_stats()
            if probe is not None and i == last:
                probe.before_forward(i)

        with frozen_params_tracked(), tracker:  # (MemTracker's gradient hooks skip LoRA's frozen base)
            batches = _random_batches(spec, setup, device, gen)
            train_step(model, optimizer, batches, setup, device.type, check_finite=False, before_forward=before,
                       after_forward=lambda i: probe.after_forward(i) if probe is not None and i == last else None)
            del batches
        snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
        terms = probe.finish() if probe is not None else {}
    total = int(snapshot.get("Total", sum(snapshot.values())))
    method = "MemTracker under FakeTensorMode, fake process group" if fake else "MemTracker on real tensors, gloo"
    from trainer.measure import with_untraced_inputs

    return with_untraced_inputs(StepMemory(peak_allocated=total, breakdown=_categories(snapshot), terms=terms,
                                           method=f"{method} (rank {dist.get_rank()})"), asked, device.type)


def trace_rank_step(spec, setup: TrainSetup, rank: int = 0, device: str = "cpu"):
    """Exact live-tensor peak of one rank's steady-state FSDP2 step on fake tensors, in this
    process: a fake process group of ``setup.world_size`` ranks stands in for the others
    (torch.testing's FakeStore; collectives return at once and allocate nothing, as NCCL's), so a
    1B model sharded over 8 GPUs is traced on a laptop CPU. DDP cannot be traced: its C++ reducer
    rebuilds its buckets from real storage."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if setup.sharding != "fsdp":
        raise InputError("trace_rank_step traces FSDP2 ranks (--sharding fsdp); DDP's reducer cannot run on fake "
                         "tensors")
    if dist.is_initialized():
        raise RuntimeError("trace_rank_step makes its own (fake) process group; this process is already in one")
    dist.init_process_group("fake", rank=rank, world_size=setup.world_size, store=FakeStore())
    try:
        return _rank_step_memory(spec, setup, torch.device(device), fake=True)
    finally:
        dist.destroy_process_group()


def _own_rank_memory(spec, setup: TrainSetup):
    """``measure_ranks``' default measure: memplan's own step in this rank, on the CPU (``_rank_step_memory``)."""
    return _rank_step_memory(spec, setup, torch.device("cpu"))


# What FSDP1, FSDP2 and memplan's own code call in torch.distributed from Python (DDP's reducer calls gloo from C++)
GLOO_COLLECTIVES = ("all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
                    "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce", "broadcast")
RELEASE_WAIT_S = 5.0  # the longest a collective waits for gloo's thread to free what the call made


class Made(TorchDispatchMode):
    """Weak references to the storages the ops under it return, in whichever thread runs them: gloo's work
    carries the dispatch modes of the thread that queued it (``at::ThreadLocalState``) to its worker thread."""

    def __init__(self):
        super().__init__()
        self.storages = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                self.storages.append(weakref.ref(t.untyped_storage()))
        return out


def alive(refs: list, given: frozenset = frozenset()) -> list:
    """The references in ``refs`` whose storage is still alive, less those of the call's own arguments (the
    storage is held only within this call: the worker thread may be freeing it meanwhile)."""
    def kept(ref) -> bool:
        storage = ref()
        return storage is not None and storage.data_ptr() not in given
    return [ref for ref in refs if kept(ref)]


def frees_what_it_made(call: Callable, timeout: float = RELEASE_WAIT_S) -> Callable:
    """``call`` (a collective) that, when it returns synchronously, returns only once every tensor it made has been
    freed, waiting up to ``timeout`` seconds; asynchronous calls (a Work returned) pass through.

    gloo runs a collective on its worker thread: the reduce-scatter's flat copy of its input, for one, is made there
    (its chunks are ``split`` on that thread). The caller's ``wait`` returns when the work is marked complete; the
    worker thread drops the work, and the copy with it, after that. Under load the rank has gone on by then: its
    next allocation (FSDP1 casting the reduced gradient to fp32) is made while the copy still lives. Measured here on
    litgpt's FSDP1 step over two ranks (tests/runs/test_walk_matrices.py's): in 5 of 87 runs one rank's MemTracker
    peak rose by a block's gradient copy (1,180,672 B) or by 4,096,256 B, as in one CI run; with this wait, 0 of 70.
    NCCL has no such thread: its buffers are the caller's. The walk frees the copy as the call returns
    (``gloo_reduce_scatter_copy_bytes``), and so does a rank measured under this."""

    @functools.wraps(call)
    def synchronous(*args, **kwargs):
        with Made() as made:
            result = call(*args, **kwargs)
        if result is not None:  # a Work: async_op, waited for later by the caller
            return result
        given = frozenset(t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor))
        pending, deadline = alive(made.storages, given), time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            time.sleep(1e-4)  # releases the GIL the worker thread needs to free them
            pending = alive(pending)
        return result

    return synchronous


@contextlib.contextmanager
def collectives_free_what_they_made(names: tuple[str, ...] = GLOO_COLLECTIVES):
    """Within it, each of torch.distributed's ``names`` returns only once what it made is freed
    (``frees_what_it_made``): a gloo rank's measured peak is then the step's, not the worker thread's timing."""
    modules = (dist, dist.distributed_c10d)
    saved = [(m, n, getattr(m, n)) for m in modules for n in names if hasattr(m, n)]
    wrapped = {}  # torch.distributed re-exports distributed_c10d's functions: one wrapper for both names
    for module, name, call in saved:
        setattr(module, name, wrapped.setdefault(call, frees_what_it_made(call)))
    try:
        yield
    finally:
        for module, name, call in saved:
            setattr(module, name, call)


def _measure_worker(rank: int, world_size: int, store_path: str, configs: list, out_dir: str,
                    measure=_own_rank_memory, backend: str = "gloo", timeout: datetime.timedelta = TIMEOUT) -> None:
    """One rank of ``measure_ranks``: every config in turn (``measure(*config)``), its StepMemory pickled to
    out_dir. Over ``nccl`` the rank runs on GPU ``rank`` of this machine."""
    import gc
    import pickle

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # as torchrun does: the ranks share the cores
    device_id = None
    if backend == "nccl":
        device_id = torch.device("cuda", rank)
        torch.cuda.set_device(device_id)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device_id)
    try:
        results = []
        measured = collectives_free_what_they_made() if backend == "gloo" else contextlib.nullcontext()
        with measured:
            for config in configs:
                results.append(measure(*config))
                gc.collect()
                if rank == 0:  # one byte per config done: the parent's progress counter reads the file's size
                    with open(os.path.join(out_dir, "progress"), "ab") as f:
                        f.write(b".")
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
    finally:
        dist.destroy_process_group()


def measure_ranks(configs: list, world_size: int, progress=None, measure=_own_rank_memory, backend: str = "gloo",
                  timeout: datetime.timedelta = TIMEOUT) -> list[list]:
    """Measure each (spec, setup) for real on the CPU in ``world_size`` gloo processes started
    here; returns, per config, every rank's StepMemory (MemTracker's peak in that rank).
    ``progress(done)``, where given, is called with the number of configs rank 0 has finished
    while the processes run (twice a second) and once at the end. ``measure(model, setup)``, a
    picklable function run in each rank, measures a config there (another stack's step:
    ``trainer.stacks.ranks``; a trial of ``autotune --verify``: ``trainer.verify_ranks``); memplan's own step by
    default. ``backend`` ``nccl``: rank r on GPU r of this machine. A collective that waits longer than ``timeout``
    (a rank hung, or gone) fails in its rank, which fails the run."""
    import pickle
    import tempfile

    import torch.multiprocessing as mp

    for _, setup in configs:
        if setup.world_size != world_size:
            raise InputError(f"--world-size {world_size}: a config asks for world size {setup.world_size}")
    with tempfile.TemporaryDirectory(prefix="memplan-ranks-") as tmp:
        context = mp.start_processes(_measure_worker, args=(world_size, os.path.join(tmp, "store"), configs, tmp,
                                                            measure, backend, timeout),
                                     nprocs=world_size, join=False, start_method="spawn")
        done_file = os.path.join(tmp, "progress")
        while not context.join(timeout=0.5):  # raises, as join=True would, when a rank fails
            if progress is not None and os.path.exists(done_file):
                progress(os.path.getsize(done_file))
        if progress is not None:
            progress(len(configs))
        per_rank = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                per_rank.append(pickle.load(f))
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(configs))]


# =================================================================================================
# Agreeing across ranks
# =================================================================================================

def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


SAVE_TIMEOUT_ENV = "MEMPLAN_SAVE_TIMEOUT"  # seconds; the longest a rank waits for the others at each part of a save
_save_group = None


def save_timeout() -> datetime.timedelta:
    """How long a rank waits for the others in each collective of a checkpoint save, and at the exchange that
    ends each part of it: ``$MEMPLAN_SAVE_TIMEOUT`` seconds, else the process group's ``TIMEOUT`` (10 minutes).
    An InputError where the variable is not a positive number of seconds."""
    raw = os.environ.get(SAVE_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= 7 * 24 * 3600:  # also refuses nan and inf
        raise InputError(f"environment variable {SAVE_TIMEOUT_ENV}={raw!r}: give the seconds a rank waits for the "
                         "others at each part of a checkpoint save, a number above 0 and at most 604800 (a week)")
    return datetime.timedelta(seconds=seconds)


def save_group():
    """A gloo group of every rank (made once, by every rank at its first save) whose collectives time out after
    ``save_timeout()``: the save's own exchanges (``settle``, ``from_rank0(..., save=True)``) and DCP's (plans
    and write results: small CPU objects, whatever the backend) go through it. None in a single process."""
    global _save_group
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if _save_group is None:
        _save_group = dist.new_group(backend="gloo", timeout=save_timeout())
    return _save_group


def settle(what: str, error: BaseException | None) -> None:
    """Every rank's outcome of the part ``what`` of a save, exchanged (a barrier that carries errors): where
    one rank failed, every rank stops with one line naming it and its cause (``RankFailed``; the failing
    rank raises its own error, so a full disk stays ``DiskFull``). A rank that does not come within
    ``save_timeout()`` (hung, or dead) is named by rank 0 (gloo's ``monitored_barrier``); the others say that
    rank 0 did not answer (``unanswered``). In a single process, ``error`` is raised as it is."""
    from memplan.fsutil import no_space
    from trainer.stopping import RankFailed, TrainingStopped

    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    group, timeout, me = save_group(), save_timeout(), dist.get_rank()
    mine = own = None
    if error is not None:
        rank, own = failed_rank(error, me)
        mine = (rank, cause_of(own))
    outcomes: list = [None] * dist.get_world_size()
    try:
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        dist.all_gather_object(outcomes, mine, group=group)
    except Exception as e:  # gloo's timeout, or a peer that closed its connection (it exited)
        raise unanswered(what, e, mine) from None
    if mine is not None and mine[0] == me:  # its own error, where it is one line already (a full disk: DiskFull)
        if isinstance(own, TrainingStopped) or no_space(own) is not None:
            raise own
        raise RankFailed(f"{what}: rank {me} failed: {mine[1]}") from None
    failed = sorted({tuple(o) for o in outcomes if o})  # DCP's failures arrive from every rank: once each
    if failed:
        rank, cause = failed[0]
        more = len({r for r, _ in failed}) - 1
        raise RankFailed(f"{what}: rank {rank} failed: {cause}" + (f" (and {more} more rank{'s' if more > 1 else ''})"
                                                                  if more else ""))
    if error is not None:
        raise error


def unanswered(what: str, e: BaseException, mine: tuple[int, str] | None = None) -> Exception:
    """The ``RankFailed`` line for an exchange of a save that ended in gloo's error ``e`` (its timeout, or a peer
    that closed its connection): on rank 0 after ``monitored_barrier``, naming the ranks that did not come;
    elsewhere, that rank 0 did not answer. ``mine``: this rank's own failure, (rank, cause), added to it."""
    from trainer.stopping import RankFailed

    timeout, me = save_timeout(), dist.get_rank()
    also = f"; rank {mine[0]}: {mine[1]}" if mine else ""
    late = _late_ranks(e)
    if late:
        ranks = ", ".join(map(str, late))
        return RankFailed(f"{what}: rank{'s' if len(late) > 1 else ''} {ranks} did not answer within "
                          f"{_seconds(timeout)} (hung, or died){also}")
    first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)[:160]  # gloo's source file and line
    peers = "rank 0" if me != 0 else "the other ranks"
    return RankFailed(f"{what}: rank {me} got no answer from {peers} (gloo: {first}; the timeout is "
                      f"{_seconds(timeout)}); another rank failed or hung{also}")


def failed_rank(error: BaseException, me: int) -> tuple[int, BaseException]:
    """The rank an error happened in, and the error there. DCP raises the same ``CheckpointException`` in every
    rank, naming the ranks whose part failed (``failures``: rank -> (exception, traceback)): this rank's own
    where it is one of them, else the lowest; any other error is this rank's."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = me if me in failures else min(failures)
        item = failures[rank]
        exc = item[0] if isinstance(item, tuple) else item
        return rank, exc if isinstance(exc, BaseException) else error
    return me, error


def cause_of(error: BaseException) -> str:
    """What went wrong, in one line of at most 300 characters: the message of a ``TrainingStopped``, else the
    exception's type and message."""
    from trainer.stopping import TrainingStopped

    text = " ".join(str(error).split())[:300]
    return text if isinstance(error, TrainingStopped) else f"{type(error).__name__}: {text}"


def _late_ranks(e: BaseException) -> list[int]:
    """The ranks gloo's ``monitored_barrier`` says did not come (rank 0 only), else []."""
    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(e))
    return [int(r) for r in re.findall(r"\d+", m.group(1))] if m else []


def _seconds(t: datetime.timedelta) -> str:
    return f"{t.total_seconds():g} s (${SAVE_TIMEOUT_ENV})"


def from_rank0(obj, save: bool = False):
    """Rank 0's ``obj`` in every rank (itself in a single process): for what must be the same
    everywhere but is decided by time or measurement (a plan autotuned on a timed matmul, a run
    directory named by the clock, when a time-limited run stops). ``save``: in a checkpoint save, over
    ``save_group()`` (its timeout)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=save_group() if save else None)
    return box[0]


def max_across_ranks(value: int, device: torch.device) -> int:
    """The largest of an integer over all ranks (a stop signal any rank received, a peak memory)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def rescaled_for_world(setup: TrainSetup, world_size: int, sharding: str | None = None) -> TrainSetup:
    """The setup with ``world_size`` ranks and the same global batch: gradient accumulation scaled by
    old/new world size, so each micro-batch (and its memory) stays as it was. An InputError if the
    global batch does not split evenly."""
    if world_size == setup.world_size and (sharding is None or sharding == setup.sharding or world_size == 1):
        return setup
    micro_batches = setup.grad_accum * setup.world_size
    if micro_batches % world_size:
        raise InputError(f"the run's global batch of {setup.grad_accum} × {setup.world_size} micro-batches of "
                         f"{setup.micro_batch} cannot be split evenly over {world_size} processes; launch a number "
                         f"of processes that divides {micro_batches}")
    if world_size == 1:
        sharding = "none"
    else:
        sharding = sharding or (setup.sharding if setup.sharding != "none" else "ddp")
    return setup.replace(grad_accum=micro_batches // world_size, world_size=world_size, sharding=sharding)


def build_wrapped_model(spec, setup: TrainSetup, ctx: DistContext, seed: int,
                        build: Callable[[torch.device | str, bool], torch.nn.Module] | None = None) -> torch.nn.Module:
    """The run's model with the initial weights of a single-process run with ``seed``, wrapped.

    ``build(device, with_weights)`` makes the plain model (default: the reference model of ``spec``, as
    seeded; a ``trainer.task.TrainingTask``'s factory: a finetune's base weights and LoRA adapters, ``--from``'s
    weights); ``with_weights`` is True only where the weights the run starts from are to be loaded: rank 0's
    model (the other ranks receive them from rank 0, as they do a seeded initialisation).

    DDP: every rank builds it on its device (DDP then broadcasts rank 0's parameters, frozen ones included,
    and reduces the gradients of the trainable ones only). FSDP: no rank ever holds the whole model on its
    device. The model is built on the meta device, sharded, and given storage for its shards only; rank 0
    builds the initial weights in host memory and broadcasts them, each rank keeping its shards
    (``set_model_state_dict(..., broadcast_from_rank0=True)``).
    """
    if build is None:
        from trainer.model import build_model
        from trainer.step import param_dtype

        def build(device, with_weights: bool) -> torch.nn.Module:
            return build_model(spec, setup.attention, setup.checkpointing, param_dtype(setup.precision), device=device)

    if setup.sharding != "fsdp":
        torch.manual_seed(seed)
        model = build(ctx.device, ctx.is_main)
        return wrap_model(model, setup, ctx.device)  # DDP broadcasts rank 0's parameters to every rank
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = wrap_model(build("meta", False), setup, ctx.device)
    model.to_empty(device=ctx.device)
    full = {}
    if ctx.is_main:
        torch.manual_seed(seed)
        host = build("cpu", True)
        full = host.state_dict()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


# =================================================================================================
# Checkpoints: torch.distributed.checkpoint, readable at any world size
# =================================================================================================

SHARDED_DIR = "dcp"  # inside a checkpoint of a distributed run: model and optimizer, every rank's shards


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes a single process when there is no process group: so it is."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The model's and optimizer's state as DCP saves it: every rank's own shards, under the parameters' names
    (no collective for DDP or FSDP2's sharded state)."""
    from torch.distributed.checkpoint import state_dict as dcp_state

    model_sd, optim_sd = dcp_state.get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def write_sharded(directory, state: dict) -> None:
    """``sharded_state``'s state through ``torch.distributed.checkpoint`` into ``directory``: every rank writes
    its own shards (no rank gathers the optimizer), so any world size and sharding (or one process) can load
    them. DCP's exchanges (plans, write results) go over ``save_group()``, with its timeout; a rank's failure
    comes out of every rank as DCP's ``CheckpointException``, naming it."""
    import torch.distributed.checkpoint as dcp

    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(directory), process_group=save_group())


def save_sharded(directory, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer through ``torch.distributed.checkpoint`` into ``directory`` (``sharded_state``, then
    ``write_sharded``)."""
    write_sharded(directory, sharded_state(model, optimizer))


def load_sharded(directory, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what ``save_sharded`` wrote into this run's model and optimizer, whatever the world size and
    sharding they were saved with (DCP reshards on load).

    DCP's own reader unpickles ``.metadata`` and its planner ``torch.load``s non-tensor items with
    ``weights_only=False``: either runs whatever code a crafted file holds. Here the metadata is read
    by an unpickler that builds only DCP's metadata classes, torch sizes, dtypes and layouts and
    paths, and the non-tensor items with ``weights_only=True`` (the checkpoint's sha256s were checked
    before: trainer/checkpoint_format.py)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _read_metadata(directory)  # a refusal here is one InputError, not DCP's per-rank exception report
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _single_process_quiet():
        dcp.load(state, storage_reader=_checked_reader(directory), planner=_checked_planner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


_METADATA_FILE = ".metadata"  # DCP's name for the pickled checkpoint metadata
# Every global DCP's .metadata pickles (torch 2.x), as exact (module, name) pairs. Never a whole module: from
# protocol 4 on, a dotted name (``os.system``) resolves through whatever the module imported.
_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")})


def _metadata_unpickler(f, where: str):
    """An unpickler of DCP's ``.metadata`` that builds only the globals of ``_METADATA_GLOBALS`` and torch's
    dtypes, each looked up by its exact name (torch itself offers no reader of the metadata without pickle)."""
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if "." not in name:
                if (module, name) in _METADATA_GLOBALS:
                    return super().find_class(module, name)
                if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                    return getattr(torch, name)
            raise InputError(f"{where}: holds {module}.{name}, which checkpoint metadata never does; refusing "
                             "to load it")

    return Restricted(f)


def _read_metadata(directory):
    """DCP's ``.metadata`` in ``directory``, through the restricted unpickler; InputError naming it."""
    from pathlib import Path

    from torch.distributed.checkpoint.metadata import Metadata

    where = Path(directory) / _METADATA_FILE
    try:
        with open(where, "rb") as f:
            metadata = _metadata_unpickler(f, str(where)).load()
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"{where}: unreadable ({type(e).__name__}); the checkpoint is corrupt") from None
    if not isinstance(metadata, Metadata):
        raise InputError(f"{where}: not checkpoint metadata; the checkpoint is corrupt")
    return metadata


def _checked_reader(directory):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = _read_metadata(directory)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
            return metadata

    return CheckedReader(str(directory))


def _checked_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class CheckedPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)  # DCP's own: weights_only=False
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return CheckedPlanner()


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Every parameter whole, on rank 0's CPU (None on the other ranks); all ranks must call it (in a save:
    ``model_shards`` then ``gather_whole``, whose collectives time out)."""
    from torch.distributed.checkpoint import state_dict as dcp_state

    options = dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = dcp_state.get_model_state_dict(model, options=options)
    return full if not dist.is_initialized() or dist.get_rank() == 0 else None


def model_shards(model: torch.nn.Module) -> dict:
    """The model's state as this rank holds it, under the parameters' names: FSDP2's shards (DTensors), DDP's
    whole tensors (no collective)."""
    from torch.distributed.checkpoint import state_dict as dcp_state

    return dcp_state.get_model_state_dict(model)


GATHER_KEY = "memplan/save/gathered/"  # + save/rank: the last all-gather of the whole weights that rank ended
GATHER_GRACE_S = 2.0  # seconds rank 0 gives the others to end an all-gather that timed out, before naming them
_gathers = 0  # gather_whole's calls in this process: every rank makes the same calls, so the count names a save


def gather_whole(shards: dict, what: str) -> dict[str, torch.Tensor] | None:
    """``model_shards``' tensors whole on rank 0's CPU (None on the other ranks). A DTensor's shards are
    all-gathered on the CPU over ``save_group()`` (``DTensor.full_tensor`` on a device mesh of that group), not
    over the training process group: each collective times out after ``save_timeout()``, so a rank that hangs
    or dies during the gather ends the others with one ``RankFailed`` line instead of leaving them in FSDP2's
    all-gather for the training group's 10 minutes. Each rank marks every all-gather it has ended (done, or
    failed) in the process group's store, so that rank 0 names the ranks that had not ended the one that failed
    ``GATHER_GRACE_S`` after it. A rank out of memory there says so itself (the others name it as not
    answering). Any other tensor is this rank's own copy."""
    from torch.distributed.tensor import DTensor

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in shards.items()}
    global _gathers
    _gathers += 1
    me, key = dist.get_rank(), f"{GATHER_KEY}{_gathers}/"
    store = _default_store()
    full = {}
    for i, (name, value) in enumerate(shards.items()):
        if isinstance(value, DTensor):
            try:
                value = _whole_on(_save_mesh(), value)
            except Exception as e:
                _mark(store, f"{key}{me}", i)
                if isinstance(e, (MemoryError, torch.OutOfMemoryError)):  # its own failure: the others time out
                    from trainer.stopping import RankFailed

                    raise RankFailed(f"{what}: rank {me} failed: {cause_of(e)}") from None
                # gloo's timeout or a peer gone (a RuntimeError through functional collectives, not a DistError)
                raise _gather_unanswered(what, e, store, key, i) from None
            _mark(store, f"{key}{me}", i)
        if me == 0:
            full[name] = value.detach().cpu()
    return full if me == 0 else None


_save_mesh_made = None


def _save_mesh():
    """A one-dimensional CPU device mesh of ``save_group()`` (made once)."""
    global _save_mesh_made
    if _save_mesh_made is None:
        from torch.distributed.device_mesh import DeviceMesh

        _save_mesh_made = DeviceMesh.from_group(save_group(), "cpu")
    return _save_mesh_made


def _whole_on(mesh, value) -> torch.Tensor:
    """The DTensor ``value`` whole, its shards all-gathered (on the CPU) over ``mesh``: a mesh of the save group
    where ``value``'s own is one dimension over every rank in order (FSDP2's), else over its own mesh."""
    from torch.distributed.tensor import DTensor

    own = value.device_mesh
    if own.ndim != 1 or own.mesh.flatten().tolist() != list(range(dist.get_world_size())):
        return value.full_tensor()
    local = value.to_local().detach().cpu()
    return DTensor.from_local(local, mesh, value.placements, run_check=False, shape=value.shape,
                              stride=value.stride()).full_tensor()


def _default_store():
    """The process group's key-value store (torchrun's), or None where torch has none to give."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def _mark(store, key: str, at: int) -> None:
    if store is not None:
        try:
            store.set(key, str(at))
        except Exception:  # the store is rank 0's: gone with it; the collective's own error says so
            pass


def _gather_unanswered(what: str, e: BaseException, store, key: str, at: int) -> Exception:
    """The ``RankFailed`` line for the gather's all-gather ``at`` that ended in gloo's error ``e``: on rank 0, the
    ranks that have not ended it ``GATHER_GRACE_S`` later (the others' ended with the same error meanwhile), else
    ``unanswered``'s line (elsewhere, or where the store cannot tell)."""
    import time

    from trainer.stopping import RankFailed

    late = []
    if store is not None and dist.get_rank() == 0:
        time.sleep(min(GATHER_GRACE_S, save_timeout().total_seconds() / 4))
        for rank in range(1, dist.get_world_size()):
            try:
                ended = int(store.get(f"{key}{rank}").decode()) if store.check([f"{key}{rank}"]) else -1
            except Exception:
                ended = -1
            if ended < at:
                late.append(rank)
    if not late:
        return unanswered(what, e)
    ranks = ", ".join(map(str, late))
    return RankFailed(f"{what}: rank{'s' if len(late) > 1 else ''} {ranks} did not answer within "
                      f"{_seconds(save_timeout())} (hung, or died)")


def load_single_process_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, plain_model,
                              plain_optimizer, is_main: bool) -> None:
    """Spread a single-process checkpoint over the ranks: rank 0 has loaded it into a plain CPU
    model and optimizer of the same shape (``plain_*``, None elsewhere); the state is broadcast from
    it, each rank keeping its shards."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    model_sd, optim_sd = get_state_dict(plain_model, plain_optimizer) if is_main else ({}, {})
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # Two calls, not set_state_dict: given an empty model state (every rank but 0), set_state_dict takes
    # it for an optimizer-only load and the ranks' collectives no longer pair up (a hang).
    set_model_state_dict(model, model_sd, options=options)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=options)

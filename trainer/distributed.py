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
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from memplan.errors import InputError
from memplan.setup import TrainSetup

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


def device_for(family: str, local_rank: int) -> torch.device:
    """The torch device of this process: its GPU by local rank on CUDA/ROCm, else the CPU."""
    if family in ("cuda", "rocm"):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init(family: str | None = None) -> DistContext:
    """Join the process group torchrun described (a no-op context for a single process)."""
    from trainer.measure import local_family

    family = family or local_family()
    rank, world_size, local_rank = env_world()
    device = device_for(family, local_rank)
    backend = BACKENDS[family]
    if world_size > 1 and not dist.is_initialized():
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


def is_ddp(model: torch.nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def is_fsdp(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The reference model inside a DDP wrapper (FSDP2 keeps the module itself)."""
    return model.module if is_ddp(model) else model


def no_sync(model: torch.nn.Module, last: bool):
    """DDP's ``no_sync`` for every micro-batch but the last of a step (a no-op otherwise)."""
    if not last and is_ddp(model):
        return model.no_sync()
    return contextlib.nullcontext()


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
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainer.measure import StepMemory, _categories, _random_batches, _TermProbe
    from trainer.model import build_model
    from trainer.step import make_optimizer, param_dtype, set_matmul_precision, train_step

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
        model = build_model(spec, setup.attention, setup.checkpointing, param_dtype(setup.precision), device=device)
        model = wrap_model(model, setup, device, mesh=mesh)
        optimizer = make_optimizer(model, setup.optimizer)
        gen = None if fake else torch.Generator(device).manual_seed(seed + 1 + dist.get_rank())
        for _ in range(WARMUP_STEPS):
            train_step(model, optimizer, _random_batches(spec, setup, device, gen), setup, device.type,
                       check_finite=False)
        tracker = MemTracker()
        tracker.track_external(model, optimizer)

        def live() -> int:
            return int(sum(snap.get("Total", 0) for snap in tracker.get_tracker_snapshot("current").values()))

        probe = None if fake else _TermProbe(model, optimizer, live)  # fake tensors have no storages to count
        last = setup.grad_accum - 1

        def before(i: int) -> None:
            tracker.reset_mod_stats()
            if probe is not None and i == last:
                probe.before_forward(i)

        with tracker:
            batches = _random_batches(spec, setup, device, gen)
            train_step(model, optimizer, batches, setup, device.type, check_finite=False, before_forward=before,
                       after_forward=lambda i: probe.after_forward(i) if probe is not None and i == last else None)
            del batches
        snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
        terms = probe.finish() if probe is not None else {}
    total = int(snapshot.get("Total", sum(snapshot.values())))
    method = "MemTracker under FakeTensorMode, fake process group" if fake else "MemTracker on real tensors, gloo"
    return StepMemory(peak_allocated=total, breakdown=_categories(snapshot), terms=terms,
                      method=f"{method} (rank {dist.get_rank()})")


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


def _measure_worker(rank: int, world_size: int, store_path: str, configs: list, out_dir: str) -> None:
    """One rank of ``measure_ranks``: every config in turn, its StepMemory pickled to out_dir."""
    import gc
    import pickle

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # as torchrun does: the ranks share the cores
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    try:
        results = []
        for spec, setup in configs:
            results.append(_rank_step_memory(spec, setup, torch.device("cpu")))
            gc.collect()
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
    finally:
        dist.destroy_process_group()


def measure_ranks(configs: list, world_size: int) -> list[list]:
    """Measure each (spec, setup) for real on the CPU in ``world_size`` gloo processes started
    here; returns, per config, every rank's StepMemory (MemTracker's peak in that rank)."""
    import pickle
    import tempfile

    import torch.multiprocessing as mp

    for _, setup in configs:
        if setup.world_size != world_size:
            raise InputError(f"--world-size {world_size}: a config asks for world size {setup.world_size}")
    with tempfile.TemporaryDirectory(prefix="memplan-ranks-") as tmp:
        mp.start_processes(_measure_worker, args=(world_size, os.path.join(tmp, "store"), configs, tmp),
                           nprocs=world_size, join=True, start_method="spawn")
        per_rank = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                per_rank.append(pickle.load(f))
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(configs))]


# =================================================================================================
# Checkpoints: torch.distributed.checkpoint, readable at any world size
# =================================================================================================

CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_META = "meta.json"  # step, data stream state, plan: written by rank 0 next to DCP's files


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes a single process when there is no process group: so it is."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def checkpoint_path(run_dir, step: int):
    from pathlib import Path

    return Path(run_dir) / CHECKPOINT_DIR / f"step-{step:08d}"


def latest_checkpoint(run_dir):
    """The newest complete checkpoint of a run (complete = renamed into place with its meta.json), or None."""
    from pathlib import Path

    found = sorted(p for p in (Path(run_dir) / CHECKPOINT_DIR).glob("step-*")
                   if p.is_dir() and (p / CHECKPOINT_META).is_file())
    return found[-1] if found else None


def save_checkpoint(path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict) -> None:
    """Save model and optimizer with ``torch.distributed.checkpoint`` (every rank writes its own
    shards; no rank gathers the whole model) into ``path``, atomically: into a hidden directory
    first, renamed by rank 0 once every rank has written and the meta is on disk."""
    import json
    import shutil
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    _barrier()
    if rank0:
        with open(tmp / CHECKPOINT_META, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    _barrier()


def load_checkpoint(path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load a checkpoint of ``save_checkpoint`` into this run's (wrapped) model and optimizer,
    whatever the world size and sharding it was saved with (DCP reshards on load); returns its meta."""
    import json
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    try:
        meta = json.loads((path / CHECKPOINT_META).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"checkpoint {path}: cannot read {CHECKPOINT_META} ({e})") from None
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return meta


# =================================================================================================
# The run: python -m trainer (under torchrun for several processes)
# =================================================================================================

METRICS_FILE = "metrics.jsonl"
PLAN_FILE = "plan.toml"


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What ``python -m trainer`` was asked for, beyond the plan."""

    data: str
    out: str
    max_steps: int
    save_every: int = 0  # 0: only at the end
    seed: int = 0
    lr: float = 6e-4
    resume: bool = False
    sharding: str | None = None  # asked for on the command line (else the plan's, else ddp)


def rescaled_for_world(setup: TrainSetup, world_size: int, sharding: str | None = None) -> TrainSetup:
    """The setup with ``world_size`` ranks and the same global batch: gradient accumulation
    scaled by old/new world size (micro-batches, and so the memory of each, stay as they were)."""
    if world_size == setup.world_size:
        return setup
    tokens = setup.grad_accum * setup.world_size
    if tokens % world_size:
        raise InputError(f"a global batch of {setup.grad_accum} × {setup.world_size} micro-batches cannot be split "
                         f"evenly over {world_size} processes; use a world size dividing {tokens}")
    sharding = "none" if world_size == 1 else (sharding or (setup.sharding if setup.sharding != "none" else "ddp"))
    return setup.replace(grad_accum=tokens // world_size, world_size=world_size, sharding=sharding)


def build_wrapped_model(spec, setup: TrainSetup, ctx: DistContext, seed: int) -> torch.nn.Module:
    """The reference model with the initial weights of a single-process run with ``seed``, wrapped.

    DDP: every rank builds it on its device (DDP then broadcasts rank 0's weights anyway). FSDP:
    no rank ever holds the whole model on its device. The model is built on the meta device,
    sharded, and given storage for its shards only; rank 0 builds the initial weights in host
    memory and broadcasts them, each rank keeping its shards
    (``set_model_state_dict(..., broadcast_from_rank0=True)``).
    """
    from trainer.model import build_model
    from trainer.step import param_dtype

    dtype = param_dtype(setup.precision)
    if setup.sharding != "fsdp":
        torch.manual_seed(seed)
        return wrap_model(build_model(spec, setup.attention, setup.checkpointing, dtype, device=ctx.device),
                          setup, ctx.device)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = wrap_model(build_model(spec, setup.attention, setup.checkpointing, dtype, device="meta"), setup,
                       ctx.device)
    model.to_empty(device=ctx.device)
    full = {}
    if ctx.is_main:
        torch.manual_seed(seed)
        full = build_model(spec, setup.attention, setup.checkpointing, dtype, device="cpu").state_dict()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def run(plan, config: RunConfig) -> None:
    """Train ``plan`` on the prepared data in every rank of this process group (or alone).

    Each rank builds the same initial model (same seed), wraps it (``wrap_model``), reads its
    own share of every global micro-batch (``TrainStream`` with rank and world size: no window
    is read by two ranks, and together they read what one process with the same global batch
    reads) and runs ``train_step``. Rank 0 alone writes RUN/metrics.jsonl and RUN/plan.toml; all
    ranks take part in checkpoints (``save_checkpoint``).
    """
    import json
    import time
    from pathlib import Path

    from memplan.plan import Plan
    from trainer.data import PreparedData, TrainStream
    from trainer.step import make_optimizer, set_matmul_precision, train_step

    ctx = init()
    try:
        out = Path(config.out)
        data = PreparedData(config.data)
        spec, setup = plan.model, plan.setup
        if spec.vocab != data.vocab_size:
            spec = spec.replace(vocab=data.vocab_size)
        checkpoint, meta = None, None
        if config.resume:
            checkpoint = latest_checkpoint(out)
            if checkpoint is None:
                raise InputError(f"--resume: {out} has no checkpoint to resume from")
            meta = json.loads((checkpoint / CHECKPOINT_META).read_text(encoding="utf-8"))
            saved = Plan.from_dict(meta["plan"], f"checkpoint {checkpoint}")
            spec, setup = saved.model, saved.setup
        setup = rescaled_for_world(setup, ctx.world_size,
                                   config.sharding or (setup.sharding if setup.sharding != "none" else None))
        plan = Plan(model=spec, setup=setup, device=plan.device, budget_bytes=plan.budget_bytes,
                    predicted=plan.predicted)
        if ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
            plan.save(out / PLAN_FILE)

        set_matmul_precision(setup.precision)
        model = build_wrapped_model(spec, setup, ctx, config.seed)
        optimizer = make_optimizer(model, setup.optimizer, lr=config.lr)
        scaler = None
        if setup.precision == "fp16-mixed" and ctx.device.type == "cuda":
            scaler = torch.amp.GradScaler("cuda")
        stream = TrainStream(data, batch=setup.micro_batch, ctx=setup.ctx, seed=config.seed, rank=ctx.rank,
                             world_size=ctx.world_size)
        step = 0
        if checkpoint is not None:
            load_checkpoint(checkpoint, model, optimizer)
            stream.load_state_dict(meta["data"])
            step = int(meta["step"])
        metrics = open(out / METRICS_FILE, "a", encoding="utf-8") if ctx.is_main else None
        try:
            if metrics is not None and checkpoint is not None:
                metrics.write(json.dumps({"kind": "event", "event": "resume", "step": step,
                                          "world_size": ctx.world_size, "sharding": setup.sharding,
                                          "from": str(checkpoint)}) + "\n")
            tokens_per_step = setup.tokens_per_step
            while step < config.max_steps:
                batches = [tuple(t.to(ctx.device, non_blocking=True) for t in next(stream))
                           for _ in range(setup.grad_accum)]
                t0 = time.perf_counter()
                result = train_step(model, optimizer, batches, setup, ctx.device.type, scaler=scaler)
                loss = float(mean_across_ranks(result.loss))
                seconds = time.perf_counter() - t0
                step += 1
                if metrics is not None:
                    metrics.write(json.dumps({
                        "kind": "train", "step": step, "loss": loss, "tokens_per_second": tokens_per_step / seconds,
                        "grad_norm": float(result.grad_norm), "step_seconds": seconds, "skipped": result.skipped,
                        "world_size": ctx.world_size, "sharding": setup.sharding}) + "\n")
                    metrics.flush()
                if step == config.max_steps or (config.save_every and step % config.save_every == 0):
                    save_checkpoint(checkpoint_path(out, step), model, optimizer,
                                    {"step": step, "data": stream.state_dict(), "plan": plan.to_dict(),
                                     "world_size": ctx.world_size, "sharding": setup.sharding})
        finally:
            if metrics is not None:
                metrics.close()
    finally:
        shutdown()

"""``memplan autotune --world-size N --verify``: a plan's trial on N real ranks of this machine.

A trial of a plan for several devices runs as that plan trains: N processes, one per rank, each with the plan's
micro-batches, wrapped for its sharding, the gradients all-reduced (DDP) or the parameters all-gathered and the
gradients reduce-scattered (FSDP2) with the other ranks. On a CPU the ranks are N gloo processes sharing this
machine's cores; on a CUDA machine with at least N GPUs, rank r runs on GPU r over NCCL (written so, not run by
memplan's tests: they never need a GPU). The ranks are ``trainer.distributed.measure_ranks``' (spawned, a
FileStore, the process group's timeout), each running ``rank_trial``:

- memplan's own stack: the trainer's model wrapped as ``trainer.distributed.build_wrapped_model`` wraps it for
  ``torchrun -m trainer`` (DDP, or FSDP2 built on the meta device and filled from rank 0), its step
  ``trainer.step.train_step``;
- another stack: its model and step wrapped by its module's ``wrap_ranks`` (``trainer.stacks.ranks``: litgpt,
  Fabric's DDPStrategy; torchtune, its recipes' ``shard_model``), whatever sharding that accepts; a stack without
  ``wrap_ranks`` (transformers' Trainer) is refused in one line.

Each rank measures its own peak as the one-process trial does (``trainer.verify.run_trial``): on the CPU the
profile's runtime context plus the growth of the rank's resident memory over a baseline taken after a warm-up
step of a tiny model wrapped the same way; on CUDA ``max_memory_reserved`` plus what the GPU holds outside the
allocator. The baseline is before the model is built; the high-water mark is reset once it is built and wrapped
(FSDP2 from rank 0's whole host copy), so the peak is the steps'. The trial's peak is the largest rank's, each
against the walk's per-rank prediction; its tokens/s are the global batch's tokens of a trial step over the median
step, a step lasting as long as its slowest rank.

Each trial's ranks run under a ``python -m trainer.verify_ranks`` process of their own (the CLI never imports torch),
killed with every rank after ``timeout_s`` (``TIMEOUT_S``, 30 minutes); a collective that waits longer than the
process group's timeout (``trainer.distributed.TIMEOUT``, 10 minutes, as ``memplan validate``'s ranks) fails in its
rank first. A rank that hangs ends the trial as an error, never verify.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

from memplan.errors import InputError
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.units import possessive
from trainer.verify import DEFAULT_MAX_MICRO_BATCHES, DEFAULT_STEPS, TrialResult, _repo_env, is_out_of_memory, verify

TIMEOUT_S = 1800.0  # the longest a trial on several ranks may take, start to end, before it and its ranks are killed
REFUSED = "refused"  # the key of the ranks process's answer when the trial cannot run here (an InputError)


# ---- in each rank -------------------------------------------------------------------------

def _warm_up_rank(spec: ModelSpec, setup: TrainSetup, device) -> None:
    """Steps of a tiny model of the plan's configuration, memplan's own wrapped for its sharding with the other
    ranks: loads the code of every kernel and of torch's wrappers (DDP's reducer, FSDP2's hooks) before the
    baseline (CPU). Never another stack's library: imported after the baseline, its code's resident memory is in
    the growth, as the plan's ``model_code`` term predicts it (``run_trial`` likewise)."""
    import gc

    from trainer.verify import WARMUP_CTX

    tiny = spec.replace(layers=1, hidden=32, heads=2, kv_heads=1 if spec.kv_heads < spec.heads else 2, ffn=64,
                        vocab=64, name="warm-up")
    warm = setup.replace(ctx=min(setup.ctx, WARMUP_CTX), micro_batch=1, grad_accum=min(2, setup.grad_accum),
                         compile=False)
    for _ in _steps(tiny, warm, warm, 2, "memplan", None, device, seed=0):
        pass
    gc.collect()


def _steps(spec: ModelSpec, setup: TrainSetup, run_setup: TrainSetup, steps: int, stack: str, wrap, device,
           seed: int, built=None):
    """Build the model wrapped for ``setup.sharding`` and run ``steps`` steps of its step, yielding each step's
    seconds (``built()`` is called once the model is wrapped, before the first step)."""
    import torch
    import torch.distributed as dist

    from trainer import device as devices
    from trainer.step import make_optimizer, set_matmul_precision

    set_matmul_precision(setup.precision)
    scaler = None
    if stack == "memplan":
        from trainer.distributed import DistContext, build_wrapped_model
        from trainer.step import train_step as step

        ctx = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=dist.get_rank(),
                          device=device, backend=dist.get_backend())
        net = build_wrapped_model(spec, setup, ctx, seed)
        optimizer = make_optimizer(net, setup.optimizer)
        if setup.compile:
            net = torch.compile(net)
        if setup.precision == "fp16-mixed":
            scaler = torch.amp.GradScaler(device.type)
        vocab = spec.vocab
    else:
        from trainer.stacks import StackModel, _built, _vocab

        model = StackModel(spec=spec)
        torch.manual_seed(seed)  # the same weights in every rank
        with torch.device(device):
            net, optimizer, step = _built(stack, model, setup, None, wrap)
        vocab = _vocab(model)
    if built is not None:
        built()
    gen = torch.Generator(device=device).manual_seed(seed + 1 + dist.get_rank())  # each rank its own batches

    def ids():
        return torch.randint(0, vocab, (setup.micro_batch, setup.ctx), device=device, generator=gen)

    batches = [(ids(), ids()) for _ in range(setup.grad_accum)]  # held for the whole step, as in training
    sync = devices.synchronizer(device)
    kwargs = {"scaler": scaler} if stack == "memplan" else {}
    for _ in range(steps):
        t0 = time.perf_counter()
        step(net, optimizer, batches[:run_setup.grad_accum], run_setup, device.type, **kwargs)
        sync()
        yield time.perf_counter() - t0


def _wrapper(stack: str):
    """The stack's ``wrap_ranks`` (None for memplan's own, which ``build_wrapped_model`` wraps); InputError where
    the stack has none."""
    if stack == "memplan":
        return None
    from trainer.stacks import _stack_module

    wrap = getattr(_stack_module(stack), "wrap_ranks", None)
    if wrap is None:
        raise InputError(f"--verify --world-size: --stack {stack}: {possessive(stack)} code is not run on several "
                         "ranks here "
                         f"(accepted: --stack {', '.join(ranked_stacks())})")
    return wrap


def ranked_stacks() -> list[str]:
    """The stacks whose trial runs on several ranks: memplan's own and every one whose module has ``wrap_ranks``."""
    from trainer.stacks import STACKS, _stack_module

    return ["memplan"] + [s for s in STACKS if s != "memplan" and hasattr(_stack_module(s), "wrap_ranks")]


def rank_trial(spec: ModelSpec, setup: TrainSetup, request: dict) -> dict:
    """One rank's trial (run by ``measure_ranks`` in each rank): warm-up and baseline (CPU), the model built and
    wrapped, ``steps`` steps; what it measured, as ``run_trial``'s JSON data plus ``rank``."""
    import torch
    import torch.distributed as dist

    from trainer import device as devices

    stack = request.get("stack", "memplan")
    rank = dist.get_rank()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if request.get("threads"):
        torch.set_num_threads(int(request["threads"]))
    run_setup = setup.replace(grad_accum=min(setup.grad_accum, int(request["max_micro_batches"])))
    out = {"rank": rank, "status": "ok", "steps_run": 0, "micro_batches": run_setup.grad_accum, "error": "",
           "peak_bytes": None, "peak_allocated": None, "peak_rss": None, "baseline_rss": None, "step_seconds": []}
    baseline = 0
    if cuda:
        devices.reset_allocator_peaks(device)
    else:
        _warm_up_rank(spec, setup, device)
        devices.trim_heap()
        devices.keep_heap_resident()
        baseline = out["baseline_rss"] = devices.current_rss()

    def built() -> None:  # the construction's transient copies (FSDP2: rank 0's whole model) are not the steps'
        import gc

        gc.collect()
        if not cuda:
            devices.trim_heap()
            out["hwm_reset"] = devices.reset_peak_rss()

    for seconds in _steps(spec, setup, run_setup, int(request["steps"]), stack, _wrapper(stack), device,
                          int(request.get("seed", 0)), built):
        out["step_seconds"].append(seconds)
        out["steps_run"] += 1
    if cuda:
        outside = devices.outside_allocator_bytes(device)
        allocator = devices.allocator_memory(device)
        out["peak_allocated"] = allocator.peak_allocated
        out["peak_bytes"] = allocator.peak_reserved + int(outside)
    else:
        out["peak_rss"] = devices.peak_rss()
        out["peak_bytes"] = int(request["context_bytes"]) + max(0, out["peak_rss"] - baseline)
    return out


# ---- the ranks' process: python -m trainer.verify_ranks -------------------------------------

def _failure(e: BaseException) -> dict:
    """The trial's result when a rank raised or died (``torch.multiprocessing``'s exceptions): oom or error,
    naming the rank and the last line of its error."""
    import torch.multiprocessing as mp

    if isinstance(e, mp.ProcessExitedException):
        killed = e.signal_name == "SIGKILL"
        return {"status": "oom" if killed else "error",
                "error": f"rank {e.error_index}: {e}" + (" (on Linux, the kernel's out-of-memory killer)"
                                                         if killed else "")}
    if isinstance(e, mp.ProcessRaisedException):
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else type(e).__name__
        return {"status": "oom" if is_out_of_memory(RuntimeError(last)) else "error",
                "error": f"rank {e.error_index}: {last}"[:500]}
    return {"status": "oom" if is_out_of_memory(e) else "error", "error": f"{type(e).__name__}: {e}"[:500]}


def _backend(world_size: int) -> tuple[str, str]:
    """(family, backend) of this machine's ranks: nccl where CUDA (or ROCm) has ``world_size`` GPUs, gloo on a
    CPU; InputError otherwise."""
    from trainer import device as devices

    family = devices.local_family()
    if family == "cpu":
        return family, "gloo"
    if family in ("cuda", "rocm"):
        import torch

        have = torch.cuda.device_count()
        if have < world_size:
            raise InputError(f"--verify --world-size {world_size}: this machine has {have} GPU{'s' if have != 1 else ''};"
                             f" the trial runs one rank per GPU (accepted: --world-size up to {have})")
        return family, "nccl"
    raise InputError(f"--verify --world-size {world_size}: ranks on {family} are not run here (accepted: a CPU over "
                     "gloo, CUDA or ROCm GPUs over NCCL)")


def run_ranks(request: dict) -> dict:
    """The trial of ``request`` on its setup's world size of ranks (``measure_ranks`` with ``rank_trial``)."""
    import datetime
    import functools

    from trainer.distributed import TIMEOUT, measure_ranks

    spec, setup = ModelSpec(**request["model"]), TrainSetup(**request["setup"])
    family, backend = _backend(setup.world_size)
    _wrapper(request.get("stack", "memplan"))  # refused before any rank starts
    measure = functools.partial(rank_trial, request=request)
    # a collective waits at most the process group's TIMEOUT (10 minutes, measure_ranks' own), or the trial's whole time
    timeout = min(TIMEOUT, datetime.timedelta(seconds=float(request.get("timeout_s", TIMEOUT_S))))
    try:
        ranks = measure_ranks([(spec, setup)], setup.world_size, measure=measure, backend=backend, timeout=timeout)[0]
    except Exception as e:  # noqa: BLE001 - a rank's error or death is the trial's outcome
        return {"status": "error", "family": family, **_failure(e), "ranks": []}
    return {"status": "ok", "family": family, "ranks": ranks}


def main() -> None:
    """``python -m trainer.verify_ranks`` (used by ``RankTrialRunner``): the request on stdin, the result on
    stdout, one JSON line each."""
    try:
        result = run_ranks(json.loads(sys.stdin.read()))
    except InputError as e:
        result = {REFUSED: str(e)}
    sys.stdout.write(json.dumps(result) + "\n")


# ---- from the parent ----------------------------------------------------------------------

def combined(setup: TrainSetup, data: dict, tokens_per_rank_step: int) -> dict:
    """``run_trial``'s JSON data for the whole trial from the ranks': the largest rank's peak, the first failure,
    tokens/s of the global batch over the median step (a step lasting as long as its slowest rank)."""
    ranks = sorted(data.get("ranks") or [], key=lambda r: r["rank"])
    out = {"status": data.get("status", "error"), "error": data.get("error", ""), "family": data.get("family", ""),
           "ranks": ranks, "steps_run": max((r["steps_run"] for r in ranks), default=1),
           "micro_batches": ranks[0]["micro_batches"] if ranks else 0}
    if not ranks:
        return out
    peaks = [r["peak_bytes"] for r in ranks]
    out["peak_bytes"] = max(peaks)
    if all(r.get("peak_allocated") is not None for r in ranks):
        out["peak_allocated"] = max(r["peak_allocated"] for r in ranks)
    if all(r.get("peak_rss") is not None for r in ranks):
        out["peak_rss"] = max(r["peak_rss"] for r in ranks)
    steps = [max(r["step_seconds"][i] for r in ranks) for i in range(min(len(r["step_seconds"]) for r in ranks))]
    out["step_seconds"] = steps
    timed = steps[1:] or steps
    if timed:
        out["tokens_per_second"] = tokens_per_rank_step * setup.world_size / statistics.median(timed)
    return out


class RankTrialRunner:
    """``trainer.verify.TrialRunner``'s interface for plans of several ranks: each trial a ``python -m
    trainer.verify_ranks trial`` process starting the ranks, killed with them after ``timeout_s``.

    Use as a context manager; ``family`` is this machine's device family. A trial of a stack whose code is not
    run on ranks here is refused (InputError) before any rank starts."""

    def __init__(self, stack: str = "memplan", env: dict[str, str] | None = None, timeout_s: float = TIMEOUT_S):
        self.stack, self.env, self.timeout_s = stack, dict(env or {}), float(timeout_s)
        self.family: str | None = None

    def __enter__(self) -> "RankTrialRunner":
        from memplan.hardware import detect_local

        self.family = detect_local().family  # (torch is imported by the ranks only)
        return self

    def __exit__(self, *exc) -> None:
        self.family = None

    def close(self) -> None:
        self.family = None

    def _call(self, request: str) -> dict:
        """Run ``python -m trainer.verify_ranks`` on ``request`` in a session of its own; its answer (a refusal
        raised here as InputError), or an error result when it died or outlived ``timeout_s`` (then it and its
        ranks are killed)."""
        timeout_s = self.timeout_s
        proc = subprocess.Popen([sys.executable, "-m", "trainer.verify_ranks"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_repo_env(self.env),
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(request, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks' process and every rank it spawned (one session)
            proc.communicate()
            return {"status": "error", "error": f"the ranks did not finish within {timeout_s:g} s (a rank hung?); "
                                                "they were killed"}
        lines = stdout.strip().splitlines()
        answer = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
        if answer is None:
            tail = [ln for ln in stderr.strip().splitlines() if ln.strip()]
            return {"status": "error", "error": f"the ranks' process exited with status {proc.returncode}"
                                                + (f"; stderr: {tail[-1][:300]}" if tail else "")}
        if REFUSED in answer:
            raise InputError(answer[REFUSED])
        return answer

    def run(self, spec: ModelSpec, setup: TrainSetup, *, steps: int = DEFAULT_STEPS,
            max_micro_batches: int = DEFAULT_MAX_MICRO_BATCHES, context_bytes: int = 0, seed: int = 0,
            stack: str = "memplan", emitted: dict[str, str] | None = None) -> TrialResult:
        """One trial of ``setup`` on ``setup.world_size`` ranks (``emitted`` is transformers', not run on ranks)."""
        if self.family is None:
            raise RuntimeError("RankTrialRunner.run outside `with RankTrialRunner() as runner:`")
        threads = self.env.get("OMP_NUM_THREADS")
        request = {"model": spec.to_dict(), "setup": setup.to_dict(), "steps": steps,
                   "max_micro_batches": max_micro_batches, "context_bytes": context_bytes, "seed": seed,
                   "stack": stack, "timeout_s": self.timeout_s, "threads": int(threads) if threads else None}
        data = self._call(json.dumps(request))
        run_accum = min(setup.grad_accum, max_micro_batches)
        data = combined(setup, data, setup.micro_batch * setup.ctx * run_accum)
        data.setdefault("family", self.family)
        data["method"] = _method(stack, setup, self.family)
        return TrialResult.from_json(setup, data)


def _method(stack: str, setup: TrainSetup, family: str) -> str:
    if stack == "memplan":
        code = "memplan's trainer"
    else:
        from trainer.stacks import TRIAL_CODE

        code = f"{TRIAL_CODE[stack]}, wrapped as its distributed code wraps it (trainer/stacks/{stack}.py wrap_ranks)"
    if family == "cpu":
        how = ("gloo on this CPU; per rank: profile runtime context + growth of resident memory (VmHWM, reset once "
               "the model is built) over a baseline taken after a warm-up step")
    else:
        how = "NCCL, one GPU each; per rank: torch.cuda.max_memory_reserved + memory outside the allocator"
    return f"{code}, {setup.sharding.upper()} over {setup.world_size} ranks, {how}"


def rank_threads(threads: int | None, world_size: int) -> int:
    """Torch threads in each of ``world_size`` ranks sharing this machine's cores: ``threads`` (else all the
    cores), at most the cores over the ranks (more would have the ranks' OpenMP pools spin against each other)."""
    cores = os.cpu_count() or 1
    return max(1, min(threads or cores, cores // world_size))


def verify_on_ranks(result, *, steps: int = DEFAULT_STEPS, threads: int | None = None, on_attempt=None):
    """``trainer.verify.verify`` of a plan for ``result.world_size`` devices, each trial on that many ranks of
    this machine (``RankTrialRunner``), each rank with ``rank_threads(threads, world_size)`` torch threads."""
    env = {"OMP_NUM_THREADS": str(rank_threads(threads, result.world_size))}
    with RankTrialRunner(stack=result._evaluator.stack.name, env=env) as runner:
        return verify(result, steps=steps, runner=runner, on_attempt=on_attempt)


if __name__ == "__main__":
    main()

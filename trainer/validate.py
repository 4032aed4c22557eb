"""Run one validation config: the analytic prediction, the exact trace, and a real measured step on the local device."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from memplan.errors import InputError
from memplan.hardware import Device
from memplan.memory.stacks import stack_class
from memplan.memory import (COLLECTIVES_OF_FAMILY, ddp_bucket_bytes, fsdp_all_sharded_grad_bytes,
                            fsdp_optimizer_state_bytes, fsdp_sharded_weight_bytes, gradient_bytes, optimizer_state_bytes,
                            peak_memory, peak_memory_of_rank, rope_buffer_bytes, sdpa_gqa_repeats, weight_bytes)
from memplan.validate import MatrixConfig, ValidationRow
from trainer import device as devices
from trainer.measure import measure_step, trace_step


def predicted_terms(config: MatrixConfig) -> dict[str, int]:
    """The analytic counterparts of what ``trainer.measure._TermProbe`` reads off a real step."""
    spec, setup = config.spec, config.setup
    walk_marks = {m.name: m.total for m in peak_memory(spec, setup).moments}
    return {
        "weights": weight_bytes(spec, setup) + rope_buffer_bytes(spec, setup),
        "gradients": gradient_bytes(spec, setup),
        "optimizer": optimizer_state_bytes(spec, setup),
        "forward_saved": walk_marks["end of forward"] - walk_marks["start of forward"],
    }


def run_config(config: MatrixConfig, device: Device, trace: bool = True) -> ValidationRow:
    """Predict, trace and measure one config on the local device.

    On a GPU the walk repeats K/V where this device's SDPA does (``sdpa_gqa_repeats``: grouped-query
    attention without a flash kernel for the dtype), and the row carries the reserve as well as the
    live tensors: ``max_memory_reserved`` against the predicted allocator reserve, and the driver's
    figure at the peak (NVML, ROCm SMI) against the predicted ``peak_reserved``."""
    t0 = time.perf_counter()
    family = devices.local_family()
    repeat = sdpa_gqa_repeats(config.spec, config.setup, device.flash_attention, family)
    from memplan.memory.stacks import stack_for

    predicted = peak_memory(config.spec, config.setup, device.runtime_context_bytes, device.allocator_overhead,
                            repeat, stack=stack_for("memplan", cpu=family == "cpu"))  # dropout masks as made here
    if config.setup.compile:  # the compiled step, measured and traced as torch.compile runs it
        measured, traced = _compiled_step(config, family, trace)
    else:
        measured = measure_step(config.spec, config.setup, family)
        traced = trace_step(config.spec, config.setup, devices.fake_device(family)) if trace else None
    rss_delta = (measured.peak_rss - measured.baseline_rss) if measured.peak_rss is not None else None
    return ValidationRow(
        name=config.name, spec=config.spec, setup=config.setup,
        predicted_allocated=predicted.peak_allocated, measured_allocated=measured.peak_allocated,
        trace_allocated=traced.peak_allocated if traced else None,
        predicted_reserved=predicted.peak_reserved,
        measured_reserved=measured.peak_reserved, driver_used=measured.driver_used, measured_rss_delta=rss_delta,
        peak_moment=predicted.peak_moment, predicted_terms=predicted_terms(config), measured_terms=measured.terms,
        seconds=time.perf_counter() - t0, **_reserve_fields(device, measured, family),
    )


def _compiled_step(config: MatrixConfig, family: str, trace: bool):
    """A ``compile = true`` config: a real compiled step's peak on this CPU (``measure_compiled_step``) and the
    compiled trace (``trace_compiled_step``: inductor's partitioner on fake tensors). One line where this machine
    cannot compile or is not the CPU."""
    from trainer.compile_guard import compile_unavailable
    from trainer.compiled_trace import trace_compiled_step
    from trainer.measure import measure_compiled_step

    if family != "cpu":
        raise InputError(f"{config.name}: compiled configs (compile = true) are measured on the CPU only; "
                         f"this device is {family}")
    why = compile_unavailable("cpu")
    if why:
        raise InputError(f"{config.name}: compile = true, but {why}")
    traced = trace_compiled_step(config.spec, config.setup) if trace else None
    return measure_compiled_step(config.spec, config.setup), traced


def _reserve_fields(device: Device, measured, family: str) -> dict:
    """A GPU row's reserve figures: the predicted runtime context (what peak_reserved holds beyond the
    allocator's reserve), and the driver's peak with where it was read. Nothing on a CPU."""
    if family == "cpu" or measured.peak_reserved is None:
        return {}
    return {"predicted_context": device.runtime_context_bytes, "driver_peak": measured.driver_peak,
            "driver_source": measured.driver_source or None, "family": family}



def run_stack_config(config: MatrixConfig, device: Device, stack: str, trace: bool = True) -> ValidationRow:
    """One config with another library's code (``trainer/stacks``): its real two steps on this CPU
    (``measure_stack``, MemTracker on real tensors) against the analytic walk and the stack's trace."""
    from trainer.stacks import StackModel, measure_stack, trace_stack

    from memplan.memory.stacks import stack_for

    t0 = time.perf_counter()
    family = devices.local_family()
    model = StackModel(spec=config.spec)
    hooks = stack_for(stack, cpu=family == "cpu")  # the walk with the stack's hooks (memplan.memory.stacks)
    predicted = peak_memory(config.spec, config.setup, device.runtime_context_bytes, device.allocator_overhead,
                            stack=hooks)
    if family == "cpu":
        measured = measure_stack(stack, model, config.setup)
    else:
        measured = measure_stack_on_device(stack, model, config.setup, family)
    traced = trace_stack(stack, model, config.setup, devices.fake_device(family)) if trace else None
    return ValidationRow(
        name=f"{config.name} ({stack})", spec=config.spec, setup=config.setup,
        predicted_allocated=predicted.peak_allocated, measured_allocated=measured.peak_allocated,
        trace_allocated=traced.peak_allocated if traced else None, predicted_reserved=predicted.peak_reserved,
        measured_reserved=measured.peak_reserved, driver_used=measured.driver_used,
        peak_moment=predicted.peak_moment, seconds=time.perf_counter() - t0, stack=stack,
        **_reserve_fields(device, measured, family),
    )


def measure_stack_on_device(stack: str, model, setup, family: str, seed: int = 0):
    """A stack's warm-up step and steady-state step on this machine's GPU, built as ``trace_stack`` builds
    it (``trainer.stacks``), read as memplan's own step is read there (``trainer.measure``: the
    allocator's peaks and the driver on CUDA/ROCm, per-op samples on Apple)."""
    import torch

    from trainer.measure import _allocator_step, _mps_step, _random_ids
    from trainer.stacks import _built, _vocab, check_stack
    from trainer.step import set_matmul_precision

    check_stack(stack)
    dev = devices.torch_device(family)
    torch.manual_seed(seed)
    set_matmul_precision(setup.precision)
    gen = torch.Generator(dev).manual_seed(seed)
    with torch.device(dev):
        net, optimizer, step = _built(stack, model, setup, None)

    def batches():
        return _random_ids(_vocab(model), setup, dev, gen)

    if family == "mps":
        result = _mps_step(net, optimizer, batches, setup, step_fn=step)
    else:
        result = _allocator_step(net, optimizer, batches, setup, family, step_fn=step, probe_terms=False)
    del net, optimizer
    devices.release_cached(dev)
    return result


def stack_can_run(config: MatrixConfig, stack: str) -> str | None:
    """Why ``stack``'s code cannot take ``config``'s step (None when it can), for what no library refuses
    itself: several processes, and compile (a stack's step runs eagerly). What a library cannot build
    (memplan's selective checkpointing, an optimizer it lacks) it refuses in one InputError line when
    ``run_stack_config`` builds it, and validate lists that config as not run with the library's reason."""
    setup = config.setup
    if not stack_class(stack).library:  # memplan's own step runs every config
        return None
    if setup.world_size > 1:
        return "one process only"
    if setup.compile:
        return "compiled steps are not measured per stack"
    return None


def predicted_rank_terms(config: MatrixConfig, rank: int, collectives: str) -> dict[str, int]:
    """``predicted_terms`` of one rank of a DDP or FSDP step: the sharded (FSDP) or whole
    parameters, DDP's buckets or FSDP's sharded gradients, the rank's optimizer state."""
    spec, setup = config.spec, config.setup
    walk_marks = {m.name: m.total for m in peak_memory_of_rank(spec, setup, rank, collectives=collectives).moments}
    if setup.sharding == "fsdp":
        from memplan.memory import fsdp_compute_setup

        terms = {"weights": fsdp_sharded_weight_bytes(spec, setup) + rope_buffer_bytes(spec, fsdp_compute_setup(setup)),
                 "gradients": fsdp_all_sharded_grad_bytes(spec, setup),
                 "optimizer": fsdp_optimizer_state_bytes(spec, setup, rank)}
    else:
        terms = {"weights": weight_bytes(spec, setup) + rope_buffer_bytes(spec, setup),
                 "gradients": ddp_bucket_bytes(spec, setup), "optimizer": optimizer_state_bytes(spec, setup)}
    terms["forward_saved"] = walk_marks["end of forward"] - walk_marks["start of forward"]
    return terms


def run_distributed(configs: list[MatrixConfig], device: Device, world_size: int,
                    progress=None) -> list[ValidationRow]:
    """Predict every rank of every config and measure them for real: ``world_size`` gloo processes
    on this machine, each measuring its own steady-state step with MemTracker. One row per rank.
    ``progress(done)`` is told how many configs are measured so far (``measure_ranks``)."""
    from trainer.distributed import measure_ranks

    t0 = time.perf_counter()
    collectives = COLLECTIVES_OF_FAMILY["cpu"]  # the ranks run on this machine's CPU, over gloo
    measured = measure_ranks([(c.spec, c.setup) for c in configs], world_size, progress)
    seconds = (time.perf_counter() - t0) / max(1, len(configs) * world_size)
    rows = []
    for config, ranks in zip(configs, measured):
        for rank, m in enumerate(ranks):
            predicted = peak_memory_of_rank(config.spec, config.setup, rank, device.runtime_context_bytes,
                                            device.allocator_overhead, collectives=collectives)
            rows.append(ValidationRow(
                name=f"{config.name} rank {rank}", spec=config.spec, setup=config.setup,
                predicted_allocated=predicted.peak_allocated, measured_allocated=m.peak_allocated,
                predicted_reserved=predicted.peak_reserved, peak_moment=predicted.peak_moment,
                predicted_terms=predicted_rank_terms(config, rank, collectives), measured_terms=m.terms,
                seconds=seconds, rank=rank))
    return rows


# ---- inference: prefill and decode peaks of real generation ------------------------------------

TIMED_DECODE_STEPS = 16  # decode steps timed before the measured last one
_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _tracked_peak(fn, external: list) -> int:
    """Peak live tensor bytes (MemTracker on real tensors) while ``fn`` runs, counting ``external``
    (modules and tensors made before) as live from the start. The list is emptied, so that
    what ``fn`` frees is not kept alive by it."""
    from trainer.measure import PeakTracker

    tracker = PeakTracker()
    tracker.track_external(*external)
    external.clear()
    with tracker:
        fn()
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return int(snapshot.get("Total", sum(int(v) for v in snapshot.values())))


def measure_generation(spec, setup, seed: int = 0) -> dict:
    """Measured peaks of generation on the CPU, as ``trainer.generate.generate_ids`` runs it.

    ``prefill_peak_allocated``: the prompt's forward (``forward_cached`` over P tokens into a cache
    of C positions) and choosing the first token. ``decode_peak_allocated``: the last decode step
    (the cache full to C, the RoPE tables grown step by step as generation grows them, the ids of
    the whole context and the previous logits live) and choosing the next token. The cache is
    filled to its last position by one forward over the tokens after the prompt, then
    ``TIMED_DECODE_STEPS`` single-token steps, as generation leaves it. Live tensor
    bytes by MemTracker, as ``measure_step_cpu`` counts a training step. Also the wall time of the
    decode steps (their median, seconds).
    """
    import statistics

    import torch

    from memplan.errors import InputError
    from trainer.generate import KVCache, SamplingConfig, choose, forward_cached
    from trainer.model import build_model

    if setup.weights_dtype not in _TORCH_DTYPES:
        raise InputError(f"--weights-dtype {setup.weights_dtype}: generation here runs fp32, bf16 or fp16 weights "
                         "only (int8/int4 are planned for llama.cpp-style runtimes)")
    dtype = getattr(torch, _TORCH_DTYPES[setup.weights_dtype])
    torch.manual_seed(seed)
    model = build_model(spec, "sdpa", "none", dtype).eval()
    B, P, C = setup.batch, setup.prompt_tokens, setup.ctx
    cache = KVCache(model, B, C, dtype=getattr(torch, _TORCH_DTYPES.get(setup.cache_dtype, "float32")))
    gen = torch.Generator().manual_seed(seed)
    config = SamplingConfig(greedy=setup.sampling == "greedy", seed=seed)
    ids = torch.randint(0, spec.vocab, (B, C), generator=gen)
    prompt = ids[:, :P].clone()
    out: dict = {}
    with torch.no_grad():
        def prefill():
            out["logits"] = forward_cached(model, prompt, cache, 0)
            choose(out["logits"], config, prompt, gen)

        prefill_peak = _tracked_peak(prefill, [model, *cache.k, *cache.v, prompt])
        del prompt
        times = []
        timed = min(TIMED_DECODE_STEPS, C - 1 - P)
        if C - 1 - timed > P:  # fill the cache up to the timed steps in one forward (the same end state:
            # the cache, the ids and the RoPE tables as one-by-one decoding leaves them)
            out["logits"] = forward_cached(model, ids[:, P:C - 1 - timed], cache, P)
        while cache.length < C - 1:  # decode up to the last step, timing each
            t0 = time.perf_counter()
            out["logits"] = forward_cached(model, ids[:, cache.length:cache.length + 1], cache, cache.length)
            times.append(time.perf_counter() - t0)
        if cache.length != C - 1:
            raise InputError(f"--prompt-tokens {P} leaves no decode step in a cache of {C}; accepted: "
                             "--prompt-tokens below --ctx")

        def decode():
            out["logits"] = forward_cached(model, ids[:, C - 1:C], cache, C - 1)
            choose(out["logits"], config, ids, gen)

        decode_peak = _tracked_peak(decode, [model, *cache.k, *cache.v, ids, out["logits"]])
    return {"prefill_peak_allocated": prefill_peak, "decode_peak_allocated": decode_peak,
            "decode_step_seconds": statistics.median(times) if times else None, "decode_steps": len(times)}


def run_inference_config(config, device: Device):
    """Predict and measure one inference config on this CPU."""
    import torch

    from memplan.inference import (decode_bytes_per_step, decode_dispatch_seconds, inference_memory,
                                   predicted_decode_step)
    from memplan.validate import InferenceRow

    t0 = time.perf_counter()
    predicted = inference_memory(config.spec, config.setup)
    measured = measure_generation(config.spec, config.setup)
    roofline = decode_bytes_per_step(config.spec, config.setup) / device.bandwidth_bytes_per_second
    step = predicted_decode_step(roofline, decode_dispatch_seconds(config.spec, config.setup, device), device.family)
    return InferenceRow(name=config.name, spec=config.spec, setup=config.setup,
                        predicted_prefill=predicted.prefill_peak_allocated,
                        measured_prefill=measured["prefill_peak_allocated"],
                        predicted_decode=predicted.decode_peak_allocated,
                        measured_decode=measured["decode_peak_allocated"],
                        prefill_moment=predicted.prefill_moment, decode_moment=predicted.decode_moment,
                        decode_step_seconds=measured["decode_step_seconds"], roofline_step_seconds=roofline,
                        predicted_step_seconds=step, threads=torch.get_num_threads(),
                        seconds=time.perf_counter() - t0)


# ---- a validation run: which configs on which stacks, then their rows ------------------------------

@dataclass
class Validation:
    """What ``memplan validate`` measures: the configs of a matrix, each on each stack it can run on
    (``jobs``), and those it cannot (``skipped``: config, stack, why)."""

    matrix: str
    stacks: list[str]
    ranks: int
    configs: list[MatrixConfig]
    jobs: list[tuple[MatrixConfig, str]] = field(default_factory=list)
    skipped: list[tuple[MatrixConfig, str, str]] = field(default_factory=list)


def parse_stacks(stack: str) -> list[str]:
    """``--stack``'s comma-separated list, each a stack ``trainer.stacks`` traces, each once."""
    from trainer.stacks import STACKS

    stacks = [t.strip() for t in stack.split(",") if t.strip()]
    if not stacks or any(t not in STACKS for t in stacks) or len(set(stacks)) != len(stacks):
        raise InputError(f"--stack: {stack!r} (accepted: a comma-separated list of {', '.join(STACKS)}, each once)")
    return stacks


def plan_validation(matrix: str | None, quick: bool, ranks: int, stacks: list[str]) -> Validation:
    """The configs of ``matrix`` (default: ``default``, or ``distributed`` for ``ranks`` > 1), their
    quick subset with ``quick``, rescaled for ``ranks`` processes, paired with the stacks that can run
    them. Every refusal is one InputError, before anything is measured, a missing library included."""
    from memplan.validate import DISTRIBUTED_MATRIX, distributed_configs, load_matrix

    matrix = matrix or (DISTRIBUTED_MATRIX if ranks > 1 else "default")
    configs = load_matrix(matrix)
    if quick:
        configs = [c for c in configs if c.quick]
        if not configs:
            raise InputError(f"--quick: matrix {matrix!r} has no config with quick = true")
    if ranks > 1:
        configs = distributed_configs(configs, ranks)
    elif any(c.setup.world_size > 1 for c in configs):
        raise InputError(f"--matrix {matrix}: its configs are distributed; run it with --world-size N (N > 1)")
    whys = [(config, stack, stack_can_run(config, stack)) for config in configs for stack in stacks]
    _require_libraries(stacks)
    return Validation(matrix=matrix, stacks=stacks, ranks=ranks, configs=configs,
                      # a config of another stack's model class (``stack = "transformers"``: qwen3, gemma, phi,
                      # stablelm, which memplan trains with transformers' class) is measured as that stack's step
                      jobs=[(config, config.setup.stack if not stack_class(stack).library else stack)
                            for config, stack, why in whys if why is None],
                      skipped=[(config, stack, why) for config, stack, why in whys if why is not None])


def _require_libraries(stacks: list[str]) -> None:
    """A stack whose library is not installed is refused in one line naming the extra (peft with transformers)."""
    from trainer.stacks import require_stack

    for stack in stacks:
        require_stack(stack, lora=True)


def measure_validation(run: Validation, device: Device, trace: bool = True,
                       started: Callable[[MatrixConfig, str], None] | None = None,
                       done: Callable[[int], None] | None = None) -> list[ValidationRow]:
    """The rows of ``run``: each job predicted, traced (with ``trace``) and measured here, in one
    process, or every config in ``run.ranks`` gloo processes. A setup a library refuses by its own
    limits is added to ``run.skipped`` with its reason, and the others go on. ``started`` hears of
    each job as it starts; ``done`` gets the count finished. No row at all is one InputError."""
    rows: list[ValidationRow] = []
    if run.ranks > 1:
        rows = run_distributed(run.configs, device, run.ranks, progress=done)
    else:
        for i, (config, stack) in enumerate(run.jobs):
            if started is not None:
                started(config, stack)
            if not stack_class(stack).library:  # memplan's own step
                rows.append(run_config(config, device, trace=trace))
            else:
                try:
                    rows.append(run_stack_config(config, device, stack, trace=trace))
                except InputError as e:  # the library refuses this setup (its own limits): say so, go on
                    run.skipped.append((config, stack, " ".join(str(e).split()).removeprefix(f"--stack {stack}: ")))
            if done is not None:
                done(i + 1)
    if not rows:
        raise InputError(f"--stack {','.join(run.stacks)}: no config of matrix {run.matrix!r} can run on it ("
                         + "; ".join(sorted({why for _, _, why in run.skipped})) + ")")
    return rows

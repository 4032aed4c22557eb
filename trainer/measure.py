"""Measuring a training step's memory: for real on the local device, or exactly under FakeTensorMode.

``measure_step`` runs two real training steps of the reference model (the second one is the
steady state, with optimizer state present) and reads the peak the way each platform allows:

- CUDA / ROCm: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` after
  ``reset_peak_memory_stats``, plus what the driver reports (nvidia-ml-py or pyrsmi).
- Apple: ``torch.mps.current_allocated_memory`` / ``driver_allocated_memory`` sampled per op.
- CPU: ``MemTracker`` on the real tensors (live tensor bytes by category), plus the process's
  peak resident memory from psutil.

``trace_step`` runs the same two steps on fake tensors (``FakeTensorMode``) under ``MemTracker``,
so a 1B model at 8k context is traced on a laptop CPU without allocating its memory.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.mem_tracker import MemTracker

from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from trainer import device as devices
from trainer.lora import frozen_params_tracked, lora_for
from trainer.model import build_model
from trainer.step import make_optimizer, param_dtype, set_matmul_precision, train_step

# MemTracker's categories, mapped onto the memory keys of the --json output (docs/json.md).
_CATEGORY_KEYS = {"Parameter": "weights", "Buffer": "weights", "Gradient": "gradients", "Optstate": "optimizer",
                  "Activation": "activations", "Temp": "temporaries", "Other": "other"}


@dataclass
class StepMemory:
    """What one measured (or traced) steady-state training step took."""

    peak_allocated: int  # largest total of live tensor bytes
    breakdown: dict[str, int] = field(default_factory=dict)  # by category at the peak (MemTracker only)
    peak_reserved: int | None = None  # the allocator's reserve (CUDA/ROCm/MPS)
    driver_used: int | None = None  # what the driver reports in use on the device after the step (NVML, ROCm SMI)
    driver_peak: int | None = None  # the peak reserve + what the device holds outside it (compare with peak_reserved)
    driver_source: str = ""  # NVML | ROCm SMI (VRAM) | ROCm SMI (GTT)
    peak_rss: int | None = None  # process peak resident memory (CPU)
    baseline_rss: int | None = None  # resident memory before the model existed (CPU)
    step_seconds: float | None = None  # wall time of the measured step
    method: str = ""
    terms: dict[str, int] = field(default_factory=dict)  # weights, gradients, optimizer, forward_saved
    params: int | None = None  # parameters of the model stepped (trainer/stacks)


class PeakTracker(MemTracker):
    """``MemTracker`` keeping the peak of all live tensors only, not each module's own.

    MemTracker updates every module's local peak on every op it sees (``_update_peak_stats``
    walks all the modules it has met, through a weak-key dictionary). Nothing in memplan reads
    per-module peaks, and that walk grows with the module count: with peft's adapters on a 30-layer
    model (about 1,000 modules more) it was 95% of a trace's time. The global peak and its
    snapshot are kept exactly as MemTracker keeps them.

    Modules that only wrap a function are not tracked (``_wraps_a_function``): their tensors count
    in the module that calls them, as a plain function's do."""

    def __init__(self):
        super().__init__()
        tracker = self._mod_tracker
        tracker._fw_pre_hook = _skipping_function_wrappers(tracker._fw_pre_hook)
        tracker._fw_post_hook = _skipping_function_wrappers(tracker._fw_post_hook)

    def __enter__(self):
        self._register = mod_tracker.register_multi_grad_hook
        mod_tracker.register_multi_grad_hook = _releasing_leaves(self._register)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            mod_tracker.register_multi_grad_hook = self._register

    def _update_peak_stats(self, peak_state) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)


def _wraps_a_function(module: torch.nn.Module) -> bool:
    """Whether ``module`` is the ``kernels`` package's module for a plain function.

    transformers 5.25 (which requires ``kernels``) turns functions such as ``apply_rotary_pos_emb``
    into ``nn.Module`` instances that are called like the function and belong to no model; the
    call enters one such module inside another of the same name. ModTracker then warns that its
    hierarchy is "messed up", and it puts a multi-grad hook (mode ``all``) on the wrapper's inputs
    (q and k for the rotary), which holds the first input's gradient until the second's is made: in
    qwen3's backward that held q's gradient through k_norm's backward (the trace 6.2% above the
    step's real peak). A step without the tracker holds neither."""
    return type(module).__qualname__ == "_create_func_module.<locals>.Func"  # kernels 0.19's layer/layer.py


def _skipping_function_wrappers(hook):
    """One of ModTracker's global forward hooks, not run for ``_wraps_a_function`` modules."""

    @functools.wraps(hook)
    def run(module, *args):
        return None if _wraps_a_function(module) else hook(module, *args)

    return run


def _releasing_leaves(register):
    """``register_multi_grad_hook`` as ModTracker calls it, less the leak it causes.

    For a module's inputs, ModTracker registers ``register_multi_grad_hook(inputs, pop)`` (mode
    ``all``). The hooks it puts on each input close over the inputs' grad_fns, and each grad_fn
    holds that hook dictionary back: a cycle through C++ that Python's collector cannot see, so
    the nodes and everything they reach outlive the step. That is harmless for most inputs, whose
    graph holds no memory once its backward has run, but not for a leaf activation: what
    transformers' ``enable_input_require_grads()`` makes of the embedding output under gradient
    checkpointing with frozen embeddings (LoRA), and the detached copies reentrant checkpointing
    recomputes from. Its AccumulateGrad node holds the leaf, so the leaf and its n·H ``.grad``
    stayed alive into every later step under the tracker (the 2·n·H·r bytes that traces of LoRA
    under checkpointing held beyond a plain step's), where a plain step frees them when its
    backward ends. Here each input also gets a hook that removes those hooks when the backward
    that ran them ends, which breaks the cycle."""

    def register_multi_grad_hook(tensors, fn, mode="all"):
        handle = register(tensors, fn, mode=mode)
        if mode == "all":
            for t in tensors:
                if not isinstance(t, torch.nn.Parameter):
                    t.register_hook(functools.partial(_remove_when_backward_ends, handle))
        return handle

    return register_multi_grad_hook


def _remove_when_backward_ends(handle, grad):
    torch.autograd.Variable._execution_engine.queue_callback(handle.remove)


TRACED_ACCUMULATION = 2  # micro-batches a traced step takes at most, whatever --grad-accum says


def traced_accumulation(setup: TrainSetup) -> TrainSetup:
    """``setup`` with at most ``TRACED_ACCUMULATION`` micro-batches per step, for a trace on fake tensors: the
    first micro-batch runs without gradients, every later one with the gradients the earlier left, so the
    second is the largest and a third repeats it exactly; tracing N micro-batches would cost N times as long
    (``--grad-accum 1000000`` never ended) for one figure more, added back by ``with_untraced_inputs``."""
    return setup if setup.grad_accum <= TRACED_ACCUMULATION else setup.replace(grad_accum=TRACED_ACCUMULATION)


def with_untraced_inputs(memory: "StepMemory", setup: TrainSetup, device_type: str) -> "StepMemory":
    """A trace of ``traced_accumulation(setup)`` as the trace of ``setup``: a step makes all its micro-batches'
    token ids and targets before the first forward (int64, (micro_batch, ctx) each, live through the step;
    MemTracker counts them as activations), so each micro-batch not traced adds 2 of them to the peak:
    (grad_accum - TRACED_ACCUMULATION) · 2 · round_up(micro_batch · ctx · 8, block), block 512 bytes for the
    CUDA caching allocator, else 1."""
    import dataclasses

    missing = setup.grad_accum - traced_accumulation(setup).grad_accum
    if missing <= 0:
        return memory
    block = 512 if device_type in ("cuda", "rocm") else 1
    one = -(-setup.micro_batch * setup.ctx * 8 // block) * block
    extra = missing * 2 * one
    breakdown = {**memory.breakdown, "activations": memory.breakdown.get("activations", 0) + extra}
    return dataclasses.replace(memory, peak_allocated=memory.peak_allocated + extra, breakdown=breakdown)


# A deep model's trace costs time in proportion to its layers (FakeTensor and MemTracker dispatch every op: about
# 0.43 s a layer for a 22M-parameter shape on one core, so --layers 1000 ran past 5 minutes). Above
# PROBE_ABOVE_LAYERS layers the time is predicted from two shallow traces of the same shape and setup, timed here
# (PROBE_LAYERS), and a trace predicted to take longer than TRACE_SECONDS_LIMIT is refused in one line.
TRACE_SECONDS_LIMIT = 180.0
TRACE_SECONDS_ENV = "MEMPLAN_TRACE_SECONDS"  # overrides the limit
PROBE_ABOVE_LAYERS = 48
PROBE_LAYERS = (1, 3)


def trace_seconds_limit() -> float:
    """The longest a trace may be predicted to take: ``MEMPLAN_TRACE_SECONDS`` when set, else the default."""
    import math
    import os

    text = os.environ.get(TRACE_SECONDS_ENV, "").strip()
    if not text:
        return TRACE_SECONDS_LIMIT
    from memplan.errors import InputError

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise InputError(f"{TRACE_SECONDS_ENV}={text!r:.40}: not a number of seconds; accepted: a positive number")
    return value


def predicted_trace_seconds(spec: ModelSpec, setup: TrainSetup, tracer: Callable) -> float:
    """Seconds ``tracer(spec, setup)`` is predicted to take: fixed + per_layer · layers, from timed traces of
    the same shape with ``PROBE_LAYERS`` layers (per_layer: their difference per layer; fixed: the rest)."""
    import dataclasses

    lo, hi = PROBE_LAYERS
    times = []
    for n in (lo, hi):
        t0 = time.perf_counter()
        tracer(dataclasses.replace(spec, layers=n), setup)
        times.append(time.perf_counter() - t0)
    per_layer = max((times[1] - times[0]) / (hi - lo), times[1] / hi / 4)  # noise never makes a layer free
    fixed = max(0.0, times[0] - per_layer * lo)
    return fixed + per_layer * spec.layers


def check_trace_time(spec: ModelSpec, setup: TrainSetup, tracer: Callable, what: str = "trace") -> None:
    """Refuse, in one line giving the predicted time and how to proceed, a trace of more than
    ``PROBE_ABOVE_LAYERS`` layers predicted (``predicted_trace_seconds``) to take longer than the limit."""
    if spec.layers <= PROBE_ABOVE_LAYERS:
        return
    from memplan.errors import InputError
    from memplan.units import format_seconds

    limit = trace_seconds_limit()
    predicted = predicted_trace_seconds(spec, setup, tracer)
    if predicted > limit:
        raise InputError(f"--layers {spec.layers}: the {what} is predicted to take {format_seconds(predicted)} "
                         f"(its cost grows with every layer), beyond {format_seconds(limit)}; `memplan estimate` "
                         "with the same flags answers in a second, or trace fewer layers, or allow it with "
                         f"{TRACE_SECONDS_ENV}={int(predicted * 1.5) + 1}")


def _random_batches(spec: ModelSpec, setup: TrainSetup, device, generator: torch.Generator | None = None):
    return _random_ids(spec.vocab, setup, device, generator)


def _random_ids(vocab: int, setup: TrainSetup, device, generator: torch.Generator | None = None):
    """``grad_accum`` micro-batches of (inputs, targets): random token ids, (micro_batch, ctx) int64 each."""
    def ids():
        return torch.randint(0, vocab, (setup.micro_batch, setup.ctx), device=device, generator=generator)

    return [(ids(), ids()) for _ in range(setup.grad_accum)]


def _categories(snapshot: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, value in snapshot.items():
        name = getattr(key, "value", key)
        if name == "Total":
            continue
        out[_CATEGORY_KEYS.get(name, name)] = out.get(_CATEGORY_KEYS.get(name, name), 0) + int(value)
    return out


def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's: its local shard's)."""
    seen, total = set(), 0
    for t in tensors:
        storage = getattr(t, "_local_tensor", t).untyped_storage()
        key = (storage.data_ptr(), storage.nbytes()) if storage.data_ptr() else id(storage)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


class _TermProbe:
    """Reads each memory term of the last step from the tensors themselves: parameters and
    buffers, the gradients just before the optimizer step, the optimizer state after it, and
    what the last micro-batch's forward left alive (live bytes after it minus before it)."""

    def __init__(self, model, optimizer, live_bytes: Callable[[], int]):
        self.model, self.optimizer, self.live_bytes = model, optimizer, live_bytes
        self.before = self.after = 0
        self.terms: dict[str, int] = {}
        self._handle = optimizer.register_step_pre_hook(self._grads)

    def before_forward(self, i: int) -> None:
        self.before = self.live_bytes()

    def after_forward(self, i: int) -> None:
        self.after = self.live_bytes()

    def _grads(self, optimizer, args, kwargs) -> None:
        self.terms["gradients"] = _tensor_bytes(p.grad for p in self.model.parameters() if p.grad is not None)

    def finish(self) -> dict[str, int]:
        self._handle.remove()
        self.terms["weights"] = _tensor_bytes([*self.model.parameters(), *self.model.buffers()])
        self.terms["optimizer"] = _tensor_bytes(v for state in self.optimizer.state.values() for v in state.values()
                                                if isinstance(v, torch.Tensor))
        self.terms["forward_saved"] = self.after - self.before
        return self.terms


def _tracked_steps(model, optimizer, setup: TrainSetup, batches_fn, device_type: str,
                   probe_terms: bool = False, step_fn=None) -> tuple[int, dict, dict]:
    """Two steps under MemTracker (reset_mod_stats before every forward); returns the peak, its
    breakdown, and (with ``probe_terms``) the terms read by ``_TermProbe`` in the second step.
    ``step_fn`` takes a step as ``trainer.step.train_step`` does (another stack's, trainer/stacks);
    by default memplan's own, without its finiteness check (fake tensors have no values to check).

    The first step allocates the optimizer state; the second is the steady state. The
    tracker's peak is over both, and the second step's is never lower (it holds everything the
    first does, plus optimizer state from the start).
    """
    take_step = step_fn or functools.partial(train_step, check_finite=False)
    tracker = PeakTracker()
    tracker.track_external(model, optimizer)

    def live() -> int:
        return int(sum(snap.get("Total", 0) for snap in tracker.get_tracker_snapshot("current").values()))

    probe = None
    with frozen_params_tracked(), tracker:
        for step in range(2):
            batches = batches_fn()
            last = step == 1 and probe_terms
            if last:
                probe = _TermProbe(model, optimizer, live)

            def before(i, last=last):
                tracker.reset_mod_stats()  # per-module stats cover one forward; the global peak is kept
                if last and i == len(batches) - 1:
                    probe.before_forward(i)

            def after(i, last=last):
                if last and i == len(batches) - 1:
                    probe.after_forward(i)

            take_step(model, optimizer, batches, setup, device_type, before_forward=before, after_forward=after)
            del batches
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    total = int(snapshot.get("Total", sum(v for k, v in snapshot.items())))
    return total, _categories(snapshot), (probe.finish() if probe else {})


class AcceleratorDropout(torch.overrides.TorchFunctionMode):
    """Dropout on fake CPU tensors as an accelerator runs it, for the trace of a step planned for one.

    ATen's ``dropout`` takes the fused ``native_dropout`` where ``is_fused_kernel_acceptable`` holds
    (a CUDA, XPU or private-use tensor): it saves a bool mask, n·1 bytes. On the CPU it takes
    ``_dropout_impl`` instead: ``noise = at::empty_like(input).bernoulli_(1 - p)``, divided by 1 − p,
    and ``input * noise`` saves that noise in the input's dtype, n·4 for an fp32 input. A CPU build
    of torch cannot make fake CUDA tensors, so ``F.dropout`` is routed to ``torch.native_dropout``
    here, whose CPU kernel returns the same bool mask CUDA's does. SDPA's ``dropout_p`` is dropped in
    the kernel on an accelerator (flash and memory-efficient attention draw it from a Philox seed and
    save no mask); on the CPU it forces the math path (scores, softmax, a noise mask, all B·heads·T²):
    so it is taken as 0 here, what the accelerator's kernel saves."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.dropout:
            names = ("input", "p", "training", "inplace")
            bound = {**dict(zip(names, args)), **kwargs}
            p, training = bound.get("p", 0.5), bound.get("training", True)
            x = bound["input"]
            if training and 0 < p < 1 and x.numel() and not bound.get("inplace", False):
                return torch.native_dropout(x, p, True)[0]
        if func is torch.nn.functional.scaled_dot_product_attention and kwargs.get("dropout_p", 0):
            kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


_AS_ACCELERATOR = ", dropout as an accelerator's kernels run it"


def trace_step(spec: ModelSpec, setup: TrainSetup, device: str = "cuda", accelerator: bool = False) -> StepMemory:
    """Exact live-tensor peak of a steady-state step on fake tensors (nothing is allocated).

    ``device`` is the device the fake tensors claim to live on: ``cuda`` rounds every
    allocation to the caching allocator's 512-byte blocks, as ``max_memory_allocated`` does;
    ``cpu`` counts bytes exactly as the CPU measurement does. ``accelerator``: the step is planned
    for an accelerator though the fake tensors live on the CPU: dropout as its kernels run it
    (``AcceleratorDropout``).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    asked, setup = setup, traced_accumulation(setup)
    set_matmul_precision(setup.precision)
    with FakeTensorMode(allow_non_fake_inputs=False), torch.device(device), \
            (AcceleratorDropout() if accelerator else contextlib.nullcontext()):
        model = lora_for(build_model(spec, setup.attention, setup.checkpointing, param_dtype(setup.precision), device=device), setup)
        optimizer = make_optimizer(model, setup.optimizer)
        total, categories, _ = _tracked_steps(model, optimizer, setup,
                                              lambda: _random_batches(spec, setup, device), torch.device(device).type)
    return with_untraced_inputs(StepMemory(peak_allocated=total, breakdown=categories,
                                           method=f"MemTracker under FakeTensorMode "
                                                  f"({device}{_AS_ACCELERATOR if accelerator else ''})"),
                                asked, torch.device(device).type)


def _rss_sampler(stop: threading.Event, out: list[int], interval: float = 0.002) -> None:
    peak = 0
    while not stop.is_set():
        peak = max(peak, devices.current_rss())
        time.sleep(interval)
    out.append(max(peak, devices.current_rss()))


def measure_step_cpu(spec: ModelSpec, setup: TrainSetup, seed: int = 0) -> StepMemory:
    """Live tensor bytes of a real steady-state step on the CPU (MemTracker), plus peak RSS."""
    gc.collect()
    baseline = devices.current_rss()
    torch.manual_seed(seed)
    set_matmul_precision(setup.precision)
    model = lora_for(build_model(spec, setup.attention, setup.checkpointing, param_dtype(setup.precision)), setup)
    optimizer = make_optimizer(model, setup.optimizer)
    gen = torch.Generator().manual_seed(seed)
    stop, rss = threading.Event(), []
    sampler = threading.Thread(target=_rss_sampler, args=(stop, rss), daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        total, categories, terms = _tracked_steps(model, optimizer, setup,
                                                  lambda: _random_batches(spec, setup, "cpu", gen), "cpu",
                                                  probe_terms=True)
    finally:
        stop.set()
        sampler.join()
    elapsed = time.perf_counter() - t0
    del model, optimizer
    gc.collect()
    return StepMemory(peak_allocated=total, breakdown=categories, peak_rss=rss[0], baseline_rss=baseline,
                      step_seconds=elapsed / 2, method="MemTracker on real tensors (cpu) + psutil RSS", terms=terms)


def _allocator_step(model, optimizer, batches_fn, setup: TrainSetup, family: str, step_fn=None,
                    probe_terms: bool = True) -> StepMemory:
    """A warm-up step, then the steady-state step read by torch's allocator (CUDA, ROCm): its
    ``max_memory_allocated`` (compare with ``peak_allocated``) and ``max_memory_reserved``, and what the
    driver (NVML, ROCm SMI) reports right after it. The driver's figure is taken back to the step's peak:
    ``driver_peak`` = the peak reserve + what the device held outside torch's reserve (the runtime
    context, and other processes' memory on a shared GPU), comparable with the predicted ``peak_reserved``."""
    dev = next(model.parameters()).device
    take_step = step_fn or functools.partial(train_step, check_finite=False)
    sync = devices.synchronizer(dev)
    take_step(model, optimizer, batches_fn(), setup, dev.type)
    sync()
    devices.reset_allocator_peaks(dev)
    probe = _TermProbe(model, optimizer, lambda: devices.live_tensor_bytes(dev)) if probe_terms else None
    batches = batches_fn()
    last = len(batches) - 1
    t0 = time.perf_counter()
    take_step(model, optimizer, batches, setup, dev.type,
              before_forward=lambda i: probe.before_forward(i) if probe and i == last else None,
              after_forward=lambda i: probe.after_forward(i) if probe and i == last else None)
    sync()
    elapsed = time.perf_counter() - t0
    allocator = devices.allocator_memory(dev)
    driver = devices.driver_memory(devices.gpu_index(dev))
    driver_peak = None
    if driver is not None:  # the driver's figure now, with torch's reserve now swapped for its peak
        driver_peak = allocator.peak_reserved + max(0, driver.used - allocator.reserved)
    return StepMemory(peak_allocated=allocator.peak_allocated, peak_reserved=allocator.peak_reserved,
                      driver_used=driver.used if driver else None, driver_peak=driver_peak,
                      driver_source=driver.source if driver else "", step_seconds=elapsed,
                      method=f"torch.cuda.max_memory_allocated/reserved ({family})"
                             + (f" + {driver.source}" if driver else ""),
                      terms=probe.finish() if probe else {})


def measure_step_cuda(spec: ModelSpec, setup: TrainSetup, seed: int = 0, family: str = "cuda") -> StepMemory:
    """``max_memory_allocated`` / ``max_memory_reserved`` of a steady-state step on CUDA or ROCm."""
    dev = devices.torch_device(family)
    torch.manual_seed(seed)
    set_matmul_precision(setup.precision)
    model = lora_for(build_model(spec, setup.attention, setup.checkpointing, param_dtype(setup.precision), device=dev), setup)
    optimizer = make_optimizer(model, setup.optimizer)
    result = _allocator_step(model, optimizer, lambda: _random_batches(spec, setup, dev), setup, family)
    del model, optimizer
    gc.collect()
    devices.release_cached(dev)
    return result


def _mps_step(model, optimizer, batches_fn, setup: TrainSetup, step_fn=None) -> StepMemory:
    """Apple GPUs: the allocator has no peak counter, so ``devices.mps_memory`` is sampled after every op
    of the steady-state step (live tensors; what Metal holds, as the reserve)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Sampler(TorchDispatchMode):
        peak = 0
        driver_peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            allocated, driver = devices.mps_memory()
            self.peak = max(self.peak, allocated)
            self.driver_peak = max(self.driver_peak, driver)
            return out

    dev = next(model.parameters()).device
    take_step = step_fn or functools.partial(train_step, check_finite=False)
    sync = devices.synchronizer(dev)
    take_step(model, optimizer, batches_fn(), setup, dev.type)
    sync()
    sampler = _Sampler()
    t0 = time.perf_counter()
    with sampler:
        take_step(model, optimizer, batches_fn(), setup, dev.type)
    sync()
    return StepMemory(peak_allocated=sampler.peak, peak_reserved=sampler.driver_peak,
                      step_seconds=time.perf_counter() - t0, method="torch.mps.current_allocated_memory per op")


def measure_step_mps(spec: ModelSpec, setup: TrainSetup, seed: int = 0) -> StepMemory:
    """Apple GPUs: the allocator has no peak counter, so sample current_allocated_memory per op."""
    dev = devices.torch_device("mps")
    torch.manual_seed(seed)
    model = lora_for(build_model(spec, setup.attention, setup.checkpointing, param_dtype(setup.precision), device=dev), setup)
    optimizer = make_optimizer(model, setup.optimizer)
    return _mps_step(model, optimizer, lambda: _random_batches(spec, setup, dev), setup)


def allocator_peak(step: Callable[[], object]) -> int:
    """The largest running sum of the CPU allocator's allocations and frees while ``step()`` runs, read from
    ``torch.profiler``'s memory events (``profile_memory=True``): they see a compiled step's own buffers (inductor's
    generated code allocates outside any dispatch mode), which MemTracker does not."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def measure_compiled_step(spec: ModelSpec, setup: TrainSetup, seed: int = 0) -> StepMemory:
    """The peak of a real steady-state ``torch.compile``d step of memplan's model on the CPU, as the trainer takes
    it (the model compiled, the loss and optimizer eager): the bytes live at the step's start (parameters, buffers,
    ``.grad``, optimizer state) plus the allocator's peak over the step (``allocator_peak``), after two warm-up
    steps (the first compiles, the second makes the optimizer's state)."""
    torch.manual_seed(seed)
    set_matmul_precision(setup.precision)
    model = lora_for(build_model(spec, setup.attention, setup.checkpointing, param_dtype(setup.precision)), setup)
    optimizer = make_optimizer(model, setup.optimizer)
    torch._dynamo.reset()
    compiled = torch.compile(model)  # shares the model's parameters with the optimizer
    gen = torch.Generator().manual_seed(seed)
    try:
        for _ in range(2):
            train_step(compiled, optimizer, _random_batches(spec, setup, "cpu", gen), setup, "cpu", check_finite=False)
        gc.collect()
        batches = _random_batches(spec, setup, "cpu", gen)
        live = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
        live += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        start = _tensor_bytes(live)
        t0 = time.perf_counter()
        peak = allocator_peak(lambda: train_step(compiled, optimizer, batches, setup, "cpu", check_finite=False))
        elapsed = time.perf_counter() - t0
    finally:
        torch._dynamo.reset()
    return StepMemory(peak_allocated=start + peak, step_seconds=elapsed,
                      method="torch.compile'd step (cpu): live at its start + torch.profiler's allocator peak")


def measure_step(spec: ModelSpec, setup: TrainSetup, family: str, seed: int = 0) -> StepMemory:
    """Measure a real steady-state step on the local device of ``family`` (cuda, rocm, mps, cpu)."""
    if family in ("cuda", "rocm"):
        return measure_step_cuda(spec, setup, seed, family)
    if family == "mps":
        return measure_step_mps(spec, setup, seed)
    return measure_step_cpu(spec, setup, seed)


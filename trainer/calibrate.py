"""Microbenchmarks of the local device for ``memplan calibrate``: the rates memplan's step-time model needs.

Everything here measures what the reference training step (``trainer/step.py``) actually runs, on the
device torch would train on, with the thread count it is given:

- **launch overhead**: seconds per dispatched aten op, from the forward and backward of one tiny
  reference block (``trainer.model.Block`` at width 16), where the arithmetic is negligible and
  every op costs only its dispatch, autograd bookkeeping and (on a GPU) its launch.
- **matmul**: ``F.linear`` forward and backward (grad input + grad weight, through autograd) per dtype
  on a grid of (tokens, in, out) shapes typical of 100k-1B models, in increasing FLOPs until the
  dtype's share of the time budget is spent. Small shapes are launch- and cache-bound, large ones
  compute-bound; memplan interpolates this table.
- **memory**: a large copy (the device's bandwidth) and an elementwise add at a few working-set sizes
  per dtype (on a CPU, a small working set stays in cache and streams faster than DRAM).
- **first touch** (CPU only): freshly allocated memory above the allocator's mmap threshold (glibc:
  32 MiB) is zeroed by the kernel page by page on first write; a training step allocates its big
  tensors (logits, big gradients) fresh every step, so this rate matters there.
- **transcendental**: elements per second of SiLU (the activation) and log-softmax (the loss,
  softmax in eager attention), which on a CPU are compute-bound, not bandwidth-bound.
- **attention**: scaled_dot_product_attention and the reference model's eager attention, forward and
  backward, over a few sequence lengths, per dtype.
- **optimizer**: clip_grad_norm_ + optimizer.step() + zero_grad() as ``train_step`` runs them, for
  foreach and fused AdamW and for SGD, as seconds per parameter plus seconds per parameter tensor.
- **device memory**: total and usable from torch, nvidia-ml-py, pyrsmi or psutil.
- **model code** (CPU only): what transformers' model code, and peft's, keep resident in a training process
  beyond memplan's own (``model_code_bytes``), a term of the plan where the process's memory is the device's.
- **torch.compile** (``compile=True``, ``memplan calibrate --compile``; outside the time budget, since one
  compile takes tens of seconds): a reference training step (``COMPILE_REFERENCE``) eager and compiled,
  interleaved, and the compile's one-off wall time (the first compiled step less a compiled step).
  ``memplan.timing`` turns it into the share of the fusible work (elementwise kernels, the loss, dispatch)
  that compiling saves. The compile time itself (``measure_compile_cost``): a three-block and a five-block model,
  each compiled in a fresh process with an empty inductor cache, give the fixed seconds and the seconds per op of
  the compiled graph (``[calibrated] compile_cost``), from which ``memplan.timing.compile_seconds`` predicts any
  model's compile.

Measured times are turned into *net* kernel rates: the dispatch overhead (dispatched ops × launch
overhead) and the first-touch cost of fresh outputs are subtracted, because memplan's model adds
those back as their own terms (``memplan/timing.py``). ``calibrate`` returns a ``Calibration``;
``profile_data`` turns it into a profile TOML's tables (schema: ``memplan/hardware.py``).
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from memplan.errors import InputError
from trainer import device as devices

MiB = 2**20
MATMUL_TOKENS = (64, 512, 4096)  # rows of a linear's input: micro_batch × ctx of small runs
MATMUL_MIN_TOKENS = 16  # the fewest tokens a shape too costly for the budget is measured with
MATMUL_IN = (64, 384, 1024)  # input widths: the smallest models', memplan's 22m hidden (384), 350m's (1024)
MATMUL_OUT = (64, 256, 1024, 4096, 32768)  # qkv/mlp widths up to the LM head's vocabulary
ATTENTION_CTX = (64, 256, 1024)  # sequence lengths; 4096 is added on accelerators
ATTENTION_HEAD_DIMS = (32, 128)  # head widths bracketing small models' (32-128): the score work per FLOP differs
ATTENTION_SCORES = 2**22  # batch·heads·T² per measured call: enough work to hide the dispatch cost
GLIBC_MMAP_THRESHOLD_MAX = 32 * MiB  # glibc's M_MMAP_THRESHOLD upper bound on 64-bit (mallopt(3))
ELEMENTWISE_SIZES = (256 * 1024, 4 * MiB, 64 * MiB)  # bytes per operand: in L2, in L3, in DRAM (CPU)
BLOCK_GLUE_DISPATCHES = 4  # sum(), ones_like and sum's backward around the block
ROTATE_BYTES = 8 * MiB  # inputs cycled through per measurement: more than any L2 cache
ROTATE_ELEMENTWISE_BYTES = 32 * MiB  # elementwise operands cycled through: a step's tensors are rarely in L2
MIN_REPEAT_SECONDS = 0.02  # each measurement repeats for at least this long (after one warm-up call)
MAX_REPEATS = 25
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# Shares of the time budget per stage (the matmul share is split among dtypes: fp32 first).
BUDGET_SHARES = {"launch": 0.04, "memory": 0.07, "transcendental": 0.03, "modules": 0.10, "optimizer": 0.07,
                 "attention": 0.22, "matmul": 0.47}
PLANNED_SHARE = 0.8  # of --seconds, planned for measurements; the rest absorbs overruns and start-up
MATMUL_DTYPE_SHARES = {"fp32": 0.55, "tf32": 0.15, "bf16": 0.25, "fp16": 0.2}


@dataclass
class Calibration:
    """What ``calibrate`` measured. Rates are net of dispatch overhead and first-touch cost."""

    family: str  # cuda | rocm | mps | cpu
    title: str  # the device's name as the driver or the OS reports it
    threads: int  # torch.get_num_threads() during the measurements
    clock: str = "wall"  # wall | cpu (process CPU time, one thread)
    torch_version: str = ""
    started: str = ""  # ISO time the calibration started
    seconds: float = 0.0  # wall time it took
    memory_total_bytes: int = 0
    memory_usable_bytes: int = 0
    memory_source: str = ""
    runtime_context_bytes: int = 0
    # CPU: what transformers' model code and peft's keep resident in a training process (model_code_bytes);
    # None: not measured here (not a CPU, transformers not installed, or already loaded in this process)
    transformers_code_bytes: int | None = None
    peft_code_bytes: int | None = None
    bandwidth_bytes_per_second: float = 0.0  # large copy: bytes read + written per second
    elementwise: dict[str, list[list[float]]] = field(default_factory=dict)  # dtype -> [[operand bytes, B/s]]
    launch_overhead_seconds: float = 0.0  # per dispatched aten op (forward + backward of a tiny block)
    first_touch_bytes_per_second: float | None = None  # CPU: fresh pages zeroed on first write
    first_touch_threshold_bytes: int | None = None  # CPU: allocations above this are fresh pages
    transcendental: dict[str, float] = field(default_factory=dict)  # "silu_fp32", "log_softmax_fp32"... elements/s
    modules: dict[str, list[list[float]]] = field(default_factory=dict)  # "rmsnorm_fp32" -> [[elements, fwd s, bwd s]]
    matmul: dict[str, list[list[float]]] = field(default_factory=dict)  # dtype -> [[m, k, n, fwd TF, bwd TF]]
    attention: dict[str, list[list[float]]] = field(default_factory=dict)  # "sdpa_fp32" -> [[T, d, fwd TF, bwd TF]]
    optimizer: dict[str, list[float]] = field(default_factory=dict)  # name -> [s per param, s per tensor]
    noise: float = 0.0  # median relative spread (IQR / median) of the repeated timings
    skipped: list[str] = field(default_factory=list)  # measurements the budget did not allow
    thread_seconds: dict[str, float] = field(default_factory=dict)  # threads -> median step of the thread trial
    # several threads on the wall clock: the same trial run again after the measurements (threads -> median step),
    # and how much slower the chosen count's step ran in it (``thread_slowdown``; noise is at least this)
    thread_recheck: dict[str, float] = field(default_factory=dict)
    thread_slowdown: float = 0.0
    cpu_share: float | None = None  # one thread, --clock cpu: CPU time / wall time over the calibration
    # torch.compile of COMPILE_REFERENCE's step: its shape, eager_seconds, compiled_seconds, compile_seconds
    compile: dict = field(default_factory=dict)
    # torch.compile's one-off: fixed_seconds, seconds_per_op (measure_compile_cost), the clock and what was timed
    compile_cost: dict = field(default_factory=dict)

    def matmul_tflops(self) -> dict[str, float]:
        """Best net forward rate per dtype over the measured shapes (the device's achievable matmul rate)."""
        return {d: max(r[3] for r in rows) for d, rows in self.matmul.items() if rows}


# ---- the device ----------------------------------------------------------------------------

# The device itself (its family, torch device, name and memory) is read by trainer/device.py.

def runtime_context_bytes(family: str, loaded: Sequence[str] = ()) -> int:
    """Memory the runtime holds outside the allocator. CPU: what a training process measurably holds
    before its model exists (``process_baseline_bytes``, with the modules ``loaded`` names). CUDA: the
    driver's view less torch's reserve."""
    if family == "cuda":
        held = devices.driver_process_bytes(os.getpid())
        if held is None:
            return 0
        return max(0, held - devices.allocator_memory().reserved)
    if family == "cpu":
        return process_baseline_bytes(loaded)
    return 0


def process_baseline_bytes(loaded: Sequence[str] = ()) -> int:
    """The resident memory of a CPU training process before its model exists: this process with trainer
    imported and the modules ``loaded`` names, those the training process loads besides (``memplan train``'s
    command line, ``memplan.cli``: Python, torch, typer/rich, tokenizers; its caller names them, so that this
    library imports no command line), and a tiny model's training steps run once per attention kernel and optimizer (which loads the code
    pages of every kernel a step uses: oneDNN's among them, tens of MiB), then its garbage collected
    and the C heap trimmed. Measure it in a fresh process (calibration does): what an earlier workload
    in the same process left behind is not the runtime's."""
    import importlib

    import trainer.loop  # noqa: F401

    for name in loaded:  # what the training process has loaded before its model exists
        importlib.import_module(name)
    from memplan.model import ModelSpec
    from memplan.setup import TrainSetup
    from trainer.model import build_model
    from trainer.step import make_optimizer, train_step

    tiny = ModelSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=64, tied=True)
    for attention in ("sdpa", "eager"):
        for optimizer in ("adamw", "adamw-fused"):
            setup = TrainSetup(ctx=16, micro_batch=1, precision="fp32", attention=attention, optimizer=optimizer)
            model = build_model(tiny, attention)
            opt = make_optimizer(model, optimizer)
            batch = [(torch.randint(0, 64, (1, 16)), torch.randint(0, 64, (1, 16)))]
            for _ in range(2):
                train_step(model, opt, batch, setup, "cpu")
            del model, opt, batch
    devices.trim_heap()
    return devices.current_rss()


MODEL_CODE_ARCH = "llama"  # the family whose transformers class model_code_bytes runs (each measured 43.7-44.4 MiB)


def model_code_bytes() -> tuple[int | None, int | None]:
    """CPU: (what transformers' model code keeps resident in a training process beyond memplan's own, what
    peft's adds for LoRA), as ``memplan.memory.terms.model_code_resident_bytes`` adds them to the plan.

    Run after ``process_baseline_bytes`` in the same fresh process: its resident set then holds the runtime
    context, memplan's model already run. Each figure is the growth of the trimmed resident set from
    importing the code (``trainer.hf_model``; peft), building a tiny model of transformers' class
    (MODEL_CODE_ARCH; with rank-4 LoRA adapters for peft) and running two of memplan's training steps on it
    (sdpa: eager attention's steps added under 0.1 MiB; the kernels' own code the context has loaded), then its garbage collected and the heap trimmed: what stays resident while it trains
    beyond the context (not the import's growth from a bare process, most of which the context holds). (None,
    None) where it cannot be told apart: transformers not installed, or already imported in this process."""
    import importlib.util
    import sys

    if "transformers" in sys.modules or "peft" in sys.modules:
        return None, None
    if importlib.util.find_spec("transformers") is None:  # found without importing it: all of it is measured
        return None, None
    from memplan.model import ModelSpec
    from memplan.setup import TrainSetup
    from trainer.step import make_optimizer, train_step

    def run(lora_rank: int) -> None:
        import trainer.hf_model as hf

        tiny = ModelSpec(arch=MODEL_CODE_ARCH, layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=64, tied=True)
        setup = TrainSetup(ctx=16, micro_batch=1, precision="fp32", attention="sdpa", optimizer="adamw",
                           lora_rank=lora_rank).replace(stack="transformers")
        model = hf.build(tiny, setup, "cpu", hf.spec_hf_config(tiny, setup))
        opt = make_optimizer(model, "adamw")
        batch = [(torch.randint(0, 64, (1, 16)), torch.randint(0, 64, (1, 16)))]
        for _ in range(2):
            train_step(model, opt, batch, setup, "cpu")
        del model, opt, batch
        devices.trim_heap()  # garbage collected, the C heap's free pages given back

    devices.trim_heap()
    before = devices.current_rss()
    run(0)
    with_transformers = devices.current_rss()
    if importlib.util.find_spec("peft") is None:
        return max(0, with_transformers - before), None
    run(4)
    return max(0, with_transformers - before), max(0, devices.current_rss() - with_transformers)


def library_code_bytes(stack: str) -> int | None:
    """CPU: what ``stack``'s library keeps resident in a training process beyond memplan's own, as the plan's
    ``model_code`` term adds it (``memplan.memory.terms.library_code_resident_bytes``): the growth of the
    trimmed resident set from two steps of the library's own code on a tiny llama (``trainer.stacks.trial_steps``,
    as ``autotune --verify`` runs it: litgpt's GPT and its scripts' step, torchtune's builders and its recipes'
    step, transformers' ``Trainer``), the library imported there, then its garbage collected and the heap
    trimmed.

    Run after ``process_baseline_bytes`` in the same fresh process (its resident set then holds the runtime
    context, memplan's model already run). None where it cannot be told apart: the library not installed, or
    already imported in this process."""
    import importlib.util
    import sys

    from trainer.stacks import TRIAL_IMPORTS, StackModel, trial_steps

    modules = TRIAL_IMPORTS[stack]
    if any(m in sys.modules for m in modules) or any(importlib.util.find_spec(m) is None for m in modules):
        return None
    from memplan.emit import render
    from memplan.model import ModelSpec
    from memplan.plan import Plan
    from memplan.setup import TrainSetup

    tiny = ModelSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=64, tied=False)
    setup = TrainSetup(ctx=16, micro_batch=1, precision="fp32", attention="sdpa", optimizer="adamw")
    emitted = render(Plan(model=tiny, setup=setup), stack) if stack == "transformers" else None
    devices.trim_heap()
    before = devices.current_rss()
    trial_steps(stack, StackModel(spec=tiny), setup, setup, 2, torch.device("cpu"), emitted=emitted)
    devices.trim_heap()  # garbage collected, the C heap's free pages given back
    return max(0, devices.current_rss() - before)


def compiled_code_bytes(layers: int, checkpointing: str = "none") -> tuple[int, int] | None:
    """CPU: what torch.compile keeps resident in a training process beyond the runtime context, as the plan's
    ``compiled_code`` term adds it (``memplan.memory.terms.compiled_code_resident_bytes``): (the growth of the
    trimmed resident set from importing inductor, ``torch._inductor.compile_fx``; the growth from compiling a
    tiny llama of ``layers`` blocks, ``checkpointing`` as given, and running three of memplan's training steps
    through it, the model then freed and the heap trimmed). The second holds the modules the compile imports on
    first use (its code generators, the partitioner), the FX graphs and the generated Python and C++ kernels'
    code (the loaded .so files) that stay resident while the compiled model trains.

    Run after ``process_baseline_bytes`` in the same fresh process, with an empty inductor cache
    (``TORCHINDUCTOR_CACHE_DIR``): a run's first compile of its graph generates the code, a cached one only loads it
    (about 12 MiB less here). None where it cannot be told apart: inductor already imported in this process."""
    import sys

    from memplan.model import ModelSpec
    from memplan.setup import TrainSetup
    from trainer.model import build_model
    from trainer.step import make_optimizer, train_step

    if "torch._inductor.compile_fx" in sys.modules:
        return None
    devices.trim_heap()
    before = devices.current_rss()
    import torch._inductor.compile_fx  # noqa: F401

    devices.trim_heap()
    imported = devices.current_rss()
    tiny = ModelSpec(arch="llama", layers=layers, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=64, tied=True)
    setup = TrainSetup(ctx=16, micro_batch=1, precision="fp32", attention="sdpa", optimizer="adamw",
                       checkpointing=checkpointing)
    model = build_model(tiny, "sdpa", checkpointing)
    compiled = torch.compile(model)
    opt = make_optimizer(model, "adamw")
    batch = [(torch.randint(0, 64, (1, 16)), torch.randint(0, 64, (1, 16)))]
    for _ in range(3):
        train_step(compiled, opt, batch, setup, "cpu")
    del model, compiled, opt, batch
    devices.trim_heap()
    return max(0, imported - before), max(0, devices.current_rss() - imported)


# ---- threads -------------------------------------------------------------------------------

THREAD_TRIAL_REPEATS = 7  # timed steps per thread count, interleaved (a burst of load hits every count alike)


def thread_candidates() -> list[int]:
    """The thread counts worth trying: one, and torch's default (the physical cores) when it is more."""
    default = torch.get_num_threads()
    return sorted({1, default})


def fastest_threads(candidates: list[int] | None = None, repeats: int = THREAD_TRIAL_REPEATS,
                    on_round: Callable[[float], None] | None = None) -> tuple[int, dict[str, float]]:
    """The thread count under which a small model's training step (the quick start's size: 2 layers,
    hidden 128, ctx 256) runs fastest here now, and the median step seconds of each. The counts take
    turns step by step, so load from other processes weighs on all of them alike. On a loaded two-core
    machine one thread wins by far (two spin-wait on each other); on an idle one, usually all cores."""
    from memplan.model import ModelSpec
    from memplan.setup import TrainSetup
    from trainer.model import build_model
    from trainer.step import make_optimizer, train_step

    candidates = candidates or thread_candidates()
    before = torch.get_num_threads()
    spec = ModelSpec(arch="llama", layers=2, hidden=128, heads=2, kv_heads=2, ffn=384, vocab=4096, tied=True)
    setup = TrainSetup(ctx=256, micro_batch=2, precision="fp32", attention="sdpa", optimizer="adamw")
    gen = torch.Generator().manual_seed(0)
    model = build_model(spec, "sdpa")
    opt = make_optimizer(model, "adamw")
    batch = [(torch.randint(0, spec.vocab, (2, 256), generator=gen),
              torch.randint(0, spec.vocab, (2, 256), generator=gen))]
    times: dict[int, list[float]] = {n: [] for n in candidates}
    try:
        for i in range(repeats + 1):
            for n in candidates:
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                train_step(model, opt, batch, setup, "cpu")
                if i:  # the first round warms up
                    times[n].append(time.perf_counter() - t0)
            if on_round is not None:  # the share of the trial done (its progress bar moves round by round)
                on_round((i + 1) / (repeats + 1))
    finally:
        torch.set_num_threads(before)
    medians = {n: statistics.median(t) for n, t in times.items()}
    best = min(candidates, key=lambda n: (medians[n], n))
    return best, {str(n): medians[n] for n in candidates}


def recheck_threads(cal: Calibration) -> None:
    """The thread trial run again after a wall-clock calibration with several threads, recorded in
    ``cal.thread_recheck``; ``cal.thread_slowdown`` is how much slower the chosen count's median step
    ran than in the first trial, max(0, after / before - 1), and ``cal.noise`` is at least that.

    The trial chose the thread count for the load of its moment. Several threads time by the wall
    clock, and on a machine whose cores another process takes they wait for each other: every
    parallel op then lasts a scheduler slice. Load that arrives after the trial inflates every
    timing alike, so their spread stays low while the rates are far too slow. On this 2-core machine
    a quick start's 2-thread calibration measured RMSNorm over 262,144 elements at 32 ms (0.27 ms
    idle) with a 12% spread, and planned 6,494 tokens/s for a run that trained at 10,225. The same
    step timed before and after shows such a change where the spread does not: with a spinning
    process started 6 s into a 15 s calibration, the 2-thread step ran 40% slower after (63.5 ->
    89.2 ms). Only a slowdown counts: a process's first steps are its slowest (the same calibration
    with nothing else running timed the step 16% faster after, 67.9 -> 57.1 ms, and 1 thread 27%).
    A calibration that slowed more than ``memplan.local.NOISY`` is not kept, and the quick start
    measures again (its trial then finds the count that wins under the new load)."""
    _, after = fastest_threads([int(n) for n in cal.thread_seconds])
    cal.thread_recheck = after
    key = str(cal.threads)
    before = cal.thread_seconds.get(key)
    if before and after.get(key):
        cal.thread_slowdown = max(0.0, after[key] / before - 1)
        cal.noise = max(cal.noise, cal.thread_slowdown)


# ---- timing --------------------------------------------------------------------------------

CLOCKS = ("wall", "cpu")


def clock_function(clock: str) -> Callable[[], float]:
    """``wall``: time.perf_counter. ``cpu``: the process's CPU time (time.process_time), which leaves
    out the time other processes hold the core; with one thread it is the wall time the same work
    takes on an idle core (a shared machine's measurement; meaningless with several threads, which
    spin while they wait)."""
    if clock not in CLOCKS:
        raise InputError(f"--clock: {clock!r} is not one of {', '.join(CLOCKS)}")
    return time.perf_counter if clock == "wall" else time.process_time


def repeats_figure(times: Sequence[float], clock: str) -> float:
    """One figure for repeated timings of the same work. By CPU time (``clock`` cpu) their minimum: the
    process's CPU time is only ever inflated by what else runs (caches and the core's other hardware thread
    taken, pages reclaimed), never deflated, so the least of the repeats is the nearest to the work's own cost,
    where a loaded machine moves their median by tens of percent (issue 28: a quick start under load predicted
    half the tokens/s it then trained at). By wall time their median, since a wall-time figure is meant to
    include the device's ordinary variation (a GPU's clocks, a CPU's turbo)."""
    if not times:
        raise ValueError("no timings")
    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r} is not one of {', '.join(CLOCKS)}")
    return min(times) if clock == "cpu" else statistics.median(times)


class _Clock:
    """Times callables on the device, keeping a budget and the spread of every measurement."""

    def __init__(self, device: torch.device, deadline: float, clock: str = "wall"):
        self.device, self.sync, self.deadline = device, devices.synchronizer(device), deadline
        self.clock = clock
        self.now = clock_function(clock)
        self.spreads: list[float] = []
        self.tick: Callable[[], None] = lambda: None  # called after every measurement (progress)

    def left(self) -> float:
        return self.deadline - self.now()

    def time(self, fn: Callable[[], object], setup: Callable[[], object] | None = None,
             min_seconds: float = MIN_REPEAT_SECONDS, max_repeats: int = MAX_REPEATS) -> float:
        """Seconds of one call of ``fn`` (``setup`` runs untimed before each), after one warm-up: the median of the
        repeats, or their minimum by CPU time (``repeats_figure``)."""
        times: list[float] = []
        start = self.now()
        for i in range(max_repeats + 1):
            if setup is not None:
                setup()
            self.sync()
            t0 = self.now()
            fn()
            self.sync()
            if i:  # the first call warms up
                times.append(self.now() - t0)
            spent = self.now() - start
            if i >= 3 and (spent >= min_seconds or self.now() > self.deadline):
                break
            if i >= 1 and spent > 4 * min_seconds and self.now() > self.deadline:
                break
        return self._figure(times)

    def _figure(self, times: list[float]) -> float:
        """The figure of ``times`` for this clock (``repeats_figure``), their spread (IQR / median) recorded."""
        self.tick()
        med = statistics.median(times)
        if len(times) >= 4:
            q = statistics.quantiles(times, n=4)
            self.spreads.append((q[2] - q[0]) / med if med > 0 else 0.0)
        return repeats_figure(times, self.clock)

    def time_forward_backward(self, forward: Callable[[int], object], backward: Callable[[], object],
                              min_seconds: float = MIN_REPEAT_SECONDS,
                              max_repeats: int = MAX_REPEATS) -> tuple[float, float]:
        """Seconds of ``forward(i)`` and of the ``backward()`` that follows it (``_figure``: the median of the
        repeats, their minimum by CPU time), alternating as in a training step (``i`` picks which copy of the
        inputs to use), after one warm-up pair."""
        fwd, bwd = [], []
        start = self.now()
        for i in range(max_repeats + 1):
            self.sync()
            t0 = self.now()
            forward(i)
            self.sync()
            t1 = self.now()
            backward()
            self.sync()
            t2 = self.now()
            if i:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
            spent = self.now() - start
            # three timed pairs, or two when one pair alone takes longer than the whole allowance
            if i >= 3 or (i >= 2 and spent > 3 * max(min_seconds, 0.1)):
                if spent >= min_seconds or self.now() > self.deadline:
                    break
        return self._figure(fwd), self._figure(bwd)


class _Net:
    """Measured seconds → net kernel seconds: less the first touch of outputs above the mmap threshold,
    which memplan's model adds back as its own term. Dispatch overhead stays in (memplan leaves the
    dispatches of linears and attention out of its launch term)."""

    def __init__(self, cal: Calibration):
        self.cal = cal

    def first_touch(self, fresh_bytes) -> float:
        if not self.cal.first_touch_bytes_per_second:
            return 0.0
        thr = self.cal.first_touch_threshold_bytes or GLIBC_MMAP_THRESHOLD_MAX
        return sum(b for b in fresh_bytes if b >= thr) / self.cal.first_touch_bytes_per_second  # as memplan.timing

    def __call__(self, measured: float, fresh_bytes=()) -> float:
        return max(measured - self.first_touch(fresh_bytes), 0.25 * measured)  # never below a quarter


# ---- the stages ----------------------------------------------------------------------------

def measure_launch(clock: _Clock, cal: Calibration) -> None:
    """Seconds per dispatched op: forward + backward of a width-16 reference block on 8 tokens, divided by
    the ops memplan counts for that block (``memplan.timing.layer_dispatches``, plus the 4 of ``sum()``
    and its backward), so that memplan's launch term reproduces this block's time."""
    from memplan.model import ModelSpec
    from memplan.setup import TrainSetup
    from memplan.timing import layer_dispatches
    from trainer.model import Block, rotary_tables

    spec = ModelSpec(arch="llama", layers=1, hidden=16, heads=2, kv_heads=2, ffn=32, vocab=64, tied=True)
    setup = TrainSetup(ctx=8, micro_batch=1, precision="fp32", attention="sdpa", checkpointing="none")
    dev = clock.device
    block = Block(spec, "sdpa").to(dev)
    x = torch.randn(1, 8, 16, device=dev, requires_grad=True)
    rope = tuple(t.to(dev) for t in rotary_tables(spec.rotary_dim, 8, spec.rope_theta))

    def step():
        block(x, rope).sum().backward()

    seconds = clock.time(step, min_seconds=max(0.05, clock.left() / 3), max_repeats=400)
    cal.launch_overhead_seconds = seconds / (layer_dispatches(spec, setup) + BLOCK_GLUE_DISPATCHES)


def measure_memory(clock: _Clock, cal: Calibration, budget: float) -> None:
    """Copy bandwidth (a large copy) and elementwise-add bandwidth per dtype at a few working-set sizes."""
    dev = clock.device
    end = clock.now() + budget
    big = 64 * MiB if dev.type == "cpu" else 512 * MiB
    src = torch.empty(big // 4, device=dev).normal_()
    dst = torch.empty_like(src)
    seconds = clock.time(lambda: dst.copy_(src), min_seconds=min(0.1, budget / 6))
    cal.bandwidth_bytes_per_second = 2 * big / seconds
    del src, dst
    sizes = ELEMENTWISE_SIZES if dev.type == "cpu" else (4 * MiB, 256 * MiB)
    for name in ("fp32", "bf16", "fp16"):
        rows = []
        for size in sizes:
            if clock.now() > end and rows:
                cal.skipped.append(f"elementwise {name} {size // MiB} MiB")
                continue
            # operands cycled through a working set beyond the caches a step's other tensors evict
            copies = max(1, min(64, -(-ROTATE_ELEMENTWISE_BYTES // (3 * size))))
            n = size // _BYTES[name]
            abc = [[torch.ones(n, device=dev, dtype=DTYPES[name]) for _ in range(3)] for _ in range(copies)]
            turn = [0]

            def add():
                a, b, c = abc[turn[0] % copies]
                turn[0] += 1
                torch.add(a, b, out=c)

            seconds = clock.time(add, min_seconds=min(0.05, budget / 20), max_repeats=max(MAX_REPEATS, 2 * copies))
            rows.append([size, 3 * size / seconds])
            del abc
        cal.elementwise[name] = rows


def measure_first_touch(clock: _Clock, cal: Calibration) -> None:
    """CPU: the rate at which fresh pages are written. glibc serves allocations above its mmap threshold
    (at most 32 MiB, mallopt(3); smaller ones once a freed chunk has raised it) with fresh pages from the
    kernel, which zeroes each on first write: a fill of a new 64 MiB tensor against a fill of an old one."""
    if clock.device.type != "cpu":
        return
    reuse = torch.empty(64 * MiB // 4)
    fresh = clock.time(lambda: torch.empty(64 * MiB // 4).fill_(1.0), min_seconds=0.05)
    warm = clock.time(lambda: reuse.fill_(1.0), min_seconds=0.05)
    if fresh > 1.5 * warm:
        cal.first_touch_bytes_per_second = 64 * MiB / (fresh - warm)
        cal.first_touch_threshold_bytes = GLIBC_MMAP_THRESHOLD_MAX


MODULE_ELEMENTS = (2**14, 2**18, 2**22)  # output elements: 64 KiB to 16 MiB of fp32
MODULE_WIDTH = 256  # hidden width of the measured norms; SwiGLU/GELU inner width; 4 heads × 64 for rotary


def _module_case(op: str, dtype: torch.dtype, elements: int, dev):
    """(inputs needing grad, forward callable, gradient of its output) of one module at ``elements``."""
    from trainer.model import RMSNorm, apply_rotary, rotary_tables

    rows = max(1, elements // MODULE_WIDTH)
    if op in ("rmsnorm", "layernorm"):
        mod = (RMSNorm(MODULE_WIDTH, 1e-5) if op == "rmsnorm" else torch.nn.LayerNorm(MODULE_WIDTH)).to(dev, dtype)
        x = torch.randn(rows, MODULE_WIDTH, device=dev, dtype=dtype, requires_grad=True)
        return [x, *mod.parameters()], lambda: mod(x), torch.randn(rows, MODULE_WIDTH, device=dev, dtype=dtype)
    if op == "rotary":
        cos, sin = (t.to(dev, dtype) for t in rotary_tables(64, rows, 10000.0))
        x = torch.randn(1, rows, 4, 64, device=dev, dtype=dtype, requires_grad=True)
        return [x], lambda: apply_rotary(x, cos, sin), torch.randn(1, rows, 4, 64, device=dev, dtype=dtype)
    width = 2 * MODULE_WIDTH if op == "swiglu" else MODULE_WIDTH
    h = torch.randn(rows, width, device=dev, dtype=dtype, requires_grad=True)

    def swiglu():
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    fn = swiglu if op == "swiglu" else (lambda: F.gelu(h, approximate="tanh"))
    return [h], fn, torch.randn(rows, MODULE_WIDTH, device=dev, dtype=dtype)


def measure_modules(clock: _Clock, cal: Calibration, budget: float) -> None:
    """The model's elementwise modules, forward and backward as autograd runs them, per dtype and size:
    RMSNorm (its six-op autograd Function), LayerNorm, RoPE (strided half-rotations), SwiGLU and GELU.
    Their ops broadcast, stride and compute exp/tanh, so they run below the streaming bandwidth; each
    is timed whole, its dispatches included. Rows: [output elements, forward s, backward s]."""
    dev = clock.device
    end = clock.now() + budget
    jobs = [(op, d) for d in ("fp32", "bf16") for op in ("rmsnorm", "rotary", "swiglu", "layernorm", "gelu")]
    for j, (op, dtype) in enumerate(jobs):
        rows = []
        for elements in MODULE_ELEMENTS:
            left = end - clock.now()
            if rows and left <= 0:
                cal.skipped.append(f"module {op} {dtype} {elements}")
                continue
            # several copies in turn, as for the matmuls: a step's tensors come from L3 or DRAM
            copies = max(1, min(16, -(-ROTATE_ELEMENTWISE_BYTES // (4 * elements * _BYTES[dtype]))))
            cases = [_module_case(op, DTYPES[dtype], elements, dev) for _ in range(copies)]
            holder = {}

            def forward(i):
                params, fn, g = cases[i % copies]
                for p in params:
                    p.grad = None
                holder["y"], holder["g"] = fn(), g

            def backward():
                holder.pop("y").backward(holder.pop("g"))

            share = max(0.005, left / max(1, (len(jobs) - j) * len(MODULE_ELEMENTS)))
            t_fwd, t_bwd = clock.time_forward_backward(forward, backward, min_seconds=share / 2)
            rows.append([elements, t_fwd, t_bwd])
            del cases, holder
        cal.modules[f"{op}_{dtype}"] = rows


def measure_transcendental(clock: _Clock, cal: Calibration, budget: float) -> None:
    """Elements per second of SiLU forward per dtype and of log-softmax forward (fp32, bf16)."""
    dev = clock.device
    n_elements = 2 * MiB  # 8 MiB of fp32: below the first-touch threshold, above L2
    for name in ("fp32", "bf16"):
        x = torch.randn(n_elements, device=dev, dtype=DTYPES[name])
        seconds = clock.time(lambda: F.silu(x), min_seconds=budget / 8)
        cal.transcendental[f"silu_{name}"] = n_elements / seconds
        x2 = x.view(512, -1)
        seconds = clock.time(lambda: torch.log_softmax(x2, dim=-1), min_seconds=budget / 8)
        cal.transcendental[f"log_softmax_{name}"] = n_elements / seconds
        del x, x2


def _matmul_shapes() -> list[tuple[int, int, int]]:
    """The grid, fewest tokens first and within a token count by FLOPs: every (in, out) pair is measured
    at 64 tokens (the LM head's width at 16) before any at 512, so a slow dtype still covers the widths
    (rates change less along tokens, where the table follows the nearest pair measured further, than
    across widths)."""
    first = MATMUL_TOKENS[0]
    # the LM head's width first at 16 tokens: the widest shapes cost the most and matter most for small models
    shapes = [(MATMUL_MIN_TOKENS if m == first and n == MATMUL_OUT[-1] else m, k, n)
              for m in MATMUL_TOKENS for k in MATMUL_IN for n in MATMUL_OUT]
    plane = {m: i for i, m in enumerate(MATMUL_TOKENS)}
    return sorted(shapes, key=lambda s: (plane.get(s[0], 0), s[0] * s[1] * s[2], s))


def measure_matmul(clock: _Clock, cal: Calibration, dtype: str, budget: float) -> None:
    """F.linear forward and backward (through autograd) on the shape grid, smallest first, while the
    dtype's budget lasts. Rows: [tokens, in, out, net forward TFLOPS, net backward TFLOPS]."""
    dev = clock.device
    end = clock.now() + budget
    torch_dtype = torch.float32 if dtype == "tf32" else DTYPES[dtype]
    if dtype in ("tf32", "fp32") and dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    net = _Net(cal)
    rows: list[list[float]] = []
    seconds_per_flop = None
    size = _BYTES.get(dtype, 4)
    try:
        measured = set()
        for m, k, n in _matmul_shapes():
            left = end - clock.now()
            # a measurement costs at least four forward + backward pairs (a warm-up and 3 timed). A shape too
            # costly for what is left is measured with a quarter (then a sixteenth) of the tokens, down to 16,
            # where a slow dtype runs at nearly the same rate per FLOP: the widths are what matters most
            # (an emulated bf16's backward at the LM head's width is 2-3 times slower than at 4096)
            for tokens_tried in (m, m // 4, m // 16):
                flops = 2.0 * tokens_tried * k * n
                fits = not rows or (left > 0 and not (seconds_per_flop and 4 * 3 * flops * seconds_per_flop > left))
                if tokens_tried >= MATMUL_MIN_TOKENS and (tokens_tried, k, n) not in measured and fits:
                    break
            else:
                cal.skipped.append(f"matmul {dtype} {m}x{k}x{n}")
                continue
            m = tokens_tried
            measured.add((m, k, n))
            # copies of the inputs, used in turn, so that each call finds them out of the L2 cache as in a
            # step, where other kernels run between two matmuls (8 MiB at least, 16 copies at most)
            copies = max(1, min(16, -(-ROTATE_BYTES // ((m * k + n * k) * size))))
            xs = [torch.randn(m, k, device=dev, dtype=torch_dtype, requires_grad=True) for _ in range(copies)]
            ws = [torch.randn(n, k, device=dev, dtype=torch_dtype, requires_grad=True) for _ in range(copies)]
            g = torch.randn(m, n, device=dev, dtype=torch_dtype)
            holder = {}

            def forward(i):
                x, w = xs[i % copies], ws[i % copies]
                x.grad = w.grad = None
                holder["y"] = F.linear(x, w)

            def backward():
                holder.pop("y").backward(g)

            per_call = max(MIN_REPEAT_SECONDS / 2, min(0.1, left / 60))
            t_fwd, t_bwd = clock.time_forward_backward(forward, backward, min_seconds=per_call)
            fwd = net(t_fwd, [m * n * size])
            bwd = net(t_bwd, [m * k * size, n * k * size])
            rows.append([m, k, n, flops / fwd / 1e12, 2 * flops / bwd / 1e12])
            seconds_per_flop = max((t_fwd + t_bwd) / (3 * flops), seconds_per_flop / 4 if seconds_per_flop else 0.0)
            del xs, ws, g, holder
    finally:
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
    cal.matmul[dtype] = sorted(rows, key=lambda r: (r[0], r[1] * r[2], r[:3]))


def measure_attention(clock: _Clock, cal: Calibration, dtypes: list[str], budget: float) -> None:
    """SDPA (causal) and the reference eager attention, forward and backward, per dtype, sequence length
    and head width, on (B, T, heads, d) views transposed as the model passes them. Rows: [T, d, forward
    TFLOPS, backward TFLOPS] against the nominal 4·B·h·T²·d forward and 8·B·h·T²·d backward FLOPs. Two
    head widths, because the per-score work (scale, mask, softmax, exp) does not grow with d while the
    FLOPs do.

    Each call does enough work to hide its dispatch cost (batch·heads·T² up to 2²²) but is sized from
    the dtype's measured matmul rate so that a slow (emulated) dtype still fits the budget."""
    from trainer.model import causal_mask, eager_attention

    dev = clock.device
    end = clock.now() + budget
    net = _Net(cal)
    ctxs = ATTENTION_CTX + ((4096,) if dev.type != "cpu" else ())
    points = [(T, hd) for T in ctxs for hd in ATTENTION_HEAD_DIMS]
    jobs = [(impl, dtype) for dtype in dtypes for impl in ("sdpa", "eager")]
    weight = {d: (2.0 if d == "fp32" else 1.0) for d in dtypes}  # fp32 first and with twice the time
    best = cal.matmul_tflops()
    for j, (impl, dtype) in enumerate(jobs):
        rows = []
        # a guess of the rate from the matmul table: attention runs at a fraction of it
        guess = 0.25 * best.get(dtype, best.get("fp32", 1e-3)) * 1e12
        job_share = weight[dtype] / sum(weight[d] for _, d in jobs[j:])
        for i, (T, hd) in enumerate(points):
            left = end - clock.now()
            share = left * job_share / (len(points) - i)  # this job's share of the time left, per point
            # a measurement runs at least 4 forward + backward pairs, ~12 forward-equivalents (the backward
            # does about twice the forward's work)
            call = max(2e-3, min(0.05, share / 12))
            bh = int(max(1, min(ATTENTION_SCORES // (T * T), call * guess / (4.0 * T * T * hd))))
            if rows and 12 * 4.0 * bh * T * T * hd / guess > max(share, 0):
                cal.skipped.append(f"attention {impl} {dtype} T={T} d={hd}")
                continue
            b, h = max(1, bh // 4), min(4, bh)
            torch_dtype = DTYPES[dtype]
            copies = max(1, min(8, -(-ROTATE_BYTES // (3 * b * T * h * hd * _BYTES[dtype]))))
            inputs = [[torch.randn(b, T, h, hd, device=dev, dtype=torch_dtype, requires_grad=True) for _ in range(3)]
                      for _ in range(copies)]
            mask = causal_mask(T, dev)
            g = torch.randn(b, h, T, hd, device=dev, dtype=torch_dtype)
            holder = {}

            def forward(i):
                q, k, v = inputs[i % copies]
                q.grad = k.grad = v.grad = None
                qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                if impl == "sdpa":
                    holder["y"] = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
                else:
                    holder["y"] = eager_attention(qt, kt, vt, mask)

            def backward():
                holder.pop("y").backward(g)

            try:
                t_fwd, t_bwd = clock.time_forward_backward(forward, backward, min_seconds=2 * call)
            except RuntimeError as e:  # an implementation this device or dtype lacks
                cal.skipped.append(f"attention {impl} {dtype} T={T} d={hd}: {str(e).splitlines()[0][:80]}")
                break
            scores = b * h * T * T * _BYTES[dtype]
            nominal = 4.0 * b * h * T * T * hd
            fwd = net(t_fwd, [scores] if impl == "eager" else [])
            bwd = net(t_bwd, [scores, scores] if impl == "eager" else [])
            rows.append([T, hd, nominal / fwd / 1e12, 2 * nominal / bwd / 1e12])
            guess = nominal / t_fwd
            del inputs, g, holder
        if rows:
            cal.attention[f"{impl}_{dtype}"] = rows


def measure_optimizer(clock: _Clock, cal: Calibration, budget: float) -> None:
    """clip_grad_norm_(foreach) + step() + zero_grad(set_to_none) per optimizer, as ``train_step`` runs
    them: once on a few large tensors (per parameter cost) and once on many small ones (per tensor)."""
    from trainer.step import make_optimizer

    dev = clock.device
    if dev.type == "cpu":
        # sized to the budget at ~20 ns per parameter and ~6 steps per optimizer: 1M-16M params, 16 tensors
        params = int(min(2**24, max(2**20, budget / (6 * len(("adamw", "adamw-fused", "sgd"))) / 2e-8)))
        big = (16, params // 32)
    else:
        big = (32, 2**21)  # 128M params, each tensor below 32 MiB
    small = (256, 64)
    names = ("adamw", "adamw-fused", "sgd")
    per_run = budget / (2 * len(names))
    for name in names:
        results = []
        try:
            for count, numel in (big, small):
                model = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(numel, 2, device=dev))
                                               for _ in range(count))
                grads = [torch.randn(numel, 2, device=dev) for _ in range(count)]
                opt = make_optimizer(model, name)

                def setup():
                    for p, gr in zip(model, grads):
                        p.grad = gr

                def step():
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                setup()
                step()  # allocates the state
                results.append((count, 2 * numel * count, clock.time(step, setup=setup, min_seconds=per_run / 2)))
                del model, grads, opt
        except (RuntimeError, InputError) as e:
            cal.skipped.append(f"optimizer {name}: {str(e).splitlines()[0][:80]}")
            continue
        (c1, p1, t1), (c2, p2, t2) = results
        # t = c·per_tensor + p·per_param on both; solve the 2×2 system (never below zero)
        det = c1 * p2 - c2 * p1
        per_tensor = max(0.0, (t1 * p2 - t2 * p1) / det) if det else t2 / c2
        per_param = max(1e-15, (c1 * t2 - c2 * t1) / det) if det else t1 / p1
        cal.optimizer[name] = [per_param, per_tensor]


# ---- the whole run -------------------------------------------------------------------------


# The step measure_compile times: a small Llama (4.2M parameters at vocab 4096), fp32, SDPA, foreach AdamW, one
# micro-batch; small enough that a compile takes ~20-40 s on a laptop core, large enough that its step is not
# all dispatch.
COMPILE_REFERENCE = {"layers": 2, "hidden": 256, "heads": 4, "ffn": 704, "vocab": 4096, "ctx": 256, "micro_batch": 4}
COMPILE_STEPS = 6  # timed steps of each (eager, compiled), alternating


def measure_compile(clock: _Clock, cal: Calibration, steps: int = COMPILE_STEPS) -> None:
    """``cal.compile``: COMPILE_REFERENCE's training step (``train_step``) eager and ``torch.compile``d, median
    seconds of ``steps`` of each (alternating, by the calibration's clock; their minimum by CPU time,
    ``repeats_figure``) and the compile's one-off: the wall time of the first compiled step less a compiled step (compiling runs in worker processes too, which a
    CPU-time clock would not see). A compile that fails (no C compiler for inductor on a CPU, ...) is recorded
    in ``cal.skipped``, and nothing else."""
    from memplan.model import ModelSpec
    from memplan.setup import TrainSetup
    from trainer.model import build_model
    from trainer.step import make_optimizer, train_step

    r = COMPILE_REFERENCE
    spec = ModelSpec(arch="llama", layers=r["layers"], hidden=r["hidden"], heads=r["heads"], kv_heads=r["heads"],
                     ffn=r["ffn"], vocab=r["vocab"], tied=True)
    setup = TrainSetup(ctx=r["ctx"], micro_batch=r["micro_batch"], precision="fp32", attention="sdpa",
                       optimizer="adamw")
    device = clock.device
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(r["vocab"], (r["micro_batch"], r["ctx"]), generator=gen).to(device)
    y = torch.randint(r["vocab"], (r["micro_batch"], r["ctx"]), generator=gen).to(device)

    def make(compiled: bool):
        torch.manual_seed(0)
        model = build_model(spec, "sdpa", "none", torch.float32, device=device)
        return (torch.compile(model) if compiled else model), make_optimizer(model, "adamw")

    def step(model, opt, now=clock.now) -> float:
        clock.sync()
        t0 = now()
        train_step(model, opt, [(x, y)], setup, device.type, check_finite=False)
        clock.sync()
        return now() - t0

    eager, eager_opt = make(False)
    step(eager, eager_opt)  # warm-up
    try:
        compiled, compiled_opt = make(True)
        first = step(compiled, compiled_opt, now=time.perf_counter)
        step(compiled, compiled_opt)  # a second call can still specialise
    except Exception as e:  # inductor needs a C++ compiler on a CPU, Triton on a GPU
        cal.skipped.append(f"torch.compile: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}")
        return
    e_times, c_times, c_wall = [], [], []
    for _ in range(steps):
        e_times.append(step(eager, eager_opt))
        c_times.append(step(compiled, compiled_opt))
        c_wall.append(step(compiled, compiled_opt, now=time.perf_counter))
    cal.compile = {**r, "eager_seconds": repeats_figure(e_times, clock.clock),
                   "compiled_seconds": repeats_figure(c_times, clock.clock),
                   "compile_seconds": max(0.0, first - statistics.median(c_wall))}
    clock.tick()
    del compiled, compiled_opt
    torch._dynamo.reset()


# measure_compile_cost's two compiles, each a Llama step (fp32, SDPA, foreach AdamW, one micro-batch of 2 × 64
# tokens at vocab 512) compiled in a fresh process with an empty inductor cache, as a run's first step compiles:
# three blocks and five; their difference is the cost of two blocks' ops, the rest the fixed part. Not one block:
# the first and the last block fuse with the embedding and the final norm into kernels of their own, and a third
# block adds the middle one's, so one to three blocks adds kernels to build as well as ops (a run here: 40.7 ms
# per op, against 24 ms between the 2- and 10-block models of benchmarks/compile_time.py).
COMPILE_COST_MODELS = ({"layers": 3, "hidden": 64, "heads": 2, "ffn": 176},
                       {"layers": 5, "hidden": 64, "heads": 2, "ffn": 176})
COMPILE_COST_SHAPE = {"vocab": 512, "ctx": 64, "micro_batch": 2}


def compile_cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended: with inductor's ``compile_threads = 1``
    its C++ builds run as such children (g++), so this counts the whole compile, whatever else holds the cores."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def compile_one_off(spec, setup, device: torch.device, steps: int = 3) -> dict:
    """torch.compile's one-off for the trainer's model and step (``build_model``, ``torch.compile`` of the whole
    model as trainer/loop.py does, ``train_step``), as a run pays it: the first two compiled steps (a recompile at
    the second would be part of it; ``memplan.timing.trainer_recompiles`` models none, and without one the second
    adds a steady step's time, which the subtraction takes back) less two steady ones (the median of ``steps`` after them). Returns ``wall_seconds`` (perf_counter), ``cpu_seconds`` (``compile_cpu_seconds``, with inductor's
    builds in this process's children: ``compile_threads = 1`` while it runs), ``first_cpu_seconds`` (the first
    step's part alone), ``graphs`` (dynamo's distinct graphs after the first step) and ``recompiles`` (graphs
    compiled by the second step; ``late_recompiles``: by the steady steps after it)."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from trainer.model import build_model
    from trainer.step import make_optimizer, train_step

    gen = torch.Generator().manual_seed(0)
    batch = [(torch.randint(spec.vocab, (setup.micro_batch, setup.ctx), generator=gen).to(device),
              torch.randint(spec.vocab, (setup.micro_batch, setup.ctx), generator=gen).to(device))]
    torch.manual_seed(0)
    model = build_model(spec, setup.attention, setup.checkpointing, torch.float32, device=device)
    optimizer = make_optimizer(model, setup.optimizer)
    compiled = torch.compile(model)
    sync = devices.synchronizer(device)

    def step() -> tuple[float, float]:
        sync()
        w0, c0 = time.perf_counter(), compile_cpu_seconds()
        train_step(compiled, optimizer, batch * setup.grad_accum, setup, device.type, check_finite=False)
        sync()
        return time.perf_counter() - w0, compile_cpu_seconds() - c0

    with inductor_config.patch(compile_threads=1):
        before = counters["stats"]["unique_graphs"]
        first = step()
        graphs = counters["stats"]["unique_graphs"] - before
        second = step()
        recompiles = counters["stats"]["unique_graphs"] - before - graphs
        steady = [step() for _ in range(steps)]
    late = counters["stats"]["unique_graphs"] - before - graphs - recompiles
    del compiled, optimizer, model
    torch._dynamo.reset()
    wall, cpu = statistics.median(w for w, _ in steady), statistics.median(c for _, c in steady)
    return {"wall_seconds": max(0.0, first[0] + second[0] - 2 * wall),
            "cpu_seconds": max(0.0, first[1] + second[1] - 2 * cpu),
            "first_cpu_seconds": max(0.0, first[1] - cpu),
            "graphs": graphs, "recompiles": recompiles, "late_recompiles": late}


def fit_compile_cost(small: float, large: float, ops: tuple[int, int], compiles: int = 1) -> dict:
    """``compile_cost`` from measure_compile_cost's two one-off times (seconds, each a fresh process's) and their
    models' ops (``memplan.timing.compiled_graph_ops``), each graph compiled ``compiles`` times (1 + the trainer's
    recompiles): seconds per op c = (large − small) / (compiles · (ops_large − ops_small)), fixed seconds
    F = small − compiles · c · ops_small (neither below 0), so that ``memplan.timing.compile_seconds`` gives both back."""
    per_op = max(0.0, (large - small) / (compiles * (ops[1] - ops[0])))
    return {"fixed_seconds": max(0.0, small - compiles * per_op * ops[0]), "seconds_per_op": per_op}


def _compile_cost_specs():
    from memplan.model import ModelSpec
    from memplan.setup import TrainSetup

    setup = TrainSetup(ctx=COMPILE_COST_SHAPE["ctx"], micro_batch=COMPILE_COST_SHAPE["micro_batch"],
                       precision="fp32", attention="sdpa", optimizer="adamw")
    specs = [ModelSpec(arch="llama", layers=m["layers"], hidden=m["hidden"], heads=m["heads"], kv_heads=m["heads"],
                       ffn=m["ffn"], vocab=COMPILE_COST_SHAPE["vocab"], tied=True) for m in COMPILE_COST_MODELS]
    return specs, setup


def compile_cost_worker(index: int, device_type: str = "cpu") -> dict:
    """``compile_one_off`` of COMPILE_COST_MODELS[index], in this process (measure_compile_cost runs it in a fresh
    one: ``python -m trainer.calibrate --compile-cost-worker INDEX DEVICE``)."""
    specs, setup = _compile_cost_specs()
    torch.set_num_threads(1)
    return compile_one_off(specs[index], setup, torch.device(device_type))


def _fresh_process_compile(index: int, device_type: str) -> dict:
    """``compile_cost_worker(index)`` in a fresh Python process with an empty inductor cache."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory(prefix="memplan-compile-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache,
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        out = subprocess.run([sys.executable, "-m", "trainer.calibrate", "--compile-cost-worker", str(index),
                              device_type], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
        raise RuntimeError(last)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_compile_cost(cal: Calibration, device: torch.device | None = None, fresh_processes: bool = True) -> None:
    """``cal.compile_cost``: torch.compile's fixed seconds and seconds per op of the compiled graph on this machine
    (``fit_compile_cost`` over COMPILE_COST_MODELS, each timed by ``compile_one_off`` in a fresh process with an
    empty inductor cache, as a run's first compile; ``fresh_processes=False`` compiles in this process, for tests).
    CPU seconds on a CPU (the compile's own work, which other processes on a shared machine do not lengthen),
    wall seconds on a GPU. A compile that fails is recorded in ``cal.skipped``, and nothing else."""
    from memplan.timing import compiled_graph_ops, trainer_recompiles

    device = device or torch.device("cpu")
    key = "cpu_seconds" if device.type == "cpu" else "wall_seconds"
    specs, setup = _compile_cost_specs()
    try:
        if fresh_processes and key == "cpu_seconds":  # CPU seconds: the two processes may share the cores
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(specs)) as pool:
                found = list(pool.map(lambda i: _fresh_process_compile(i, device.type), range(len(specs))))
        elif fresh_processes:
            found = [_fresh_process_compile(i, device.type) for i in range(len(specs))]
        else:
            found = [compile_one_off(spec, setup, device) for spec in specs]
    except Exception as e:  # inductor needs a C++ compiler on a CPU, Triton on a GPU
        cal.skipped.append(f"torch.compile cost: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}")
        return
    times = [f[key] for f in found]
    ops = tuple(compiled_graph_ops(spec, setup) for spec in specs)
    compiles = 1 + trainer_recompiles(specs[0], setup)
    cal.compile_cost = {**fit_compile_cost(*times, ops, compiles), "clock": key.split("_")[0],
                        "seconds": [round(t, 3) for t in times], "ops": list(ops)}


def matmul_dtypes(family: str) -> list[str]:
    """Every dtype memplan plans that runs here: fp32, tf32 (NVIDIA Ampere+), bf16, fp16."""
    dtypes = ["fp32"]
    if family == "cuda" and torch.cuda.get_device_capability(0) >= (8, 0):
        dtypes.append("tf32")
    dtypes += ["bf16", "fp16"]
    return dtypes


def calibrate(seconds: float = 60.0, threads: int | None = None, clock: str = "wall",
              progress: Callable[[str, float], None] | None = None, choose_threads: bool = False,
              share_clock: bool = False, compile: bool = False, loaded: Sequence[str] = ()) -> Calibration:
    """Measure the local device within about ``seconds`` (the smallest case of every table is measured
    even when the budget is spent). ``threads`` pins torch's CPU threads (default: as they are, or with
    ``choose_threads`` on a CPU, the fastest of one and all cores by ``fastest_threads``, recorded in
    ``thread_seconds``); with ``share_clock``, a one-thread CPU calibration times by CPU time (``clock``
    cpu) and records ``cpu_share``, the share of the core the process got (CPU time / wall time over
    the calibration): a busy machine's kernel rates then come out as an idle core's, and memplan's step
    time adds the time other processes hold the core (``memplan.timing``'s contention term);
    ``clock`` is ``wall`` or, for a one-thread CPU calibration on a shared machine, ``cpu``: timings and
    the budget then run on the process's CPU time, so a loaded machine measures the same shapes (in
    more wall time) as an idle one.

    With ``compile``, ``measure_compile`` times torch.compile on a reference step after the budgeted stages.
    ``loaded``: the modules a training process loads besides trainer (``process_baseline_bytes``), imported
    before the runtime context is measured.

    ``progress(stage, fraction_done)`` is called as the stages advance.
    """
    if not seconds > 0 or math.isinf(seconds) or math.isnan(seconds):
        raise InputError(f"--seconds: {seconds!r} must be a positive number of seconds, e.g. 60")
    if threads is not None:
        if threads < 1:
            raise InputError(f"--threads: {threads!r} must be a positive integer")
        torch.set_num_threads(threads)
    family = devices.local_family()
    clock_function(clock)
    thread_seconds: dict[str, float] = {}
    if threads is None and choose_threads and family == "cpu" and clock == "wall":
        if progress is not None:
            progress("threads", 0.0)
        best, thread_seconds = fastest_threads(
            on_round=(lambda done: progress("threads", done)) if progress is not None else None)
        torch.set_num_threads(best)
    if (share_clock or choose_threads) and family == "cpu" and torch.get_num_threads() == 1:
        clock = "cpu"
    if clock == "cpu" and (family != "cpu" or torch.get_num_threads() != 1):
        raise InputError(f"--clock cpu measures one CPU thread; this run has device {family} and "
                         f"{torch.get_num_threads()} thread(s) (use --threads 1 on a CPU, or --clock wall)")
    device = devices.torch_device(family)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    total, usable, source = devices.device_memory(family)
    cal = Calibration(family=family, title=devices.device_title(family), threads=torch.get_num_threads(),
                      torch_version=torch.__version__, started=_dt.datetime.now().isoformat(timespec="seconds"),
                      memory_total_bytes=total, memory_usable_bytes=usable, memory_source=source,
                      runtime_context_bytes=runtime_context_bytes(family, loaded), thread_seconds=thread_seconds)
    if family == "cpu":  # the process's resident memory is what a CPU run measures: the model code's counts
        if progress is not None:
            progress("model code", 0.0)
        cal.transformers_code_bytes, cal.peft_code_bytes = model_code_bytes()
    plan = seconds * PLANNED_SHARE  # measurements overrun their shares a little (the smallest cases always run)
    timer = _Clock(device, deadline=0.0, clock=clock)  # budgets run on the measuring clock: CPU time with cpu
    t0 = timer.now()
    timer.deadline = t0 + plan
    cal.clock = clock
    shown = {"stage": "starting", "done": 0.0}

    def report(stage: str, done: float) -> None:
        """The stage, and the larger of its start and the share of the budget spent (never backwards)."""
        shown["stage"], shown["done"] = stage, max(shown["done"], done)
        if progress is not None:
            progress(stage, shown["done"])

    timer.tick = lambda: report(shown["stage"], min(0.99, (timer.now() - t0) / plan))

    def share(stage: str) -> float:
        return plan * BUDGET_SHARES[stage]

    was_grad = torch.is_grad_enabled()
    torch.set_grad_enabled(True)
    try:
        report("launch overhead", 0.0)
        timer.deadline = timer.now() + share("launch")
        measure_launch(timer, cal)
        report("memory bandwidth", 0.04)
        timer.deadline = timer.now() + share("memory") * 0.7
        measure_memory(timer, cal, share("memory") * 0.7)
        report("first touch", 0.10)
        timer.deadline = timer.now() + share("memory") * 0.3
        measure_first_touch(timer, cal)
        report("transcendental", 0.12)
        timer.deadline = timer.now() + share("transcendental")
        measure_transcendental(timer, cal, share("transcendental"))
        report("modules", 0.14)
        timer.deadline = timer.now() + share("modules")
        measure_modules(timer, cal, share("modules"))
        dtypes = matmul_dtypes(family)
        weights = {d: MATMUL_DTYPE_SHARES[d] for d in dtypes}
        done = 0.24
        for d in dtypes:
            report(f"matmul {d}", done)
            budget = share("matmul") * weights[d] / sum(weights.values())
            timer.deadline = timer.now() + budget
            measure_matmul(timer, cal, d, budget)
            done += 0.46 * weights[d] / sum(weights.values())
        report("attention", 0.70)
        budget = max(share("attention"), t0 + plan * (1 - BUDGET_SHARES["optimizer"]) - timer.now())
        timer.deadline = timer.now() + budget
        measure_attention(timer, cal, ["fp32", "bf16", "fp16"], budget)
        report("optimizer", 0.92)
        budget = max(share("optimizer") / 2, t0 + plan - timer.now())
        timer.deadline = timer.now() + budget
        measure_optimizer(timer, cal, budget)
        if compile:
            report("torch.compile", 0.99)
            timer.deadline = math.inf
            measure_compile_cost(cal, timer.device)  # each compile in a fresh process of its own
            measure_compile(timer, cal)
        report("done", 1.0)
    finally:
        torch.set_grad_enabled(was_grad)
    cal.noise = statistics.median(timer.spreads) if timer.spreads else 0.0
    if thread_seconds and cal.threads > 1:  # several threads time by the wall clock (one thread, by CPU time)
        if progress is not None:
            progress("threads again", 1.0)
        recheck_threads(cal)
    cal.seconds = time.perf_counter() - wall0
    if clock == "cpu" and cal.seconds > 0:
        cal.cpu_share = min(1.0, (time.process_time() - cpu0) / cal.seconds)
    return cal


def _median_rows(tables: list[list[list[float]]], key_width: int) -> list[list[float]]:
    """Rows keyed by their first ``key_width`` numbers; the median of each measured column per key."""
    by_key: dict[tuple, list[list[float]]] = {}
    for rows in tables:
        for row in rows:
            by_key.setdefault(tuple(row[:key_width]), []).append(row[key_width:])
    return [list(key) + [statistics.median(col) for col in zip(*vals)] for key, vals in by_key.items()]


def merge_calibrations(cals: list[Calibration]) -> Calibration:
    """One calibration from several of the same device (taken between other work on a shared machine):
    the median of every measured number, rows matched by their shape. Each measurement is then the
    middle of what the device gave across the run, not what it gave in one minute."""
    if not cals:
        raise ValueError("no calibrations to merge")
    first = cals[0]

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out = Calibration(family=first.family, title=first.title, threads=first.threads, clock=first.clock,
                      torch_version=first.torch_version, started=first.started)
    out.seconds = sum(c.seconds for c in cals)
    for name in ("memory_total_bytes", "memory_usable_bytes", "runtime_context_bytes"):
        setattr(out, name, int(med([getattr(c, name) for c in cals])))
    for name in ("transformers_code_bytes", "peft_code_bytes"):
        value = med([getattr(c, name) for c in cals])
        setattr(out, name, None if value is None else int(value))
    out.memory_source = first.memory_source
    for name in ("bandwidth_bytes_per_second", "launch_overhead_seconds", "first_touch_bytes_per_second", "noise"):
        setattr(out, name, med([getattr(c, name) for c in cals]))
    out.first_touch_threshold_bytes = first.first_touch_threshold_bytes
    for key in {k for c in cals for k in c.transcendental}:
        out.transcendental[key] = med([c.transcendental.get(key) for c in cals])
    for key in {k for c in cals for k in c.optimizer}:
        rows = [c.optimizer[key] for c in cals if key in c.optimizer]
        out.optimizer[key] = [statistics.median(col) for col in zip(*rows)]
    for attr, width in (("matmul", 3), ("attention", 2), ("elementwise", 1), ("modules", 1)):
        merged = {}
        for key in {k for c in cals for k in getattr(c, attr)}:
            merged[key] = sorted(_median_rows([getattr(c, attr)[key] for c in cals if key in getattr(c, attr)],
                                              width), key=lambda r: (math.prod(r[:width]), r[:width]))
        setattr(out, attr, merged)
    out.skipped = sorted(set.intersection(*(set(c.skipped) for c in cals)))
    return out


# ---- the profile ---------------------------------------------------------------------------

# FP32 FLOP per cycle per core of the SIMD units torch reports (two FMA pipes × lanes × 2).
_CPU_FLOP_PER_CYCLE = {"AVX512": 64, "AVX2": 32, "DEFAULT": 8}


def cpu_peak_tflops(threads: int) -> tuple[float | None, str]:
    """Nominal fp32 peak of the cores torch uses: threads × clock × FLOP/cycle (None if the clock is unknown)."""
    import psutil

    freq = psutil.cpu_freq()
    mhz = (freq.max or freq.current) if freq else 0.0
    capability = torch.backends.cpu.get_cpu_capability()
    per_cycle = _CPU_FLOP_PER_CYCLE.get(capability, 8)
    if not mhz:
        return None, ""
    return threads * mhz * 1e6 * per_cycle / 1e12, (f"{threads} thread(s) x {mhz:.0f} MHz (psutil.cpu_freq) x "
                                                     f"{per_cycle} FP32 FLOP/cycle ({capability})")


def profile_data(cal: Calibration, name: str, base=None) -> dict:
    """The profile TOML (as a dict) for a calibration: the schema of ``memplan/hardware.py``.

    ``base`` is the bundled profile of the same device (a ``memplan.hardware.Device``) if there is one:
    its vendor peaks and allocator figures are kept, and achievable fractions become measured/peak.
    """
    measured = cal.matmul_tflops()
    when = cal.started[:10]
    where = f"measured by memplan calibrate on {cal.title!r}, {when}, torch {cal.torch_version}, " \
            f"{cal.threads} thread(s)"
    peak: dict[str, float] = {}
    peak_source = ""
    if base is not None and base.family == cal.family and cal.family != "cpu":
        peak = dict(base.peak_tflops)
        peak_source = f"from the bundled profile {base.name}: {base.sources.get('peak_tflops', '')}"
    elif cal.family == "cpu":
        nominal, how = cpu_peak_tflops(cal.threads)
        if nominal:
            peak = {"fp32": nominal}
            peak_source = f"derived: {how}"
    for dtype, rate in measured.items():
        if dtype not in peak or peak[dtype] < rate:
            peak[dtype] = max(peak.get(dtype, 0.0), rate)
            peak_source = (peak_source + "; " if peak_source else "") + f"{dtype}: the measured rate (no vendor figure)"
    achievable = {d: min(1.0, max(1e-6, measured[d] / peak[d])) for d in measured if peak.get(d)}
    fp32 = measured.get("fp32", 0.0)
    # a dtype is native (fast) if its best matmul reaches half the fp32 rate: emulated bf16 on a CPU
    # without AVX512-BF16 runs 10-100 times slower
    native = {"fp32": True}
    for d in ("tf32", "bf16", "fp16"):
        native[d] = bool(d in measured and fp32 and measured[d] >= 0.5 * fp32)
    native["fp8"] = False
    runtime = {"context_bytes": int(cal.runtime_context_bytes),
               "allocator_overhead": float(base.allocator_overhead) if base is not None else 0.0,
               "source": where + ("; allocator_overhead from " + base.name if base is not None else "")}
    for key in ("transformers_code_bytes", "peft_code_bytes"):  # CPU, where measured (model_code_bytes)
        if getattr(cal, key) is not None:
            runtime[key] = int(getattr(cal, key))
    calibrated = {
        "date": cal.started,
        "torch": cal.torch_version,
        "threads": cal.threads,
        "clock": cal.clock,
        "seconds": round(cal.seconds, 2),
        "noise": round(cal.noise, 4),
        "launch_overhead_seconds": cal.launch_overhead_seconds,
        "copy_bytes_per_second": cal.bandwidth_bytes_per_second,
        "matmul_tflops": {d: r for d, r in measured.items()},
        "elementwise": {d: rows for d, rows in cal.elementwise.items()},
        "transcendental": dict(cal.transcendental),
        "modules": {k: v for k, v in cal.modules.items() if v},
        "matmul": {d: rows for d, rows in cal.matmul.items() if rows},
        "attention": dict(cal.attention),
        "optimizer": {k: v for k, v in cal.optimizer.items()},
        "source": where,
    }
    if cal.first_touch_bytes_per_second:
        calibrated["first_touch_bytes_per_second"] = cal.first_touch_bytes_per_second
        calibrated["first_touch_threshold_bytes"] = int(cal.first_touch_threshold_bytes or GLIBC_MMAP_THRESHOLD_MAX)
    if cal.skipped:
        calibrated["skipped"] = list(cal.skipped)
    if cal.thread_seconds:  # the thread trial: median step seconds per thread count (the fastest was used)
        calibrated["thread_seconds"] = dict(cal.thread_seconds)
    if cal.thread_recheck:  # the same trial after the measurements (recheck_threads)
        calibrated["thread_recheck"] = dict(cal.thread_recheck)
        calibrated["thread_slowdown"] = round(cal.thread_slowdown, 4)
    if cal.cpu_share:
        calibrated["cpu_share"] = cal.cpu_share
    if cal.compile:  # memplan.timing models compiled steps from this reference (compile_reference)
        c = cal.compile
        calibrated["compile_speedup"] = c["eager_seconds"] / c["compiled_seconds"]
        calibrated["compile_seconds"] = c["compile_seconds"]
        calibrated["compile_reference"] = dict(c)
    if cal.compile_cost:  # memplan.timing.compile_cost: the one-off from the compiled graph's ops
        calibrated["compile_cost"] = dict(cal.compile_cost)
    reader = {"cuda": "nvml", "rocm": "rocm-smi", "mps": "mps", "cpu": "psutil"}[cal.family]
    return {
        "name": name,
        "title": f"{cal.title} (calibrated {when})",
        "family": cal.family,
        "memory_reader": reader,
        "match": [],
        "memory": {"total_bytes": int(cal.memory_total_bytes), "usable_bytes": int(cal.memory_usable_bytes),
                   "bandwidth_bytes_per_second": float(cal.bandwidth_bytes_per_second),
                   "source": f"{where}: {cal.memory_source}; bandwidth = bytes read + written by a large copy"},
        "peak_tflops": {**peak, "source": peak_source or where},
        "native": {**native, "source": where + " (native: the dtype's best matmul reaches half the fp32 rate)"},
        "achievable": {**achievable, "source": where + " (best net forward matmul rate / peak)"},
        "runtime": runtime,
        "calibrated": calibrated,
    }


def _rounded(value, digits: int = 4):
    """Floats to ``digits`` significant digits, recursively (measured rates carry no more)."""
    if isinstance(value, float) and value and math.isfinite(value):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    return value


_INNER_ARRAY = re.compile(r"\[\n((?:[ \t]+[^\[\]\n]*,\n)+)[ \t]*\]")


def profile_toml(data: dict) -> str:
    """A profile as TOML text (tomli_w), with innermost arrays on one line so each table row reads as a row."""
    import tomli_w

    text = tomli_w.dumps(_rounded(data))
    text = _INNER_ARRAY.sub(lambda m: "[" + ", ".join(x.strip().rstrip(",") for x in m.group(1).splitlines()) + "]",
                            text)
    return "# Written by `memplan calibrate`; the schema is documented in memplan/hardware.py.\n" + text


# ---- in a process of its own ---------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    """``python -m trainer.calibrate SECONDS OUT NAME [THREADS [MODULES]]``: calibrate this machine in a fresh process
    (the quick start's calibration: its measurements leave nothing in the training process, and the
    runtime context is measured in a process that has done nothing else but import MODULES, comma-separated:
    those the training process has loaded, ``process_baseline_bytes``) and write the profile TOML to
    OUT as profile NAME. Progress goes to stdout as JSON lines ``{"stage": ..., "done": ...}``; the last line is
    ``{"finished": true, "threads": N, "noise": x, "seconds": s}``."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--compile-cost-worker":  # measure_compile_cost's fresh process: one compile, as JSON
        print(json.dumps(compile_cost_worker(int(args[1]), args[2] if len(args) > 2 else "cpu")), flush=True)
        return
    seconds, out, name = float(args[0]), args[1], args[2]
    threads = int(args[3]) if len(args) > 3 and args[3] else None
    loaded = [m for m in args[4].split(",") if m] if len(args) > 4 else []

    def progress(stage: str, done: float) -> None:
        sys.stdout.write(json.dumps({"stage": stage, "done": done}) + "\n")
        sys.stdout.flush()

    cal = calibrate(seconds, threads=threads, progress=progress, choose_threads=threads is None, share_clock=True,
                    loaded=loaded)
    text = profile_toml(profile_data(cal, name, None))
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    sys.stdout.write(json.dumps({"finished": True, "threads": cal.threads, "noise": cal.noise,
                                 "seconds": cal.seconds}) + "\n")


if __name__ == "__main__":
    main()

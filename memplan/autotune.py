"""Autotune: the fastest training setup that fits a memory budget, chosen from the analytic model alone.

The search space, for one model at one context length on one device:

- micro-batch × gradient accumulation, such that micro_batch · grad_accum · ctx · world_size is
  the global batch the user asked for (every divisor of the per-process sequence count is a
  micro-batch; the accumulation follows);
- checkpointing none | selective | full;
- attention sdpa | eager;
- precision: the device's fast mixed precision (``bf16-mixed`` where ``Device.supports("bf16")``;
  else ``fp16-mixed``, with loss scaling, if the profile says fp16 is native and faster than fp32)
  and its full precision (``tf32`` where native, else ``fp32``) as the fallback that needs no
  autocast weight copies. Pure bf16 is never proposed: it drops the fp32 master weights and
  changes the training, not just its speed;
- optimizer: AdamW with the foreach implementation (``adamw``) or the fused kernel (``adamw-fused``);
- ``torch.compile``, only where the profile's ``[calibrated] compile_speedup`` says it helps (> 1). With
  ``memplan calibrate --compile``'s reference step in the profile, ``memplan.timing`` models each compiled
  setup (the fusible work sped up as calibrated) and its one-off compile time (``memplan.timing.compile_seconds``:
  a fixed part plus seconds per op of the compiled graph, calibrated or the defaults); with ``tokens`` (one epoch)
  the ranking is by epoch time, compile included, so compile is taken only where it pays back its compile
  time over the run; without, by step time, with a note of how many steps it takes to pay back. A profile
  with ``compile_speedup`` alone divides the eager step by it (and adds ``compile_seconds`` if given).
  The memory of a compiled step is its own where ``memplan.memory.compiled`` models it (else the eager one's);
  the run's length is ``tokens`` or ``steps``, and ``CompileChoice`` says why compile was taken or not;
- with ``world_size`` > 1 (that many devices like this one): DDP or FSDP2 over all of them
  (``memplan.memory`` plans each rank's memory; FSDP shards weights, gradients and optimizer state).

The objective: the highest predicted tokens/s whose predicted peak_reserved ≤ budget × (1 − margin).
Ties (equal predicted speed, such as fused and foreach AdamW, whose time terms are the same) go to
the plan without checkpointing, then to less memory. Checkpointing therefore wins only when it is
strictly faster (a larger micro-batch that pays for the recomputation) or the only thing that fits.

Speed: for a fixed (checkpointing, attention, precision, optimizer, compile) the predicted step
time depends on the micro-batch only through kernel launches, which fall as the micro-batch grows,
so the fastest fitting micro-batch of a configuration is its largest fitting one. With accumulation
(grad_accum ≥ 2) every gradient is held from the first micro-batch on and memory grows with the
micro-batch, so the largest fitting one is found by bisection over the divisors; without it
(micro-batch = the whole per-process batch) the gradients appear during the backward only, so
that point is evaluated on its own (it can fit when a smaller, accumulating micro-batch does not).
Launches can also cost nothing (a calibrated rate that is linear in tokens): then micro-batches tie on
speed and the smallest wins on memory, so each configuration's point is the best of all its fitting
micro-batches by the same key ``ranked_fitting`` sorts by (the plan printed is the first one
``--verify`` tries). A configuration costs about ten walks of ``memplan.memory``; the whole search
well under a second.

Nothing here imports torch. ``trainer.verify.verify`` runs the chosen plan for real.
"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass, field

from memplan.errors import InputError
from memplan.estimate import memory_on
from memplan.hardware import Device
from memplan.memory import MemoryBreakdown
from memplan.memory.compiled import compiled_modelled
from memplan.model import ModelSpec
from memplan.plan import Plan
from memplan.setup import CHECKPOINTINGS, PRECISIONS, TrainSetup
from memplan.memory.stacks import MEMPLAN, Stack
from memplan.timing import TimeBreakdown, compile_fusion, compile_seconds, compile_seconds_words, step_time
from memplan.units import format_bytes, format_count, possessive

DEFAULT_MARGIN = 0.1  # share of the budget kept free for what the model does not see
ATTENTIONS = ("sdpa", "eager")
SHARDINGS = ("ddp", "fsdp")  # searched when there is more than one device
OPTIMIZERS = ("adamw-fused", "adamw")  # fused first: it wins the tie with foreach (same time, less memory)
LOSSY_OPTIMIZERS = ("adamw8bit",)  # change the update itself: ranked after every exact plan
TIE_DIGITS = 9  # predicted tokens/s equal to this many significant digits are a tie

# Default global batch in tokens when none is given, by parameter count (a demanding user wants the
# batch recipes use for models of that size, not whatever fits):
# - below 100M: 131,072 tokens, llama2.c's TinyStories recipe (128 sequences × 256 tokens × 4 accumulation
#   steps, "tokens per iteration will be: 131,072", karpathy/llama2.c train.py);
# - 100M to 1B: 524,288 (GPT-3's 0.5M tokens for its 125M-760M models, Brown et al. 2020 Table 2.1;
#   nanoGPT's GPT-2 124M uses 491,520);
# - 1B and up: 1,048,576 (GPT-3's 1M tokens for its 1.3B and 2.7B models, same table).
DEFAULT_GLOBAL_BATCH_TOKENS = ((100_000_000, 131_072), (1_000_000_000, 524_288), (None, 1_048_576))

FSDP_MAX_DEVICES = 1024  # the largest device count the "more devices" advice considers
ADVICE_CTX_STEP = 64  # the shorter-context advice rounds down to a multiple of this


def default_global_batch_tokens(spec: ModelSpec) -> int:
    """The global batch (tokens) used when neither --global-batch-tokens nor --global-batch is given."""
    for below, tokens in DEFAULT_GLOBAL_BATCH_TOKENS:
        if below is None or spec.params < below:
            return tokens
    raise AssertionError("unreachable")


def _accumulates(stack: Stack, base: TrainSetup) -> bool:
    """Whether the stack's walk follows ``base`` with gradient accumulation (``Stack.check_walked`` of two
    micro-batches): not litgpt's FSDP1, whose ``no_sync`` accumulation is not walked."""
    try:
        stack.check_walked(base.replace(grad_accum=2))
    except InputError:
        return False
    return True


def divisors(n: int) -> list[int]:
    """All divisors of n, ascending."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def device_ref(device: Device) -> str:
    """How a plan names its device: the profile name for a bundled profile, else the file it came from."""
    from memplan.hardware import bundled_profile_ref

    if not device.path:
        return device.name
    if device.path == bundled_profile_ref(device.name):
        return device.name
    return str(Path(device.path).resolve())


MIXED_HALF = {"bf16-mixed": "bf16"}  # a mixed precision and the pure one a stack without autocast trains in instead


def _stack_precisions(precisions: tuple[str, ...], stack, device: Device | None = None) -> tuple[str, ...]:
    """The precisions of ``precisions`` the stack's code trains in, else the one-line error naming those it takes.

    ``device`` given (the search's candidates, not a precision asked for): a mixed precision the stack's code has
    no autocast for is replaced by the pure half precision it trains in instead, where the stack takes it and the
    device runs it natively (torchtune's recipes: ``dtype: bf16``, no fp32 master weights)."""
    if device is not None:
        precisions = tuple(dict.fromkeys(
            MIXED_HALF[p] if p not in stack.precisions and MIXED_HALF.get(p) in stack.precisions
            and device.supports(MIXED_HALF[p]) else p for p in precisions))
    kept = tuple(p for p in precisions if p in stack.precisions)
    if not kept:
        raise InputError(f"--stack {stack.name}: --precision {', '.join(precisions)} is not one its code takes "
                         f"(accepted: {', '.join(stack.precisions)})")
    return kept


def precision_candidates(device: Device) -> tuple[str, ...]:
    """The precisions worth trying on ``device``: its fast mixed precision, then its full precision.

    bf16-mixed where bf16 is native; else fp16-mixed (with loss scaling) where fp16 is native and
    the profile rates it faster than fp32; then tf32 where native, else fp32. The GTX 1650 (no
    bf16, fp16 slower than fp32 in PyTorch) gets fp32 alone.
    """
    full = "tf32" if device.supports("tf32") else "fp32"
    if device.supports("bf16"):
        return ("bf16-mixed", full)
    if device.supports("fp16") and device.matmul_flops_per_second("fp16") > device.matmul_flops_per_second(full):
        return ("fp16-mixed", full)
    return (full,)


def compile_speedup(device: Device) -> float | None:
    """The profile's ``[calibrated] compile_speedup`` (eager step time over compiled), if it has one."""
    value = device.calibrated.get("compile_speedup")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InputError(f"profile {device.path or device.name}: calibrated.compile_speedup = {value!r}; "
                         "expected a number > 0 (eager step time / compiled step time)")
    return float(value)


def _pinned(flag: str, value: str, searched: tuple[str, ...], known: tuple[str, ...], stack: Stack) -> tuple[str, ...]:
    """``(value,)`` where the stack's code takes it, else the one-line error naming what it takes."""
    if value not in known:
        raise InputError(f"{flag}: unknown {value!r} (accepted: {', '.join(known)})")
    if value not in searched:
        raise InputError(f"--stack {stack.name}: {flag} {value} is not one that {possessive(stack.name)} code takes "
                         f"(accepted: {', '.join(searched)})")
    return (value,)


def search_axes(stack: Stack, device: Device, world_size: int = 1, lora_rank: int = 0,
                precision: str | None = None, checkpointing: str | None = None,
                sharding: str | None = None) -> dict[str, tuple]:
    """What autotune searches for ``stack`` on ``device``, each axis taken from the stack object's own attributes:

    - sharding: with ``world_size`` > 1, DDP then FSDP where the stack's walk covers them (``Stack.shardings``),
      or ``sharding`` alone (``--sharding``, or the one ``--emit`` can write: ``Writer.emitted_sharding``);
    - precision: ``precision`` alone, else ``precision_candidates(device)`` as the stack trains them
      (``Stack.precisions``; a mixed precision it has no autocast for becomes its pure half precision);
    - checkpointing: ``Stack.checkpointings`` (with LoRA: selective only where ``Stack.lora_with_selective``), or
      ``checkpointing`` alone;
    - attention: ``Stack.attentions``; optimizer: ``Stack.searched_optimizers`` (8-bit on CUDA devices only);
    - compile: where ``Stack.compiles`` (and the profile's speedup says it helps: ``autotune``).

    A value asked for (``precision``, ``checkpointing``, ``sharding``) that the stack's code does not take, or more
    devices than one where its walk has no DDP or FSDP, is the one-line InputError naming what it takes."""
    if world_size > 1:
        shardings = tuple(s for s in SHARDINGS if s in stack.shardings)
        if not shardings:
            raise InputError(f"--stack {stack.name}: --world-size {world_size} needs DDP or FSDP, and the walk of "
                             f"{possessive(stack.name)} step covers one device only (accepted: --world-size 1)")
        if sharding is not None:
            shardings = _pinned("--sharding", sharding, shardings, SHARDINGS, stack)
    elif sharding is not None:
        raise InputError(f"--sharding {sharding}: shards over several devices; add --world-size N (N ≥ 2)")
    else:
        shardings = ("none",)
    checkpointings = tuple(c for c in CHECKPOINTINGS if c in stack.checkpointings)
    if lora_rank and not stack.lora_with_selective:
        checkpointings = tuple(c for c in checkpointings if c != "selective")  # Stack.check_lora_targets
    if checkpointing is not None:
        checkpointings = _pinned("--checkpointing", checkpointing, checkpointings, CHECKPOINTINGS, stack)
    if precision is not None:
        _pinned("--precision", precision, tuple(p for p in PRECISIONS if p in stack.precisions), PRECISIONS, stack)
    precisions = (_stack_precisions((precision,), stack) if precision
                  else _stack_precisions(precision_candidates(device), stack, device))
    optimizers = tuple(o for o in stack.searched_optimizers
                       if o not in LOSSY_OPTIMIZERS or device.family == "cuda")
    return {"sharding": shardings, "precision": precisions, "checkpointing": checkpointings,
            "attention": tuple(a for a in ATTENTIONS if a in stack.attentions),  # litgpt, torchtune: sdpa only
            "optimizer": optimizers}


# ---- results -------------------------------------------------------------------------------

def predicted_json(memory: MemoryBreakdown, time_: TimeBreakdown, step_seconds: float, tokens_per_second: float,
                   epoch_tokens: int | None, one_off_seconds: float = 0.0) -> dict:
    """The ``predicted`` object of ``autotune --json`` (docs/json.md), with peak_allocated and peak_phase. The
    epoch's seconds include ``one_off_seconds`` (torch.compile's compile time)."""
    from memplan.prediction import Prediction

    return Prediction(peak_allocated=memory.peak_allocated, peak_reserved=memory.peak_reserved,
                      peak_phase=memory.peak_phase, step_seconds=step_seconds, tokens_per_second=tokens_per_second,
                      mfu=time_.mfu,
                      epoch_seconds=epoch_tokens / tokens_per_second + one_off_seconds if epoch_tokens else None
                      ).json()


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One evaluated setup: the plan it would be, what was predicted, whether it fits, and why it was not chosen."""

    plan: Plan
    predicted: dict  # peak_reserved, step_seconds, tokens_per_second, epoch_seconds, peak_allocated, peak_phase
    fits: bool  # predicted peak_reserved ≤ budget × (1 − margin)
    why: str  # "chosen: ...", "fits; 12.0% slower ...", "does not fit: ... over ..."

    @property
    def setup(self) -> TrainSetup:
        return self.plan.setup

    @property
    def peak_reserved(self) -> int:
        return self.predicted["peak_reserved"]

    @property
    def tokens_per_second(self) -> float:
        return self.predicted["tokens_per_second"]

    def to_json(self) -> dict:
        return {"plan": self.plan.contract_plan(), "predicted": dict(self.predicted), "fits": self.fits,
                "why": self.why}


@dataclass(frozen=True, kw_only=True)
class ConfigSearch:
    """What the search found for one (checkpointing, attention, precision, optimizer, compile)."""

    setup: TrainSetup  # micro_batch 1 / grad_accum 1 placeholder carrying the configuration
    largest_accumulating: int  # largest micro-batch < the per-process batch that fits with accumulation, 0 if none
    whole_fits: bool  # the whole per-process batch as one micro-batch (no accumulation) fits

    def fitting(self, per: int, ev: "_Evaluator", limit: int) -> list[TrainSetup]:
        """Every micro-batch of this configuration that fits, at ``per`` sequences a process.

        The accumulating micro-batches up to the largest that fits, and the whole batch if it fits
        (memory grows with the micro-batch, so no second search); each walked and checked against
        ``limit``. The search picks its best point from these and ``ranked_fitting`` lists them, so
        the plan printed is the first plan ``--verify`` tries.
        """
        sizes = [m for m in divisors(per) if m < per and m <= self.largest_accumulating]
        if self.whole_fits:
            sizes.append(per)
        setups = [self.setup.replace(micro_batch=m, grad_accum=per // m) for m in sizes]
        return [s for s in setups if ev.peak(s) <= limit]


@dataclass(frozen=True, kw_only=True)
class AutotuneResult:
    """The answer of ``autotune``: the chosen plan (None when nothing fits), the candidates and why."""

    model: ModelSpec
    device: Device
    ctx: int
    world_size: int
    plan: Plan | None  # the fastest plan that fits; None when nothing does
    candidates: list[Candidate]  # the chosen one first, then the best of every other configuration, then rejects
    budget_bytes: int  # the memory budget (default: the device's usable memory)
    margin: float  # share of the budget kept free
    limit_bytes: int  # budget × (1 − margin): what predicted peak_reserved must not exceed
    global_batch_tokens: int  # the global batch searched, in tokens (all processes)
    global_batch_sequences: int  # the same in sequences (all processes)
    requested_global_batch_tokens: int  # what was asked for (or the default), in tokens
    default_global_batch: bool  # no global batch was given; the size-based default was used
    exact_global_batch: bool  # the global batch searched is exactly the one asked for
    advice: list[str] = field(default_factory=list)  # what would fit, when nothing does
    notes: list[str] = field(default_factory=list)  # the global batch's rounding, precision choices, ...
    space: dict = field(default_factory=dict)  # the options searched
    search_seconds: float = 0.0  # wall time of the analytic search
    evaluated: int = 0  # setups whose memory was walked
    tokens: int | None = None  # tokens in one epoch (--tokens, or --max-steps × the global batch), for epoch_seconds
    run_steps: int | None = None  # the run's optimizer steps (--max-steps, or --tokens over the global batch)
    compile: CompileChoice | None = None  # whether torch.compile was taken, and why
    configs: tuple[ConfigSearch, ...] = ()
    _evaluator: "_Evaluator | None" = field(default=None, repr=False, compare=False)

    @property
    def chosen(self) -> Candidate | None:
        return self.candidates[0] if self.plan is not None else None

    @property
    def sequences_per_process(self) -> int:
        return self.global_batch_sequences // self.world_size

    def ranked_fitting(self) -> list[Candidate]:
        """Every fitting (configuration, micro-batch) of the space, in the objective's order (the chosen first).

        ``trainer.verify.verify`` walks this list when a measured plan has to step down. The
        accumulating micro-batches below a configuration's largest fitting one fit too (memory grows
        with the micro-batch), so they are listed without a second search.
        """
        ev = self._evaluator
        if ev is None:
            raise ValueError("ranked_fitting needs the result of autotune() (it keeps the evaluator)")
        per = self.sequences_per_process
        setups = [s for cfg in self.configs for s in cfg.fitting(per, ev, self.limit_bytes)]
        setups.sort(key=ev.rank_key)
        return [Candidate(plan=self.plan_for(s), predicted=ev.predicted(s), fits=True, why="fits") for s in setups]

    def plan_for(self, setup: TrainSetup, predicted: dict | None = None) -> Plan:
        """The Plan of any setup of this search (with its prediction)."""
        if predicted is None:
            predicted = self._evaluator.predicted(setup)
        return Plan(model=self.model, setup=setup, device=device_ref(self.device),
                    budget_bytes=self.budget_bytes, predicted=_plan_predicted(predicted))

    def to_json(self, verified=None) -> dict:
        """The JSON of ``memplan autotune`` (docs/json.md): the original keys, then the additions.

        ``verified`` is the ``trainer.verify.Verification`` of ``--verify`` (None without it). After a
        verification the top-level plan and prediction are those of the plan it settled on (null if
        no plan's measured peak fit the budget).
        """
        plan, predicted = self.plan, self.chosen.predicted if self.chosen else None
        if verified is not None:
            plan = verified.plan
            predicted = {"epoch_seconds": None, **plan.predicted} if plan is not None else None
        return {
            "plan": plan.contract_plan() if plan is not None else None,
            "predicted": _contract_predicted(predicted) if predicted is not None else None,
            "budget_bytes": self.budget_bytes,
            "candidates": [c.to_json() for c in self.candidates],
            "verified": verified.to_json() if verified is not None else None,
            # additions
            "margin": self.margin,
            "limit_bytes": self.limit_bytes,
            "model": self.model.to_json(),
            "device": self.device.to_json(),
            "world_size": self.world_size,
            "global_batch": {"tokens": self.global_batch_tokens, "sequences": self.global_batch_sequences,
                             "requested_tokens": self.requested_global_batch_tokens,
                             "default": self.default_global_batch},
            "exact_global_batch": self.exact_global_batch,
            "advice": list(self.advice),
            "notes": list(self.notes),
            "space": dict(self.space),
            "search_seconds": self.search_seconds,
            "evaluated": self.evaluated,
            "run_steps": self.run_steps,
            "compile": self.compile.to_json() if self.compile is not None else None,
        }


def _contract_predicted(predicted: dict) -> dict:
    keys = ("peak_reserved", "step_seconds", "tokens_per_second", "epoch_seconds", "peak_allocated", "peak_phase")
    return {k: predicted.get(k) for k in keys if k in predicted or k == "epoch_seconds"}


def _plan_predicted(predicted: dict) -> dict:
    """What a Plan stores of a prediction (TOML has no null: epoch_seconds only when known)."""
    return {k: v for k, v in predicted.items() if v is not None}


def _sig(x: float) -> float:
    """x rounded to TIE_DIGITS significant digits: predicted speeds equal to that precision tie."""
    return float(f"{x:.{TIE_DIGITS}g}")


# ---- the search ----------------------------------------------------------------------------

class _Evaluator:
    """Memory walks and step times of setups, each computed once.

    A compiled step's memory is its own where ``memplan.memory.compiled`` models it (inductor's partitioner
    saves less, which can let a larger micro-batch fit); elsewhere it is planned with the eager step's, and
    the walks are shared between the two (not on a CPU, whose process also holds the compiled code:
    ``compiled_code_resident_bytes``).
    """

    def __init__(self, spec: ModelSpec, device: Device, speedup: float | None, epoch_tokens: int | None,
                 stack: Stack = MEMPLAN):
        self.spec, self.device, self.speedup, self.epoch_tokens = spec, device, speedup, epoch_tokens
        self.stack = stack  # whose code runs the step: the walk's hooks (memplan.memory.stacks)
        self.models_compile = compile_fusion(device) is not None  # timing models compiled steps itself
        self._memory: dict[TrainSetup, MemoryBreakdown] = {}
        self._time: dict[TrainSetup, TimeBreakdown] = {}

    @property
    def walks(self) -> int:
        return len(self._memory)

    def memory(self, setup: TrainSetup) -> MemoryBreakdown:
        modelled = setup.compile and compiled_modelled(self.spec, setup, self.stack) is None
        # unmodelled, the compiled step's walk is the eager one's; a CPU process also holds the compiled code
        shared = setup.compile and not modelled and self.device.family != "cpu"
        key = setup.replace(compile=False) if shared else setup
        if key not in self._memory:
            self._memory[key] = memory_on(self.spec, key, self.device, self.stack)
        return self._memory[key]

    def time(self, setup: TrainSetup) -> TimeBreakdown:
        key = setup.replace(compile=False) if setup.compile and not self.models_compile else setup
        if key not in self._time:
            self._time[key] = step_time(self.spec, key, self.device)
        return self._time[key]

    def seconds(self, setup: TrainSetup) -> float:
        """Predicted step seconds; a compiled step as memplan.timing models it from the calibrated reference,
        else the eager one over the profile's compile speedup."""
        seconds = self.time(setup).step_seconds
        if setup.compile and not self.models_compile and self.speedup:
            return seconds / self.speedup
        return seconds

    def one_off(self, setup: TrainSetup) -> float:
        """Seconds spent once per run before the steps: torch.compile's compile time (0 for an eager step),
        from the compiled graph's ops (``memplan.timing.compile_seconds``)."""
        return compile_seconds(self.spec, self.device, setup) if setup.compile else 0.0

    def tokens_per_second(self, setup: TrainSetup) -> float:
        """Steady-state tokens per second (the step's)."""
        return setup.tokens_per_step / self.seconds(setup)

    def rate(self, setup: TrainSetup) -> float:
        """What the search maximises: tokens per second over the epoch (``tokens``) with the one-offs in, else
        the steady-state rate."""
        if not self.epoch_tokens:
            return self.tokens_per_second(setup)
        return self.epoch_tokens / (self.epoch_tokens / self.tokens_per_second(setup) + self.one_off(setup))

    def peak(self, setup: TrainSetup) -> int:
        return self.memory(setup).peak_reserved

    def rank_key(self, s: TrainSetup) -> tuple:
        """The objective's order: exact AdamW before 8-bit (which changes the training, so is taken only where
        nothing exact fits), then fastest first; on a tie, no checkpointing, then less memory."""
        return (s.optimizer in LOSSY_OPTIMIZERS, -_sig(self.rate(s)), s.checkpointing != "none", self.peak(s),
                s.attention != "sdpa",
                s.optimizer != "adamw-fused", s.precision, s.compile)

    def predicted(self, setup: TrainSetup) -> dict:
        return predicted_json(self.memory(setup), self.time(setup), self.seconds(setup),
                              self.tokens_per_second(setup), self.epoch_tokens, self.one_off(setup))


def _global_batch(spec: ModelSpec, ctx: int, world_size: int, global_batch_tokens: int | None,
                  global_batch: int | None) -> tuple[int, int, bool, bool, list[str]]:
    """(sequences per process, requested tokens, default used, exact, notes) for the global batch asked."""
    notes = []
    default = global_batch_tokens is None and global_batch is None
    if global_batch is not None:
        requested_tokens = global_batch * ctx
        per, exact = divmod(global_batch, world_size)
        if exact:  # remainder: round to the nearest multiple of the world size
            per = max(1, round(global_batch / world_size))
            notes.append(f"global batch: {global_batch} sequences do not split evenly over {world_size} processes; "
                         f"searching {per * world_size} ({per} per process)")
        return per, requested_tokens, default, exact == 0, notes
    requested_tokens = default_global_batch_tokens(spec) if default else global_batch_tokens
    unit = ctx * world_size
    per = max(1, round(requested_tokens / unit))
    exact = per * unit == requested_tokens
    if default:
        notes.append(f"global batch: {format_count(per * unit)} tokens ({per * world_size} sequences of {ctx}), "
                     f"the default for a model of {format_count(spec.params)} parameters; "
                     "pass --global-batch-tokens or --global-batch to choose another")
    elif not exact:
        got = per * unit
        change = (got - requested_tokens) / requested_tokens
        notes.append(f"global batch: {requested_tokens:,} tokens is not a multiple of ctx × world size ({unit:,}); "
                     f"searching {per * world_size} sequences = {got:,} tokens ({change:+.2%})")
    return per, requested_tokens, default, exact, notes


def _validate(spec: ModelSpec, ctx: int, global_batch_tokens, global_batch, budget_bytes, margin, tokens,
              world_size, steps=None) -> None:
    for name, value in (("--ctx", ctx), ("--world-size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{name}: {value!r} must be a positive integer")
    if global_batch_tokens is not None and global_batch is not None:
        raise InputError("give --global-batch-tokens N or --global-batch N (sequences), not both")
    if tokens is not None and steps is not None:
        raise InputError("give the run's length as --tokens N or --max-steps N (optimizer steps), not both")
    for name, value in (("--global-batch-tokens", global_batch_tokens), ("--global-batch", global_batch),
                        ("--budget", budget_bytes), ("--tokens", tokens), ("--max-steps", steps)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"{name}: {value!r} must be a positive integer")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise InputError(f"--margin: {margin!r} must be a fraction of the budget in [0, 1), such as 0.1")
    spec.check_context(ctx)


def autotune(spec: ModelSpec, device: Device, *, ctx: int, global_batch_tokens: int | None = None,
             global_batch: int | None = None, budget_bytes: int | None = None, margin: float = DEFAULT_MARGIN,
             tokens: int | None = None, world_size: int = 1, lora_rank: int = 0,
             lora_targets: str = "qkv,proj,up,down", precision: str | None = None,
             checkpointing: str | None = None, stack: Stack = MEMPLAN, steps: int | None = None,
             sharding: str | None = None) -> AutotuneResult:
    """The fastest setup whose predicted peak_reserved fits budget × (1 − margin), at the global batch asked.

    ``lora_rank`` > 0 plans a LoRA finetune (frozen weights, adapters on ``lora_targets``).
    ``precision``, if given, is the only precision tried (a finetune keeps its base run's); else
    ``precision_candidates(device)``; ``checkpointing`` and ``sharding``, if given, likewise. ``stack``: whose code runs the step
    (``memplan.memory.stacks``): the axes are the stack's own (``search_axes``), every candidate is one its
    checks accept, its memory is walked with its hooks, and the advice when nothing fits is walked on it too.

    ``global_batch_tokens`` or ``global_batch`` (sequences, all processes) fixes micro_batch ·
    grad_accum · ctx · world_size; with neither, ``default_global_batch_tokens(spec)``. ``budget_bytes``
    defaults to the device's usable memory. ``tokens`` (one epoch) gives epoch_seconds; ``steps`` (optimizer
    steps, instead of ``tokens``) is a run of ``steps`` global batches. Either is the run's length that
    torch.compile's one-off compile time is weighed against (``CompileChoice``).
    """
    started = time.perf_counter()
    _validate(spec, ctx, global_batch_tokens, global_batch, budget_bytes, margin, tokens, world_size, steps)
    budget = device.usable_bytes if budget_bytes is None else budget_bytes
    limit = int(budget * (1 - margin))
    per, requested, default, exact, notes = _global_batch(spec, ctx, world_size, global_batch_tokens, global_batch)
    if budget_bytes is not None and budget_bytes > device.usable_bytes:
        notes.append(f"--budget {format_bytes(budget_bytes)} is more than {device.name}'s usable memory "
                     f"({format_bytes(device.usable_bytes)}); planning for the budget as given")

    step_tokens = per * world_size * ctx
    if steps is not None:
        tokens = steps * step_tokens
    run_steps = math.ceil(tokens / step_tokens) if tokens else None
    speedup = compile_speedup(device)
    compiles, not_considered = _compile_axis(speedup, stack)
    if not_considered:
        notes.append(not_considered)
    ev = _Evaluator(spec, device, speedup, tokens, stack)
    axes = search_axes(stack, device, world_size, lora_rank, precision, checkpointing, sharding)
    shardings, precisions = axes["sharding"], axes["precision"]
    checkpointings, attentions, optimizers = axes["checkpointing"], axes["attention"], axes["optimizer"]
    sizes = divisors(per)
    accumulating = sizes[:-1]  # micro-batches that leave grad_accum ≥ 2

    configs: list[ConfigSearch] = []
    best_points: list[TrainSetup] = []  # the fastest fitting micro-batch of each configuration
    rejected_points: list[TrainSetup] = []  # the next micro-batch up, which does not fit
    refused: InputError | None = None  # the first configuration the stack's checks refuse
    for sharding, precision, checkpointing, attention, optimizer, compiled in itertools.product(
            shardings, precisions, checkpointings, attentions, optimizers, compiles):
        if sharding == "fsdp" and optimizer in LOSSY_OPTIMIZERS:
            continue  # bitsandbytes' 8-bit states do not run under FSDP2 (TrainSetup refuses it)
        base = TrainSetup(ctx=ctx, micro_batch=1, grad_accum=1, precision=precision,
                          attention=attention, checkpointing=checkpointing, optimizer=optimizer,
                          world_size=world_size, sharding=sharding, compile=compiled,
                          lora_rank=lora_rank, lora_targets=lora_targets)
        try:  # only setups the stack's code runs (its LoRA targets, its families, ...)
            stack.check_walked(base)
            stack.check_lora_targets(spec, base)
            stack.check_setup(spec, base)
        except InputError as error:
            refused = refused or error
            continue
        steps_in = accumulating if _accumulates(stack, base) else []  # litgpt's FSDP1: one micro-batch only

        def at(m: int, base=base) -> TrainSetup:
            return base.replace(micro_batch=m, grad_accum=per // m)

        # bisection over the accumulating micro-batches: memory grows with the micro-batch
        lo, hi = -1, len(steps_in)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ev.peak(at(steps_in[mid])) <= limit:
                lo = mid
            else:
                hi = mid
        largest = steps_in[lo] if lo >= 0 else 0
        whole_fits = ev.peak(at(per)) <= limit
        config = ConfigSearch(setup=base, largest_accumulating=largest, whole_fits=whole_fits)
        configs.append(config)
        fitting = config.fitting(per, ev, limit)
        if fitting:  # the configuration's best by the one objective (a smaller micro-batch wins a tie on speed)
            best_points.append(min(fitting, key=ev.rank_key))
        if not whole_fits:  # the first micro-batch that does not fit
            rejected_points.append(at(steps_in[hi]) if hi < len(steps_in) else at(per))

    if not configs and refused is not None:  # the stack runs none of them: the first reason, in one line
        raise refused
    best_points.sort(key=ev.rank_key)
    rejected_points.sort(key=lambda s: (-ev.tokens_per_second(s), ev.peak(s)))
    result_kw = dict(model=spec, device=device, ctx=ctx, world_size=world_size, budget_bytes=budget, margin=margin,
                     limit_bytes=limit, global_batch_tokens=per * world_size * ctx,
                     global_batch_sequences=per * world_size, requested_global_batch_tokens=requested,
                     default_global_batch=default, exact_global_batch=exact, tokens=tokens,
                     configs=tuple(configs), _evaluator=ev,
                     space={"micro_batch": sizes, "checkpointing": list(checkpointings), "attention": list(attentions),
                            "precision": list(precisions), "optimizer": list(optimizers),
                            "compile": list(compiles), "sharding": list(shardings)})

    def plan_of(s: TrainSetup) -> Plan:
        return Plan(model=spec, setup=s, device=device_ref(device), budget_bytes=budget,
                    predicted=_plan_predicted(ev.predicted(s)))

    candidates: list[Candidate] = []
    advice: list[str] = []
    chosen = best_points[0] if best_points else None
    if not_considered:
        choice = CompileChoice(False, False, not_considered, run_steps=run_steps)
    elif chosen is None:
        choice = CompileChoice(True, False, "torch.compile not taken: nothing fits the budget", run_steps=run_steps)
    else:
        choice = compile_choice(best_points, ev, run_steps)
        notes.append(choice.why)
    if chosen is not None:
        best_tps, best_peak = ev.tokens_per_second(chosen), ev.peak(chosen)
        candidates.append(Candidate(plan=plan_of(chosen), predicted=ev.predicted(chosen), fits=True,
                                    why=_chosen_why(chosen, best_points, ev)))
        for s in best_points[1:]:
            candidates.append(Candidate(plan=plan_of(s), predicted=ev.predicted(s), fits=True,
                                        why=_slower_why(s, ev, best_tps, best_peak)))
    else:
        best_tps = None
        advice = _advice(spec, device, ctx, per, world_size, budget, budget_bytes is not None, margin, limit,
                         precisions, ev, axes)
    for s in rejected_points:
        candidates.append(Candidate(plan=plan_of(s), predicted=ev.predicted(s), fits=False,
                                    why=_reject_why(s, ev, limit, budget, margin, best_tps)))
    return AutotuneResult(plan=candidates[0].plan if chosen is not None else None, candidates=candidates,
                          advice=advice, notes=notes, search_seconds=time.perf_counter() - started,
                          evaluated=ev.walks, run_steps=run_steps, compile=choice, **result_kw)


# ---- why -----------------------------------------------------------------------------------

def _compile_axis(speedup: float | None, stack: Stack) -> tuple[tuple[bool, ...], str | None]:
    """(the compile values searched, why compile is not considered, None where it is)."""
    if speedup is None:
        return (False,), "torch.compile not considered: the profile has no [calibrated] compile_speedup"
    if speedup <= 1:
        return (False,), f"torch.compile not considered: the profile's compile_speedup is {speedup:g} (no gain)"
    if not stack.compiles:
        return (False,), (f"torch.compile not considered: its memory is planned for memplan's own model only, not "
                          f"{possessive(stack.name)} step")
    return (False, True), None


@dataclass(frozen=True)
class CompileChoice:
    """Why torch.compile was taken or not: the best compiled and the best eager plan that fit, compared on the run.

    The two can differ in micro-batch (the compiled step's memory is its own, ``memplan.memory.compiled``, so a
    larger one can fit). The compiled plan pays back its one-off compile time after ``payback_steps`` steps
    (``ceil(compile_seconds / (eager step − compiled step))``); with a run length (``--tokens``, ``--max-steps``)
    it is taken when the run's steps reach that (the search ranks by run time, compile included), without one by
    step time alone."""

    considered: bool  # the search tried compiled setups
    taken: bool  # the chosen plan is compiled
    why: str  # the sentence the plan prints and the JSON carries
    compile_seconds: float | None = None  # the one-off (memplan.timing.compile_seconds) of the best compiled plan
    compile_words: str | None = None  # how that figure was made (F + ops × c, calibrated or the defaults)
    eager_step_seconds: float | None = None  # the best eager plan's step
    compiled_step_seconds: float | None = None  # the best compiled plan's step
    eager_micro_batch: int | None = None
    compiled_micro_batch: int | None = None
    peak_lower_bytes: int | None = None  # how much lower the compiled plan's peak_reserved is (negative: higher)
    payback_steps: int | None = None  # steps after which the compile is paid back; None: never (no faster step)
    run_steps: int | None = None  # the run's optimizer steps (--tokens / --max-steps), None: not given

    def to_json(self) -> dict:
        return dict(self.__dict__)


def compile_choice(best_points: list[TrainSetup], ev: _Evaluator, run_steps: int | None) -> CompileChoice:
    """The CompileChoice of a search whose configurations' best fitting points are ``best_points`` (in the
    objective's order, the chosen first)."""
    eager = next((s for s in best_points if not s.compile), None)
    compiled = next((s for s in best_points if s.compile), None)
    taken = bool(best_points) and best_points[0].compile
    if compiled is None:
        return CompileChoice(True, False, "torch.compile not taken: no compiled plan fits the budget",
                             run_steps=run_steps)
    one_off = ev.one_off(compiled)
    figures = dict(compile_seconds=one_off, compile_words=compile_seconds_words(ev.spec, ev.device, compiled),
                   compiled_step_seconds=ev.seconds(compiled), compiled_micro_batch=compiled.micro_batch,
                   run_steps=run_steps)
    if eager is None:
        return CompileChoice(True, True, f"torch.compile taken: only a compiled plan fits the budget (its "
                             f"micro-batch {compiled.micro_batch}); its {one_off:.0f} s compile is spent once",
                             **figures)
    saved = ev.seconds(eager) - ev.seconds(compiled)
    lower = ev.peak(eager) - ev.peak(compiled)
    figures.update(eager_step_seconds=ev.seconds(eager), eager_micro_batch=eager.micro_batch, peak_lower_bytes=lower)
    memory = ""
    if compiled.micro_batch > eager.micro_batch:
        memory = (f"; the compiled step's memory fits micro-batch {compiled.micro_batch} where the eager step's fits "
                  f"{eager.micro_batch}")
    elif lower:  # the same micro-batch: inductor's partitioner saves less; a CPU process holds inductor's code
        memory = f"; its peak {format_bytes(abs(lower))} {'lower' if lower > 0 else 'higher'}"
    head = "torch.compile taken" if taken else "torch.compile not taken"
    if saved <= 0:
        gain = ev.seconds(compiled) / ev.seconds(eager) - 1
        return CompileChoice(True, taken, f"{head}: its step is predicted {gain:.1%} slower than the eager plan's"
                             + memory, **figures)
    payback = math.ceil(one_off / saved) if one_off else 0
    speed = f"steps {ev.seconds(eager) / ev.seconds(compiled) - 1:.1%} faster"
    cost = f"{one_off:.0f} s compile ({figures['compile_words']})"
    if run_steps is None:
        why = (f"{head}: {speed}; compile pays back its {cost} after {payback:,} steps"
               + ("; no --tokens or --max-steps to weigh it against the run's length" if taken else ""))
    elif taken:
        why = f"{head}: {speed}; compile pays back its {cost} after {payback:,} steps; the run is {run_steps:,} steps"
    else:
        why = (f"{head}: the {cost} is not paid back within the run's {run_steps:,} steps ({speed}, it takes "
               f"{payback:,})")
    return CompileChoice(True, taken, why + memory, payback_steps=payback, **figures)


def _describe(s: TrainSetup) -> str:
    parts = [f"micro-batch {s.micro_batch} × {s.grad_accum}", f"checkpointing {s.checkpointing}", s.attention,
             s.precision, s.optimizer]
    if s.world_size > 1:
        parts.append(f"{s.sharding} over {s.world_size} devices")
    if s.compile:
        parts.append("compiled")
    return ", ".join(parts)


def _chosen_why(chosen: TrainSetup, best_points: list[TrainSetup], ev: _Evaluator) -> str:
    why = "chosen: the fastest predicted plan that fits"
    if chosen.checkpointing != "none":
        plain = [s for s in best_points if s.checkpointing == "none"]
        if plain:
            gain = ev.tokens_per_second(chosen) / ev.tokens_per_second(plain[0]) - 1
            why += (f"; checkpointing {chosen.checkpointing} buys micro-batch {chosen.micro_batch} over "
                    f"{plain[0].micro_batch} without it, {gain:.1%} faster")
        else:
            why += f"; checkpointing {chosen.checkpointing} is needed to fit"
    if chosen.sharding == "fsdp" and not any(s.sharding == "ddp" for s in best_points):
        why += "; FSDP is needed to fit (DDP keeps the whole model, its gradients and optimizer state on every device)"
    return why


def _slower_why(s: TrainSetup, ev: _Evaluator, best_tps: float, best_peak: int) -> str:
    tps = ev.tokens_per_second(s)
    if _sig(tps) == _sig(best_tps):
        if s.checkpointing != "none" and ev.peak(s) < best_peak:
            return "fits; as fast as the chosen plan, but checkpointing is chosen only when it is faster or needed"
        if ev.peak(s) == best_peak:
            return "fits; a tie with the chosen plan in speed and peak memory (ties go to fused AdamW and SDPA)"
        return f"fits; as fast as the chosen plan but needs {format_bytes(ev.peak(s) - best_peak)} more"
    return f"fits; {1 - tps / best_tps:.1%} slower than the chosen plan ({tps:,.0f} vs {best_tps:,.0f} tokens/s)"


def _reject_why(s: TrainSetup, ev: _Evaluator, limit: int, budget: int, margin: float,
                best_tps: float | None) -> str:
    peak = ev.peak(s)
    why = (f"does not fit: needs {format_bytes(peak)}, {format_bytes(peak - limit)} over the limit of "
           f"{format_bytes(limit)} (budget {format_bytes(budget)} less {margin:.0%})")
    if best_tps:
        tps = ev.tokens_per_second(s)
        change = tps / best_tps - 1
        why += f"; would be {abs(change):.1%} {'faster' if change > 0 else 'slower'} than the chosen plan"
    return why


# ---- advice when nothing fits --------------------------------------------------------------

def _lightest(spec: ModelSpec, device: Device, ctx: int, per: int, world_size: int, precisions,
              memory: Callable[[TrainSetup], MemoryBreakdown] | None = None,
              checkpointings=CHECKPOINTINGS, attentions=ATTENTIONS,
              optimizers=OPTIMIZERS, shardings=None, stack: Stack = MEMPLAN) -> tuple[TrainSetup, MemoryBreakdown]:
    """The setup with the least predicted memory: micro-batch 1 (accumulating the rest), and of the
    configurations the one whose walk is lowest (usually full checkpointing, SDPA, fused AdamW); walked on
    ``stack`` where no ``memory`` is given."""
    best = None
    if shardings is None:
        shardings = SHARDINGS if world_size > 1 else ("none",)
    for sharding, precision, checkpointing, attention, optimizer in itertools.product(
            shardings, precisions, checkpointings, attentions, optimizers):
        if sharding == "fsdp" and optimizer in LOSSY_OPTIMIZERS:
            continue
        s = TrainSetup(ctx=ctx, micro_batch=1, grad_accum=per, precision=precision, attention=attention,
                       checkpointing=checkpointing, optimizer=optimizer, world_size=world_size, sharding=sharding)
        mem = memory(s) if memory is not None else memory_on(spec, s, device, stack)
        if best is None or mem.peak_reserved < best[1].peak_reserved:
            best = (s, mem)
    return best


def _advice(spec: ModelSpec, device: Device, ctx: int, per: int, world_size: int, budget: int, budget_given: bool,
            margin: float, limit: int, precisions, ev: _Evaluator, axes: dict | None = None) -> list[str]:
    """What would fit when nothing does: more devices (first, and said to be the only way when neither a
    shorter context nor fewer layers fit), a shorter context, a smaller model, more memory. Every alternative is
    walked on the search's stack (``ev.stack``) over the axes it searched (``axes``: ``search_axes``), so only
    setups that stack's code takes are offered."""
    stack = ev.stack
    axes = axes or search_axes(stack, device, world_size, precision=precisions[0] if len(precisions) == 1 else None)
    kinds = dict(checkpointings=axes["checkpointing"], attentions=axes["attention"], optimizers=axes["optimizer"])
    lightest, mem = _lightest(spec, device, ctx, per, world_size, precisions, ev.memory, shardings=axes["sharding"],
                              **kinds)
    light = (f"the lightest plan (micro-batch 1, checkpointing {lightest.checkpointing}, {lightest.attention}, "
             f"{lightest.precision}, {lightest.optimizer}) needs {format_bytes(mem.peak_reserved)}, "
             f"{format_bytes(mem.peak_reserved - limit)} over the limit of {format_bytes(limit)}")
    advice = [f"nothing fits: {light}"]

    def fits_with(s: TrainSetup, model: ModelSpec = spec) -> int:
        return memory_on(model, s, device, stack).peak_reserved

    # a shorter context (same global batch in sequences is meaningless across contexts: micro-batch 1)
    step = ADVICE_CTX_STEP if ctx > ADVICE_CTX_STEP else 1
    lo, hi = 0, (ctx - 1) // step  # in units of step
    while hi > lo:
        mid = (lo + hi + 1) // 2
        if fits_with(lightest.replace(ctx=mid * step)) <= limit:
            lo = mid
        else:
            hi = mid - 1
    if lo > 0:
        short = lo * step
        advice.append(f"a shorter context: --ctx {short} fits "
                      f"({format_bytes(fits_with(lightest.replace(ctx=short)))} with the lightest plan)")
    else:
        advice.append("a shorter context does not help enough: even a few tokens per sequence do not fit")

    # a smaller model: the same shape with fewer layers
    if spec.layers > 1:
        lo, hi = 0, spec.layers - 1
        while hi > lo:
            mid = (lo + hi + 1) // 2
            if fits_with(lightest, spec.replace(layers=mid)) <= limit:
                lo = mid
            else:
                hi = mid - 1
        if lo > 0:
            small = spec.replace(layers=lo)
            advice.append(f"a smaller model: the same shape with {lo} of its {spec.layers} layers "
                          f"({format_count(small.params)} parameters, --layers {lo}) fits "
                          f"({format_bytes(fits_with(lightest, small))})")
        else:
            one = spec.replace(layers=1)
            advice.append(f"a smaller model: even 1 layer of this width does not fit "
                          f"({format_bytes(fits_with(lightest, one))}); a narrower model or a smaller vocabulary "
                          f"({spec.vocab:,} × {spec.hidden:,} embedding) is needed")

    # more memory: a larger --budget, or a bundled device that fits the lightest plan
    need_budget = math.ceil(mem.peak_reserved / (1 - margin))
    if budget_given and budget < device.usable_bytes:
        advice.append(f"more memory: a --budget of at least {format_bytes(need_budget)} "
                      f"({device.name} has {format_bytes(device.usable_bytes)} usable)")
    advice.append(_bigger_devices(spec, device, ctx, per, world_size, margin, need_budget, stack, axes))

    # more devices: FSDP over k devices like this one, planned rank by rank (memplan.memory's FSDP walk)
    advice.insert(1, _more_devices(spec, device, ctx, per * world_size, world_size, precisions, limit,
                                   only=not any(a.startswith(("a shorter context:", "a smaller model: the same"))
                                                for a in advice), stack=stack, kinds=kinds))
    return advice


def fsdp_devices_needed(spec: ModelSpec, device: Device, ctx: int, global_sequences: int, precisions,
                        limit: int, start: int = 2, stack: Stack = MEMPLAN,
                        kinds: dict | None = None) -> tuple[int | None, TrainSetup, MemoryBreakdown]:
    """The fewest devices like ``device`` (from ``start`` up to FSDP_MAX_DEVICES) over which FSDP's
    lightest plan (micro-batch 1, the lightest checkpointing, attention, precision and optimizer)
    fits ``limit`` per device: (k or None, that plan, its memory). Per-device memory falls as k
    grows (the sharded state shrinks; the gathered layers and the activations stay), so k is
    found by bisection. ``stack``: whose step is walked; ``kinds``: its checkpointings, attentions and
    optimizers (``_lightest``'s keywords; memplan's own by default)."""
    def lightest(k: int) -> tuple[TrainSetup, MemoryBreakdown]:
        per = max(1, round(global_sequences / k))
        return _lightest(spec, device, ctx, per, k, precisions, shardings=("fsdp",), stack=stack, **(kinds or {}))

    top = lightest(FSDP_MAX_DEVICES)
    if top[1].peak_reserved > limit:
        return None, *top
    lo, hi = start - 1, FSDP_MAX_DEVICES  # fits(hi); not known for lo
    found = top
    while hi - lo > 1:
        mid = (lo + hi) // 2
        attempt = lightest(mid)
        if attempt[1].peak_reserved <= limit:
            hi, found = mid, attempt
        else:
            lo = mid
    return hi, *found


def walks_fsdp(stack: Stack) -> bool:
    """Whether the walk of ``stack``'s step covers FSDP for the plans autotune makes (no LoRA): ``Stack.shardings``
    has it and ``Stack.check_walked`` takes it (litgpt's FSDP2 is finetune_lora's, LoRA only)."""
    if "fsdp" not in stack.shardings:
        return False
    try:
        stack.check_walked(TrainSetup(ctx=1, micro_batch=1, world_size=2, sharding="fsdp"))
    except InputError:
        return False
    return True


def _more_devices(spec: ModelSpec, device: Device, ctx: int, global_sequences: int, world_size: int, precisions,
                  limit: int, only: bool, stack: Stack = MEMPLAN, kinds: dict | None = None) -> str:
    """The advice on more devices: how many, with FSDP, make the lightest plan fit per device; where the walk of
    ``stack`` has no FSDP, that more devices do not lower the memory per device."""
    if not walks_fsdp(stack):
        return (f"more devices do not help with --stack {stack.name}: the walk of {possessive(stack.name)} step "
                f"covers sharding {', '.join(s for s in stack.shardings if s != 'fsdp')}, and no FSDP for this plan "
                "to shard the weights, gradients and optimizer state (DDP keeps them whole on every device)")
    k, setup, mem = fsdp_devices_needed(spec, device, ctx, global_sequences, precisions, limit,
                                        start=max(2, world_size + 1), stack=stack, kinds=kinds)
    if k is None:
        return (f"more devices do not help at this context: FSDP over {FSDP_MAX_DEVICES} devices like this one "
                f"still needs {format_bytes(mem.peak_reserved)} per device (activations and the gathered layers "
                "are not sharded)")
    head = ("more devices: on devices like this one, more of them are the only way to fit this model at this "
            "context" if only else "more devices")
    return (f"{head}: FSDP over {k} devices like this one (--world-size {k} --sharding fsdp) fits, "
            f"{format_bytes(mem.peak_reserved)} per device with checkpointing {setup.checkpointing}, "
            f"{setup.attention}, {setup.precision}, micro-batch 1 (DDP does not reduce memory per device)")


def _bigger_devices(spec: ModelSpec, device: Device, ctx: int, per: int, world_size: int, margin: float,
                    need_budget: int, stack: Stack = MEMPLAN, axes: dict | None = None) -> str:
    """The bundled profiles on which the lightest plan of the space fits, smallest first, walked on ``stack``
    over its ``axes`` (``search_axes``: its most recomputing checkpointing, its first attention and optimizer)."""
    from memplan.hardware import all_profiles

    axes = axes or search_axes(stack, device, world_size)
    fitting = []
    for other in all_profiles():
        if other.family == "cpu" or other.name == device.name:
            continue
        try:
            precisions = _stack_precisions(precision_candidates(other), stack, other)
        except InputError:  # the stack trains in no precision this device runs
            continue
        lightest, mem = _lightest(spec, other, ctx, per, world_size, precisions,
                                  checkpointings=axes["checkpointing"][-1:], attentions=axes["attention"][:1],
                                  optimizers=axes["optimizer"][:1], shardings=axes["sharding"], stack=stack)
        if mem.peak_reserved <= other.usable_bytes * (1 - margin):
            fitting.append(other)
    fitting.sort(key=lambda d: d.usable_bytes)
    head = f"a device with more memory: at least {format_bytes(need_budget)} usable"
    if not fitting:
        return head + "; none of the bundled profiles has that much"
    names = ", ".join(f"{d.name} ({format_bytes(d.usable_bytes)})" for d in fitting[:4])
    return head + f"; of the bundled profiles: {names}" + (" and larger" if len(fitting) > 4 else "")

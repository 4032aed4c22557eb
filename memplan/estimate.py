"""The estimate: memory and time of a (ModelSpec, TrainSetup) on a Device, and the largest micro-batch that fits."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.hardware import Device
from memplan.memory import COLLECTIVES_OF_FAMILY, MemoryBreakdown, peak_memory, sdpa_gqa_repeats
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.memory.stacks import MEMPLAN, Stack, walked_for
from memplan.timing import TimeBreakdown, step_time

MAX_MICRO_BATCH = 1 << 20  # search bound for max_micro_batch


@dataclass(frozen=True)
class Estimate:
    model: ModelSpec
    setup: TrainSetup
    device: Device
    memory: MemoryBreakdown
    time: TimeBreakdown
    fits: bool  # peak_reserved ≤ the device's usable memory
    max_micro_batch: int  # largest micro-batch that fits with the rest held, 0 if none
    tokens: int | None = None  # tokens in one epoch, if given
    stack: Stack = MEMPLAN  # whose training code the memory walk follows (memplan.memory.stacks)

    def to_json(self) -> dict:
        """The JSON of ``memplan estimate`` (its keys are documented in docs/json.md)."""
        return {
            "model": self.model.to_json(),
            "setup": self.setup.to_json(),
            "device": self.device.to_json(),
            "memory": {**self.memory.to_json(), "runtime_terms": dict(self.memory.runtime_terms)},
            "fits": self.fits,
            "max_micro_batch": self.max_micro_batch,
            "time": self.time.to_json(),
            "stack": self.stack.name,
        }


def memory_on(spec: ModelSpec, setup: TrainSetup, device: Device, stack: Stack = MEMPLAN) -> MemoryBreakdown:
    """peak_memory with the device family's runtime context, allocator reserve, attention kernels and
    collectives backend; on a CPU, also what glibc's heap keeps resident (``glibc_heap_retention_bytes``) and
    what transformers' model code does (``model_code_resident_bytes``, the device's measured figures).
    ``stack``: whose code runs the step (``memplan.memory.stacks``), its dropout masks as the device makes them."""
    stack = walked_for(stack, setup)  # a plan that trains another stack's model class: that stack's hooks
    repeat = sdpa_gqa_repeats(spec, setup, device.flash_attention, device.family)
    if not stack.walks_sdpa_gqa_repeat:
        repeat = False  # transformers passes enable_gqa to SDPA (no mask in an unpadded batch)
    stack = stack.on_cpu(device.family == "cpu")
    return peak_memory(spec, setup, device.runtime_context_bytes, device.allocator_overhead, repeat,
                       COLLECTIVES_OF_FAMILY[device.family], heap_retention=device.family == "cpu", stack=stack,
                       code_bytes=(device.transformers_code_bytes, device.peft_code_bytes))


def fits_on(spec: ModelSpec, setup: TrainSetup, device: Device, budget: int | None = None,
            stack: Stack = MEMPLAN) -> bool:
    """Whether peak_reserved ≤ budget (default: the device's usable memory)."""
    return memory_on(spec, setup, device, stack).peak_reserved <= (device.usable_bytes if budget is None else budget)


def max_micro_batch(spec: ModelSpec, setup: TrainSetup, device: Device, budget: int | None = None,
                    stack: Stack = MEMPLAN) -> int:
    """The largest micro-batch that fits, everything else held; 0 if even 1 does not.

    Memory grows with the micro-batch, so: double until it does not fit, then bisect.
    """
    def ok(b: int) -> bool:
        return fits_on(spec, setup.replace(micro_batch=b), device, budget, stack)

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= MAX_MICRO_BATCH and ok(hi):
        lo, hi = hi, hi * 2
    if hi > MAX_MICRO_BATCH:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def estimate(spec: ModelSpec, setup: TrainSetup, device: Device, tokens: int | None = None,
             stack: Stack = MEMPLAN) -> Estimate:
    """Memory, fit, largest micro-batch and step time of one setup, as ``stack``'s code runs it."""
    spec.check_context(setup.ctx)
    memory = memory_on(spec, setup, device, stack)
    return Estimate(
        model=spec, setup=setup, device=device, memory=memory,
        time=step_time(spec, setup, device, tokens),
        fits=memory.peak_reserved <= device.usable_bytes,
        max_micro_batch=max_micro_batch(spec, setup, device, stack=stack),
        tokens=tokens, stack=stack,
    )

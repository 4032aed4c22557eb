"""The peak of a step: ``peak_memory`` and ``peak_memory_of_rank``, and the ``MemoryBreakdown`` they report."""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.memory.sharding import COLLECTIVES
from memplan.memory.terms import (activation_terms, compiled_code_resident_bytes, glibc_heap_retention_bytes,
                                  mapped_logits_high_water_bytes, runtime_bytes)
from memplan.memory.walk import Moment, walk_step
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.memory.stacks import MEMPLAN, Stack


@dataclass(frozen=True)
class MemoryBreakdown:
    """The ``memory`` object of the --json output (docs/json.md): live bytes by category at the peak, plus the runtime."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    temporaries: int
    runtime: int
    peak_allocated: int
    peak_reserved: int
    peak_phase: str  # forward | backward | optimizer
    peak_moment: str  # where in the step, e.g. "block backward: MLP"
    moments: tuple[Moment, ...] = field(default=())
    terms: dict[str, int] = field(default_factory=dict)
    # the named parts of ``runtime``: context, allocator_reserve; on a CPU heap_retention, mapped_logits,
    # model_code (a library's model class) and compiled_code (torch.compile) (``peak_memory_of_rank``)
    runtime_terms: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("weights", "gradients", "optimizer", "activations", "logits",
                                              "temporaries", "runtime", "peak_allocated", "peak_reserved",
                                              "peak_phase")}



def peak_memory(spec: ModelSpec, setup: TrainSetup, runtime_context_bytes: int = 0,
                allocator_overhead: float = 0.0, gqa_repeat: bool = False,
                collectives: str = "nccl", heap_retention: bool = False, stack: Stack = MEMPLAN,
                code_bytes: tuple[int | None, int | None] = (None, None)) -> MemoryBreakdown:
    """The peak of a steady-state step, by category, with the runtime on top for peak_reserved.

    Under FSDP the step of rank 0, which holds the largest shards (every rank's within a few
    rows of it); ``peak_memory_of_rank`` gives any other rank's.
    """
    return peak_memory_of_rank(spec, setup, 0, runtime_context_bytes, allocator_overhead, gqa_repeat, collectives,
                               heap_retention, stack, code_bytes)


def peak_memory_of_rank(spec: ModelSpec, setup: TrainSetup, rank: int, runtime_context_bytes: int = 0,
                        allocator_overhead: float = 0.0, gqa_repeat: bool = False,
                        collectives: str = "nccl", heap_retention: bool = False,
                        stack: Stack = MEMPLAN,
                        code_bytes: tuple[int | None, int | None] = (None, None)) -> MemoryBreakdown:
    """``peak_memory`` of one rank (the ranks of a DDP or single-process step are alike).
    ``collectives``: the process group's backend, nccl (NVIDIA, and RCCL on ROCm) or gloo (CPU),
    which (under FSDP) allocates differently (``gloo_reduce_scatter_copy_bytes``). ``heap_retention``
    (a CPU: the process's resident memory is the peak) adds ``glibc_heap_retention_bytes``,
    ``mapped_logits_high_water_bytes``, the stack's ``model_code_bytes`` (transformers' model class; ``code_bytes``:
    the device's measured transformers and peft figures, None for the default) and, under torch.compile,
    ``compiled_code_resident_bytes`` (inductor's modules and the compiled graph's code) to the runtime."""
    if collectives not in COLLECTIVES:
        raise ValueError(f"collectives {collectives!r} is not one of {COLLECTIVES}")
    w = walk_step(spec, setup, gqa_repeat, stack, rank, collectives)  # FSDP: the FullyShard hook (memplan's step, or torchtune's)
    peak = w.peak
    runtime = runtime_bytes(peak.total, runtime_context_bytes, allocator_overhead)
    parts = {"context": int(runtime_context_bytes), "allocator_reserve": runtime - int(runtime_context_bytes)}
    if heap_retention:
        parts["heap_retention"] = glibc_heap_retention_bytes(spec, setup)
        parts["mapped_logits"] = 0
        if stack.chunked_upcast_bytes(spec, setup) == 0 and stack.chunked_loss_backward_bytes(spec, setup) == 0:
            parts["mapped_logits"] = mapped_logits_high_water_bytes(spec, setup, w.rest_high, w.logits_high,
                                                                    peak.total)
        parts["model_code"] = stack.model_code_bytes(setup, *code_bytes)
        parts["compiled_code"] = compiled_code_resident_bytes(spec.layers) if setup.compile else 0
        runtime += parts["heap_retention"] + parts["mapped_logits"] + parts["model_code"] + parts["compiled_code"]
    return MemoryBreakdown(**peak.bytes, runtime=runtime, peak_allocated=peak.total,
                           peak_reserved=peak.total + runtime, peak_phase=peak.phase, peak_moment=peak.name,
                           moments=tuple(w.marks), terms=activation_terms(spec, setup), runtime_terms=parts)

"""What a ``torch.compile``d step (inductor) holds differently from the eager one: the walk's compile hook.

The trainer compiles the whole model (trainer/loop.py); the loss and the optimizer stay eager. Inductor's
partitioner (``min_cut_rematerialization_partition``) chooses what the forward saves for backward; its fusion
makes one kernel of a pointwise chain, whose intermediates are never materialised. ``memplan trace --compile``
(trainer/compiled_trace.py) traces both on fake tensors; the terms below are what that trace showed, each
checked against it (tests/walk/test_compiled.py), and the trace against a real compiled step's allocator peak
(benchmarks/compile_memory.py).

Modelled: memplan's own step, one process, without checkpointing; with LoRA where an adapter on up, qkv or proj
makes every block's MLP input need a gradient (eager autograd then saves silu(gate) in every block). There the
partitioner saves what eager autograd saves (the block input, the norms' statistics and low-precision outputs,
q, k, v and the rotated q and k, SDPA's output and log-sum-exp, x + attention, the up matmul's output, the down
matmul's input, autocast's weight copies) except the terms below. Under checkpointing, with LoRA on down or the
head alone, or with FSDP the compiled step is not modelled here (``compiled_modelled`` says why).
"""

from __future__ import annotations

from memplan.memory.stacks import MEMPLAN, Stack
from memplan.memory.terms import act_bytes, mlp_inner_bytes, residual_bytes_per_element, tokens
from memplan.model import ModelSpec
from memplan.setup import TrainSetup


def compiled_modelled(setup: TrainSetup, stack: Stack = MEMPLAN) -> str | None:
    """None where the compile hook models the compiled step of ``stack``'s code (``Stack.compiles``); else why
    not (one line)."""
    if not setup.compile:
        return "not compiled"
    if not stack.compiles:
        return f"--stack {stack.name}: the trainer compiles memplan's own model only"
    if setup.world_size > 1:
        return "sharded steps are planned eager"
    if setup.lora_rank and not ({"up", "qkv", "proj"} & set(setup.lora)):
        return f"LoRA on {setup.lora_targets} alone: the compiled step of a frozen first MLP is not modelled yet"
    if setup.checkpointing != "none":
        return f"checkpointing {setup.checkpointing}: the compiled recomputation is not modelled yet"
    return None


def compiled_silu_unsaved_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """SwiGLU's silu(gate), n·F·a, per block: inductor fuses silu(gate)·up into one kernel, so the forward never
    materialises silu(gate), and the partitioner saves the up matmul's output (gate|up) and the product (the
    down matmul's input) and recomputes silu(gate) from gate inside the backward's fused kernel. Eager autograd
    saves silu(gate) too (``layer_activation_terms``' mlp: up + 2·n·F·a). 0 for a GELU MLP: gelu(up) is the
    down matmul's input, saved either way."""
    if setup.checkpointing != "none" or spec.mlp != "swiglu":
        return 0
    return mlp_inner_bytes(spec, setup)


def compiled_first_residual_unsaved_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The first block only, under autocast (residual r = 4 bytes, branch a = 2): n·H·(r − a). There x + attention
    (n·H·r) is the block input (the embedding's output, saved anyway) plus the out-projection's output, so the
    partitioner saves that output (n·H·a) and recomputes the sum in the backward; a later block's input is
    itself a sum inductor recomputes nothing of, and there the fp32 sum is saved, as eager saves it.
    0 when r = a, for a parallel-residual block (no x + attention is saved), under checkpointing, or under LoRA
    (the first block's input is frozen and not saved, so the fp32 sum is what the partitioner keeps)."""
    if setup.checkpointing != "none" or spec.parallel_residual or setup.lora_rank:
        return 0
    return tokens(setup) * spec.hidden * max(0, residual_bytes_per_element(setup) - act_bytes(setup))


def compile_memory_json(spec: ModelSpec, setup: TrainSetup, compiled_peak: int, eager_peak: int,
                        stack: Stack = MEMPLAN) -> dict:
    """``compile_memory`` of ``estimate --compile --json``: whether the compiled step is modelled, its peak and
    the eager step's (``peak_allocated``, bytes), and the terms the partitioner saves less, per block and for
    the first block; where it is not modelled, why (``memory`` is then the eager step's)."""
    why = compiled_modelled(setup, stack)
    if why is not None:
        return {"modelled": False, "why": why, "peak_allocated": eager_peak, "eager_peak_allocated": eager_peak}
    return {"modelled": True, "peak_allocated": compiled_peak, "eager_peak_allocated": eager_peak,
            "saved_less_per_block": {"silu_gate": compiled_silu_unsaved_bytes(spec, setup)},
            "saved_less_first_block": {"attention_residual": compiled_first_residual_unsaved_bytes(spec, setup)},
            "method": "memplan's walk with inductor's partitioner's choices (memplan trace --compile checks it)"}

"""What a ``torch.compile``d step (inductor) holds differently from the eager one: the walk's compile hook.

The trainer compiles the whole model (trainer/loop.py); the loss and the optimizer stay eager. Inductor's
partitioner (``min_cut_rematerialization_partition``) chooses what the forward saves for backward; its fusion
makes one kernel of a pointwise chain, whose intermediates are never materialised. ``memplan trace --compile``
(trainer/compiled_trace.py) traces both on fake tensors; the terms below are what that trace showed, each
checked against it (tests/walk/test_compiled.py), and the trace against a real compiled step's allocator peak
(benchmarks/compile_memory.py).

Modelled: memplan's own step, one process, without checkpointing and under full checkpointing; with LoRA on any
of up, qkv, proj or down. Without checkpointing the partitioner saves what eager autograd saves (the block input,
the norms' statistics and low-precision outputs, q, k, v and the rotated q and k, SDPA's output and log-sum-exp,
x + attention, the up matmul's output, the down matmul's input, autocast's weight copies) except silu(gate) and
the first block's fp32 x + attention (the terms below). Under full checkpointing the backward graph recomputes each
block as eager's checkpoint does, with one difference: on a 16-bit branch inductor's decomposition computes silu
and its backward through fp32 buffers (the gate cast to fp32, sigmoid, the products), which the walk holds
(``compiled_gate_fp32_bytes``, ``compiled_silu_fp32_transient_bytes``); in fp32 the gate is read as it is and the
walk is the eager one. Not modelled (``compiled_modelled`` says why, and the memory is the eager step's): a GELU
MLP or a LayerNorm (gpt2, gpt_neox: their compiled trace holds fp32 buffers of gelu's and LayerNorm's
decompositions the walk has no term for, 6-20% of the peak), selective checkpointing (its policy's saved outputs
under the partitioner), LoRA on the head alone, FSDP/DDP, and another stack's code.

What is modelled is the compiled trace: its transients are those of the partitioned graphs run op by op, an upper
bound on inductor's, whose fusion never materialises a pointwise chain's intermediates. So under full
checkpointing with a 16-bit branch the walk (like the trace) holds silu's fp32 chain, which a real compiled step
computes inside one fused kernel: there the real step's peak is lower than both (``memplan validate --matrix
compiled`` measures it; benchmarks/README.md has the figures).
"""

from __future__ import annotations

from memplan.memory.stacks import MEMPLAN, Stack
from memplan.memory.terms import act_bytes, mlp_inner_bytes, residual_bytes_per_element, tokens
from memplan.model import ModelSpec
from memplan.setup import FP32_BYTES, TrainSetup


def compiled_modelled(spec: ModelSpec, setup: TrainSetup, stack: Stack = MEMPLAN) -> str | None:
    """None where the compile hook models the compiled step of ``stack``'s code (``Stack.compiles``); else why
    not (one line). A GELU MLP or a LayerNorm (gpt2's, gpt_neox's) is not modelled: inductor's decompositions of
    gelu and LayerNorm run through fp32 buffers the eager walk has no term for (trace --compile of a 2 × 128 gpt2
    at 4 × 128: the walk −6% to −20% over fp32 / bf16-mixed × checkpointing none / full)."""
    if not setup.compile:
        return "not compiled"
    if not stack.compiles:
        return f"--stack {stack.name}: the trainer compiles memplan's own model only"
    if spec.mlp != "swiglu" or spec.norm != "rmsnorm":
        return f"{spec.arch}: the compiled step of a {spec.mlp} MLP with {spec.norm} is not modelled yet"
    if setup.world_size > 1:
        return "sharded steps are planned eager"
    if setup.lora_rank and not ({"up", "qkv", "proj", "down"} & set(setup.lora)):
        return f"LoRA on {setup.lora_targets} alone: the compiled step of a frozen MLP is not modelled yet"
    if setup.checkpointing == "selective":
        return "checkpointing selective: the compiled step under a selective policy is not modelled yet"
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


def compiled_first_silu_unsaved_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """LoRA on down alone (no adapter on up, qkv or proj): eager autograd saves no silu(gate) in the first block
    either (its MLP input needs no gradient: ``terms.first_block_frozen_mlp_bytes`` counts it unsaved there), so
    the first block's share of ``compiled_silu_unsaved_bytes`` is not saved less a second time: n·F·a, given
    back to what the first block saves less. 0 elsewhere."""
    if setup.checkpointing != "none" or not setup.lora_rank or {"up", "qkv", "proj"} & set(setup.lora):
        return 0
    if spec.parallel_residual:
        return 0
    return compiled_silu_unsaved_bytes(spec, setup)


def _fp32_silu_chain(spec: ModelSpec, setup: TrainSetup) -> bool:
    """Whether the compiled step computes SwiGLU's silu through fp32 buffers in a checkpointed block: inductor's
    decomposition of silu on a 16-bit gate is gate.float()·sigmoid, cast back (autocast's 16-bit branch, a < 4),
    and under full checkpointing the partitioner recomputes it in the backward graph beside silu's backward."""
    return setup.checkpointing == "full" and spec.mlp == "swiglu" and act_bytes(setup) < FP32_BYTES


def compiled_gate_fp32_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Under full checkpointing with a 16-bit branch: the gate cast to fp32, n·F·4 (``convert_element_type`` of
    the gate half of the up matmul's output, in the backward graph's recomputation). silu's forward and its
    backward (sigmoid(g)·(1 + g·(1 − sigmoid(g)))) both read it, so it lives from the recomputed up matmul to the
    end of silu's backward. 0 in fp32 (the gate is read as it is), without SwiGLU or without checkpointing."""
    return tokens(setup) * spec.ffn * FP32_BYTES if _fp32_silu_chain(spec, setup) else 0


def compiled_silu_fp32_transient_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Under full checkpointing with a 16-bit branch: the fp32 n·F buffers silu's chain holds at once beside the
    fp32 gate, 2·n·F·4. In the forward (and its recomputation) exp(−g) and 1 + exp(−g), then g / (1 + exp(−g));
    in the backward silu's output gradient cast to fp32, sigmoid(g) and their product are three, of which the
    cast dies with the product, so two of them outlive each op (``compiled_silu_backward`` walks them). 0 where
    ``compiled_gate_fp32_bytes`` is."""
    return 2 * tokens(setup) * spec.ffn * FP32_BYTES if _fp32_silu_chain(spec, setup) else 0


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
    why = compiled_modelled(spec, setup, stack)
    if why is not None:
        return {"modelled": False, "why": why, "peak_allocated": eager_peak, "eager_peak_allocated": eager_peak}
    return {"modelled": True, "peak_allocated": compiled_peak, "eager_peak_allocated": eager_peak,
            "saved_less_per_block": {"silu_gate": compiled_silu_unsaved_bytes(spec, setup)},
            "saved_less_first_block": {"attention_residual": compiled_first_residual_unsaved_bytes(spec, setup),
                                       "silu_gate": -compiled_first_silu_unsaved_bytes(spec, setup)},
            "checkpointed_per_block": {"gate_fp32": compiled_gate_fp32_bytes(spec, setup),
                                       "silu_fp32_transient": compiled_silu_fp32_transient_bytes(spec, setup)},
            "method": "memplan's walk with inductor's partitioner's choices (memplan trace --compile checks it)"}

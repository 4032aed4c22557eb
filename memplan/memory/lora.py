"""The walk's LoRA hooks: where an adapter, or a frozen weight, changes what a step allocates and frees.

Each is a small function the one walk (``memplan.memory.walk``) calls where the tensors it names are made;
``trainer/lora.py`` is the code they follow (``LoRALinear``: the frozen base matmul, then
``lora_B(lora_A(x))·scale`` added to its output), and a stack's own adapters (peft's, litgpt's,
torchtune's) come in through ``Stack``'s hooks (``memplan.stacks``). The closed-form LoRA terms (the
adapters' parameters, what they save, what the first block does not save) are in ``memplan.memory.terms``;
they are looked up there when called, so a test can take one out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import memplan.memory.terms as terms
from memplan.memory.terms import LOWP_WEIGHT_BYTES, _matrix_shapes, act_bytes, lora_matrix_params, tokens
from memplan.model import ModelSpec
from memplan.setup import FP32_BYTES, TrainSetup
from memplan.stacks import Stack

if TYPE_CHECKING:
    from memplan.memory.ledger import _StepWalk


def saves_input(setup: TrainSetup, matrix: str) -> bool:
    """Whether ``matrix``'s matmul saves its input for backward: not a frozen matrix without an adapter, whose
    weight gets no gradient (``trainer/lora.py``: the base weight has ``requires_grad=False``)."""
    return not setup.lora_rank or matrix in setup.lora


def adapter_forward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, matrix: str, saves_adapter: bool,
                    keeps_output: bool) -> None:
    """The adapter on ``matrix``, forward (``trainer/lora.py`` LoRALinear.forward, ``lora_B(lora_A(x))``):
    under autocast A's and B's bf16 casts (r·(in + out)·2, cached and saved); x·Aᵀ (n·r·a, B's saved
    input); the adapter's output n·out·a (plus a stack's own transient, ``Stack.lora_forward_transient_bytes``),
    added in place to the base output and freed, unless selective checkpointing keeps it (an mm output:
    ``keeps_output``). Full checkpointing's forward (``saves_adapter`` False) keeps neither x·Aᵀ nor the casts.
    Nothing where ``matrix`` has no adapter."""
    if matrix not in setup.lora:
        return
    if setup.mixed and saves_adapter:
        w.alloc("weights", lora_matrix_params(spec, setup, matrix) * LOWP_WEIGHT_BYTES)
    n, a = tokens(setup), act_bytes(setup)
    low = n * setup.lora_rank * a
    out = n * _matrix_shapes(spec)[matrix][1] * a
    w.alloc("activations", low)
    if saves_adapter:  # a stack's own saved tensors of this adapter (peft's casts, masks, x·Aᵀ): 0 for memplan
        w.alloc("activations", w.stack.adapter_saved_bytes(spec, setup, matrix))
    transient = out + w.stack.lora_forward_transient_bytes(spec, setup, matrix)  # 0 for memplan
    w.alloc("temporaries", transient)
    w.free("temporaries", transient)
    if keeps_output:
        w.alloc("activations", out)
    if not saves_adapter:
        w.free("activations", low)


def _adapter_weight_grad(w: _StepWalk, setup: TrainSetup, elems: int) -> None:
    """An adapter weight's gradient (``lora_A.weight.grad`` or ``lora_B.weight.grad``): computed in the compute
    dtype (elems·a), under autocast cast to fp32 (the bf16 cast of the weight released), and kept as ``.grad``
    (elems·p) unless accumulated into an earlier micro-batch's."""
    a, p = act_bytes(setup), setup.param_bytes
    w.alloc("temporaries", elems * a)
    if setup.mixed:
        w.free("weights", elems * LOWP_WEIGHT_BYTES)
        w.alloc("temporaries", elems * FP32_BYTES)
        w.free("temporaries", elems * a)
    w.free("temporaries", elems * p)
    if setup.grad_accum == 1:
        w.alloc("gradients", elems * p)


def _peft_input_release(w: _StepWalk, release: tuple[int, int], saved_input_bytes: int, input_grad_bytes: int,
                        needs_input_grad: bool) -> None:
    """peft's ``lora_A`` backward (``Stack.lora_input_release``): A's input gradient in the adapter's dtype,
    then A's saved input (and the base's, one tensor) released, then the gradient cast back to the input's dtype."""
    extra_saved, grad_e = release
    if needs_input_grad:
        w.alloc("temporaries", grad_e)
    w.free("activations", saved_input_bytes + extra_saved)
    if needs_input_grad and grad_e != input_grad_bytes:
        w.alloc("temporaries", input_grad_bytes)
        w.free("temporaries", grad_e)


def _adapter_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, matrix: str, saved_input_bytes: int,
                      input_grad_bytes: int, needs_input_grad: bool) -> int:
    """The adapter's backward, before the base's (autograd runs the later-recorded branch first): the gradient of
    x·Aᵀ (n·r·a) and B's weight gradient (out·r), x·Aᵀ released, A's input gradient (n·in, summed with the
    base's later), A's weight gradient (r·in). Returns the base's saved input still held: 0 where the stack's
    adapter released it in its own backward (peft's)."""
    fan_in, fan_out = _matrix_shapes(spec)[matrix]
    rank = setup.lora_rank
    low = tokens(setup) * rank * act_bytes(setup)
    w.alloc("temporaries", low)
    _adapter_weight_grad(w, setup, fan_out * rank)
    w.free("activations", low)
    release = w.stack.lora_input_release(spec, setup, matrix)  # None for memplan
    if release is not None:
        _peft_input_release(w, release, saved_input_bytes, input_grad_bytes, needs_input_grad)
        saved_input_bytes = 0
    elif needs_input_grad:
        w.alloc("temporaries", input_grad_bytes)
    _adapter_weight_grad(w, setup, rank * fan_in)
    w.free("temporaries", low)
    return saved_input_bytes


def linear_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, matrix: str, weight_elems: int,
                    grad_in_bytes: int, saved_input_bytes: int, input_grad_bytes: int, input_cast: bool,
                    needs_input_grad: bool) -> None:
    """A frozen matmul with (or without) an adapter, backward: the adapter's (``_adapter_backward``), then the
    base's input gradient, summed with the adapter's; the frozen weight gets none. No input gradient at all
    where nothing before needs one (the first block's qkv: the embedding and norm below are frozen). The saved
    input was never saved without an adapter (``terms.lora_unsaved_bytes``)."""
    a = act_bytes(setup)
    adapted = matrix in setup.lora
    if adapted:
        saved_input_bytes = _adapter_backward(w, spec, setup, matrix, saved_input_bytes, input_grad_bytes,
                                              needs_input_grad)
    else:
        saved_input_bytes = 0
    if needs_input_grad:
        w.alloc("temporaries", input_grad_bytes)  # the base's input gradient
        if adapted:  # ... summed with the adapter's
            w.alloc("temporaries", input_grad_bytes)
            w.free("temporaries", 2 * input_grad_bytes)
    w.free("activations", saved_input_bytes)
    w.free("temporaries", grad_in_bytes)
    if setup.mixed:
        w.free("weights", weight_elems * LOWP_WEIGHT_BYTES)
        if input_cast and needs_input_grad:
            w.alloc("temporaries", input_grad_bytes // a * FP32_BYTES)
            w.free("temporaries", input_grad_bytes)


def first_block_unsaved_bytes(spec: ModelSpec, setup: TrainSetup, gqa_repeat: bool, stack: Stack) -> int:
    """What the first block saves less than the others under LoRA without checkpointing (nothing before its
    first adapter trains): memplan's tensors (``terms.first_block_unsaved_bytes``) and the stack's
    (``Stack.first_block_unsaved_bytes``). 0 without LoRA."""
    return terms.first_block_unsaved_bytes(spec, setup, gqa_repeat) + stack.first_block_unsaved_bytes(spec, setup)


def first_block_weight_copy_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The autocast weight copies the first block does not keep under LoRA (``cached_cast`` keeps the cast of a
    frozen weight only where its matmul saves it: ``terms.first_block_frozen_weight_copy_bytes``)."""
    return terms.first_block_frozen_weight_copy_bytes(spec, setup)


def trained_block_elems(spec: ModelSpec, setup: TrainSetup) -> int:
    """Elements of one block's parameters whose gradients its matmuls' backward makes: under LoRA the adapters'
    r·(in + out) per targeted matrix; else every matrix (norms and biases are added after the blocks)."""
    if setup.lora_rank:
        return sum(lora_matrix_params(spec, setup, m) for m in setup.lora)
    return sum(terms._layer_matrices(spec).values())


def adapter_recompute_stop(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, matrix: str) -> None:
    """A checkpointed block's recomputation that runs on into ``matrix``'s adapter and stops there
    (``Stack.recompute_reaches_down_adapter``: transformers' down_proj under peft). torch.utils.checkpoint's
    non-reentrant recomputation stops once the last tensor the backward needs is saved again, lora_B's input:
    the adapter's forward (``adapter_forward``) up to lora_A's output, its casts and x·Aᵀ (n·r·a) and the
    stack's own saved tensors kept (they are saved, and the backward releases them); what is alive there and
    not saved (``Stack.recompute_stop_bytes``: the base matmul's output, peft's input cast and dropout output,
    the MLP's locals) made and freed with the interrupted forward."""
    if setup.mixed:
        w.alloc("weights", lora_matrix_params(spec, setup, matrix) * LOWP_WEIGHT_BYTES)
    w.alloc("activations", tokens(setup) * setup.lora_rank * act_bytes(setup))
    w.alloc("activations", w.stack.adapter_saved_bytes(spec, setup, matrix))
    unsaved = w.stack.recompute_stop_bytes(spec, setup)
    w.alloc("temporaries", unsaved)
    w.free("temporaries", unsaved)

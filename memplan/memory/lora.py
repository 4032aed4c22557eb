"""The walk's LoRA hooks: where an adapter, or a frozen weight, changes what a step allocates and frees.

Each is a small function the one walk (``memplan.memory.walk``) calls where the tensors it names are made;
``trainer/lora.py`` is the code they follow (``LoRALinear``: the frozen base matmul, then
``lora_B(lora_A(x))·scale`` added to its output), and a stack's own adapters (peft's, litgpt's,
torchtune's) come in through ``Stack``'s hooks (``memplan.memory.stacks``). The closed-form LoRA terms (the
adapters' parameters, what they save, what the first block does not save) are in ``memplan.memory.terms``;
they are looked up there when called, so a test can take one out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import memplan.memory.terms as terms
from memplan.memory.terms import LOWP_WEIGHT_BYTES, act_bytes, lora_adapter_shapes, lora_matrix_params, tokens
from memplan.model import ModelSpec
from memplan.setup import FP32_BYTES, TrainSetup
from memplan.memory.stacks import Stack

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
    q, k, v adapted alone (``terms.lora_adapter_shapes``): one x·Aᵀ each, the outputs one at a time (n·out·a,
    out the widest slice), each added to its slice of the fused output (``trainer/lora.py`` _AddToSlice).
    Nothing where ``matrix`` has no adapter."""
    shapes = lora_adapter_shapes(spec, setup, matrix)
    if not shapes:
        return
    if setup.mixed and saves_adapter:
        w.alloc("weights", lora_matrix_params(spec, setup, matrix) * LOWP_WEIGHT_BYTES)
    n, a = tokens(setup), act_bytes(setup)
    low = len(shapes) * n * setup.lora_rank * a
    out = n * max(fan_out for _, fan_out in shapes) * a
    w.alloc("activations", low + terms.lora_input_casts_bytes(spec, setup, matrix))
    if saves_adapter:  # a stack's own saved tensors of this adapter (peft's casts, masks, x·Aᵀ): 0 for memplan
        w.alloc("activations", w.stack.adapter_saved_bytes(spec, setup, matrix))
    transient = out + w.stack.lora_forward_transient_bytes(spec, setup, matrix)  # 0 for memplan
    w.alloc("temporaries", transient)
    w.free("temporaries", transient)
    if keeps_output:
        w.alloc("activations", sum(n * fan_out * a for _, fan_out in shapes))
    if not saves_adapter:
        w.free("activations", low + terms.lora_input_casts_bytes(spec, setup, matrix))


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
    base's later), A's weight gradient (r·in). q, k, v adapted alone (``terms.lora_adapter_shapes``): each
    adapter so, the last first, each later one's input gradient summed into the earlier's (in place, autograd's
    input buffer). Returns the base's saved input still held: 0 where the stack's adapter released it in its own
    backward (peft's)."""
    rank = setup.lora_rank
    low = tokens(setup) * rank * act_bytes(setup)
    shapes = lora_adapter_shapes(spec, setup, matrix)
    cast = terms.lora_input_casts_bytes(spec, setup, matrix) // max(len(shapes) - 1, 1)  # each later A's own
    for i, (fan_in, fan_out) in enumerate(reversed(shapes)):
        w.alloc("temporaries", low)
        _adapter_weight_grad(w, setup, fan_out * rank)
        w.free("activations", low)
        release = w.stack.lora_input_release(spec, setup, matrix) if i == 0 else None  # None for memplan
        if release is not None:  # (memplan's casts of the input for each later A among what it releases)
            _peft_input_release(w, release, saved_input_bytes, input_grad_bytes, needs_input_grad)
            saved_input_bytes, cast = 0, 0
        elif needs_input_grad:
            w.alloc("temporaries", input_grad_bytes)
            if i:  # summed into the earlier adapter's
                w.free("temporaries", input_grad_bytes)
        _adapter_weight_grad(w, setup, rank * fan_in)
        w.free("temporaries", low)
        if i < len(shapes) - 1:
            w.free("activations", cast)  # its saved cast of the input (the first A's is the matrix's saved input)
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
        if adapted:  # ... summed with the adapter's (``input_gradient_sum_bytes``)
            summed = terms.input_gradient_sum_bytes(w.stack.sums_input_gradient_in_place, input_grad_bytes)
            w.alloc("temporaries", summed)
            w.free("temporaries", input_grad_bytes + summed)
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


def head_adapter_forward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, frozen_input: bool = False) -> bool:
    """The LM head's adapter, forward (``--lora-targets head``; ``trainer/lora.py`` LoRALinear on
    ``model.head``): under autocast A's and B's casts (r·(H + V)·2, saved), x·Aᵀ (n·r·a, saved), the
    adapter's output n·V·a (plus a stack's own transient, ``Stack.lora_forward_transient_bytes``), added in
    place to the logits and freed. A saves its input, the final norm's output (its autocast copy; the
    frozen head's matmul saves none): the walk's ``head_in`` stays; a stack's adapter may save more
    (``Stack.lora_head_saved_bytes``; ``frozen_input``: no block trains). Returns whether the head has one."""
    shapes = lora_adapter_shapes(spec, setup, "head")
    if not shapes:
        return False
    if setup.mixed:
        w.alloc("weights", lora_matrix_params(spec, setup, "head") * LOWP_WEIGHT_BYTES)
    n, a = tokens(setup), act_bytes(setup)
    w.alloc("activations", n * setup.lora_rank * a + w.stack.lora_head_saved_bytes(spec, setup, frozen_input))
    transient = n * spec.vocab * a + w.stack.lora_forward_transient_bytes(spec, setup, "head")
    w.alloc("temporaries", transient)
    w.free("temporaries", transient)
    return True


def head_input_held(w: _StepWalk, spec: ModelSpec, setup: TrainSetup) -> int:
    """The head's input as the stack's model keeps it beside what the head adapter saves, to the end of the
    forward (``Stack.lora_head_input_held_bytes``: transformers' final norm output, held by the CausalLM's
    forward through the loss); 0 for memplan's. Returns the bytes, which the loss's forward frees."""
    held = w.stack.lora_head_input_held_bytes(spec, setup) if setup.lora_head else 0
    w.alloc("activations", held)
    return held


def head_adapter_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, head_in: int, input_grad_bytes: int,
                          frozen_input: bool = False) -> int:
    """The LM head's adapter, backward, before the frozen head's input gradient (autograd runs the
    later-recorded branch first): the logits' gradient times the scale (``y.add_(delta, alpha=scale)``'s
    backward: n·V·a), the gradient of x·Aᵀ (n·r·a) and B's weight gradient (V·r), the scaled gradient and
    x·Aᵀ released, A's input gradient (n·H·a, summed with the head's later) and weight gradient (r·H),
    then A's saved input (``head_in``) released. Returns the bytes of the input gradient it made (0 without
    a head adapter): the caller sums it with the head's."""
    if not setup.lora_head:
        return 0
    n, a, rank = tokens(setup), act_bytes(setup), setup.lora_rank
    low = n * rank * a
    scaled = n * spec.vocab * a
    w.alloc("temporaries", scaled)
    w.alloc("temporaries", low)
    _adapter_weight_grad(w, setup, spec.vocab * rank)
    w.free("temporaries", scaled)
    w.free("activations", low)
    w.alloc("temporaries", input_grad_bytes)  # 0 where nothing below the head trains
    _adapter_weight_grad(w, setup, rank * spec.hidden)
    w.free("temporaries", low)
    w.free("activations", head_in + w.stack.lora_head_saved_bytes(spec, setup, frozen_input))
    return input_grad_bytes

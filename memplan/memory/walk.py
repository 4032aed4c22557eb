"""The walk of one training step: live bytes by category through its allocations and frees.

``_walk_step`` walks one steady-state step in order (``_StepWalk``): the forward of the last
block, the loss, the LM head's and final norm's backward, the last block's backward (after its
recomputation under checkpointing), the first block's backward, the embedding's, and the
optimizer step, allocating and freeing the terms of ``memplan.memory.terms`` as PyTorch does.
The largest live total on the way is peak_allocated; where it happened is peak_phase. Blocks
between the last and the first are not walked one by one: each holds the same tensors, so live
memory changes linearly from one to the next and the peak over them is at one of the two ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.model import ModelSpec
from memplan.setup import FP32_BYTES, TrainSetup
from memplan.stacks import MEMPLAN, Stack
from memplan.memory import terms
from memplan.memory.sharding import (ddp_bucket_bytes, ddp_separate_bucket_bytes, fsdp_all_sharded_grad_bytes,
                                     fsdp_compute_setup, fsdp_copy_in_bytes, fsdp_gather_bytes,
                                     fsdp_optimizer_state_bytes, fsdp_optimizer_temporary_bytes,
                                     fsdp_reduce_scatter_input_bytes, fsdp_sharded_grad_bytes,
                                     fsdp_sharded_weight_bytes, fsdp_unsharded_bytes, gloo_reduce_scatter_copy_bytes,
                                     gradients_persist, param_shapes)
from memplan.memory.terms import (LOWP_WEIGHT_BYTES, NORM_BACKWARD_FP32_BUFFERS, NORM_FORWARD_FP32_BUFFERS,
                                  _layer_matrices, _matrix_shapes, act_bytes, attention_output_copy_bytes,
                                  attention_scores_bytes, causal_mask_bytes, eager_kv_bytes, eager_q_bytes,
                                  first_block_unsaved_bytes, fp32_logits_bytes,
                                  gradient_bytes, head_weight_grad_bytes, input_bytes, layer_lowp_weight_bytes,
                                  logits_bytes, lora_matrix_params, mlp_inner_bytes, mlp_up_bytes, norm_output_bytes,
                                  norm_stat_bytes, optimizer_state_bytes, optimizer_temporary_bytes, qkv_output_bytes,
                                  residual_bytes_per_element, rope_buffer_bytes, rope_cast_bytes, rotated_k_bytes,
                                  rotated_q_bytes, saved_per_layer_bytes, sdpa_logsumexp_bytes, sdpa_output_bytes,
                                  sdpa_repeated_kv_bytes, stack_adapter_state_bytes, tokens, weight_bytes)

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "logits", "temporaries")


# ---- the walk ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Moment:
    """Live bytes by category at one moment of a step."""

    name: str
    phase: str  # forward | backward | optimizer
    bytes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


class _StepWalk:
    """Live bytes by category through a step's allocations and frees, remembering the peak."""

    def __init__(self, spec: ModelSpec, setup: TrainSetup, stack: Stack = MEMPLAN):
        self.spec, self.setup, self.stack = spec, setup, stack
        self.gradients_persist = gradients_persist(setup)  # .grad exists before the backward (see _walk_step)
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.peak: Moment | None = None
        self.phase = "forward"
        self.where = "start of step"
        self.marks: list[Moment] = []  # the live totals at named points, for reports

    def alloc(self, category: str, nbytes: int, where: str | None = None) -> None:
        self.live[category] += int(nbytes)
        total = sum(self.live.values())
        if self.peak is None or total > self.peak.total:
            self.peak = Moment(where or self.where, self.phase, dict(self.live))

    def free(self, category: str, nbytes: int) -> None:
        self.live[category] -= int(nbytes)

    def mark(self, name: str) -> None:
        self.marks.append(Moment(name, self.phase, dict(self.live)))


def _norm_forward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup) -> int:
    """A norm's forward: its fp32 working buffers, its statistics and its output.

    Returns the bytes of the output as the next matmul sees it (the autocast copy under mixed
    precision; the fp32 output is then freed); the caller owns it and the statistics.
    """
    n, hidden = tokens(setup), spec.hidden
    r = residual_bytes_per_element(setup)
    if spec.norm == "rmsnorm":
        work = NORM_FORWARD_FP32_BUFFERS * n * hidden * FP32_BYTES
        w.alloc("temporaries", work)
        w.free("temporaries", work)
    w.alloc("activations", norm_stat_bytes(spec, setup))
    w.alloc("activations", n * hidden * r)  # the norm's output, in the residual dtype
    if setup.mixed:  # autocast casts it for the matmul; the fp32 output is not saved
        w.alloc("activations", norm_output_bytes(spec, setup))
        w.free("activations", n * hidden * r)
    return norm_output_bytes(spec, setup)


def _block_forward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, mode: str, gqa_repeat: bool = False) -> None:
    """One block's forward, each tensor allocated where it is made and freed where its last user is done.

    ``mode``: none keeps what autograd saves; full keeps nothing (the block input is kept by the
    caller); selective keeps the outputs of matmuls and of attention (what the selective
    policy in trainer/model.py saves); recompute rebuilds, in a checkpointed block's backward,
    what ``none`` keeps (under selective the kept outputs are reused, not recomputed) and stops
    once the down matmul's input exists, as non-reentrant checkpointing does.

    The block input is live before. Afterwards the block's output (n·H·r) is live too, except
    after recompute.
    """
    n, hidden, a = tokens(setup), spec.hidden, act_bytes(setup)
    r = residual_bytes_per_element(setup)
    keep_all = mode in ("none", "recompute")
    keep_outputs = mode == "selective"  # forward under selective checkpointing
    reuse = mode == "recompute" and setup.checkpointing == "selective"
    m = _layer_matrices(spec)

    def make(nbytes: int, reused: bool = False) -> int:
        if not reused:
            w.alloc("activations", nbytes)
        return nbytes

    def drop(nbytes: int, keep: bool) -> None:
        if not keep:
            w.free("activations", nbytes)

    def weight_copy(matrix: str) -> None:
        if setup.mixed:
            w.alloc("weights", m[matrix] * LOWP_WEIGHT_BYTES)

    def saves(matrix: str) -> bool:
        """Whether the matmul's input is saved: not for a frozen matrix without an adapter (LoRA)."""
        return not setup.lora_rank or matrix in setup.lora

    def adapter(matrix: str) -> None:
        """LoRA on this matrix: x·Aᵀ and the adapter's output, added in place to the base output."""
        if matrix not in setup.lora:
            return
        if setup.mixed and mode != "full":
            w.alloc("weights", lora_matrix_params(spec, setup, matrix) * LOWP_WEIGHT_BYTES)
        low = n * setup.lora_rank * a
        out = n * _matrix_shapes(spec)[matrix][1] * a
        w.alloc("activations", low)
        transient = out + w.stack.lora_forward_transient_bytes(spec, setup, matrix)  # 0 for memplan
        w.alloc("temporaries", transient)
        w.free("temporaries", transient)
        if keep_outputs and not reuse:  # selective keeps both mm outputs
            w.alloc("activations", out)
        if mode == "full":
            w.free("activations", low)

    w.where = "block forward: attention"
    norm_out = _norm_forward(w, spec, setup)
    drop(norm_stat_bytes(spec, setup), keep_all)
    weight_copy("qkv")
    qkv = make(qkv_output_bytes(spec, setup), reuse)
    adapter("qkv")
    drop(norm_out, keep_all and saves("qkv"))
    q_rot = make(rotated_q_bytes(spec, setup))
    k_rot = make(rotated_k_bytes(spec, setup))
    repeated = sdpa_repeated_kv_bytes(spec, setup, gqa_repeat)
    if setup.attention == "sdpa" and repeated:  # K and V repeated to every head, then SDPA
        make(repeated)
        drop(k_rot, False)
        out = make(sdpa_output_bytes(spec, setup) + sdpa_logsumexp_bytes(spec, setup), reuse)
        drop(q_rot + repeated, keep_all)
        drop(qkv, keep_outputs or (keep_all and spec.pos != "rope"))
        proj_in = out
        w.where = "block forward: output projection"
        weight_copy("proj")
    elif setup.attention == "sdpa":
        out = make(sdpa_output_bytes(spec, setup) + sdpa_logsumexp_bytes(spec, setup), reuse)
        drop(q_rot + k_rot, keep_all)
        drop(qkv, keep_all or keep_outputs)
        proj_in = out
        w.where = "block forward: output projection"
        weight_copy("proj")
    else:
        scores = attention_scores_bytes(spec, setup)
        q = make(eager_q_bytes(spec, setup))  # contiguous copies for the matmuls
        k = make(eager_kv_bytes(spec, setup))
        drop(q_rot + k_rot, False)
        make(scores)  # q·kᵀ, scaled and masked in place; recomputed even when the probabilities are reused
        probs = make(scores, reuse)
        drop(scores, False)
        v = make(eager_kv_bytes(spec, setup))
        drop(qkv, keep_outputs)
        make(n * spec.q_dim * a)  # probs·v, (B, heads, T, hd)
        proj_in = make(attention_output_copy_bytes(spec, setup))  # transposed back to (B, T, q_dim)
        drop(n * spec.q_dim * a, False)
        drop(q + k + v, keep_all)
        drop(probs, keep_all or keep_outputs)
        w.where = "block forward: output projection"
        weight_copy("proj")
    o = make(n * hidden * a, reuse)  # out-projection output
    adapter("proj")
    if setup.attention == "sdpa":
        drop(proj_in, keep_all or keep_outputs)
    else:
        drop(proj_in, keep_all and saves("proj"))
    x_mid = make(n * hidden * r)  # x + attention (parallel residual: a partial sum nothing saves)
    drop(o, keep_outputs)
    w.where = "block forward: MLP"
    norm_out = _norm_forward(w, spec, setup)
    drop(norm_stat_bytes(spec, setup), keep_all)
    weight_copy("up")
    up = make(mlp_up_bytes(spec, setup), reuse)
    adapter("up")
    drop(norm_out, keep_all and saves("up"))
    inner = make(mlp_inner_bytes(spec, setup))  # silu(gate), or gelu(up)
    if spec.mlp == "swiglu":
        inner += make(mlp_inner_bytes(spec, setup))  # silu(gate)·up
    weight_copy("down")
    if keep_all:  # the stack's own saved tensors beyond memplan's (memplan.stacks): 0 for memplan
        w.alloc("activations", w.stack.block_saved_bytes(spec, setup))
    if mode == "recompute":  # stops here: everything the backward needs exists
        if spec.parallel_residual:
            w.free("activations", x_mid)  # the partial sum dies with the interrupted forward
        if not saves("down"):  # a frozen down matmul without an adapter keeps none of its input
            w.free("activations", mlp_inner_bytes(spec, setup))
        return
    d = make(n * hidden * a)  # down-projection output
    adapter("down")
    if keep_all and not saves("down"):
        w.free("activations", mlp_inner_bytes(spec, setup))
        inner -= mlp_inner_bytes(spec, setup)
    make(n * hidden * r)  # the block's output
    drop(d, keep_outputs)
    drop(x_mid, keep_all and not spec.parallel_residual)
    drop(inner, keep_all)
    drop(up, keep_all or keep_outputs)


def _lora_linear_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, matrix: str, weight_elems: int,
                          grad_in_bytes: int, saved_input_bytes: int, input_grad_bytes: int, input_cast: bool,
                          needs_input_grad: bool) -> None:
    """A frozen matmul with (or without) an adapter, backward. The adapter first (autograd runs
    the later-recorded branch first): B's input gradient (n·r) and weight gradient (out·r), then
    A's (n·in, summed with the base's) and A's weight gradient (r·in); the base matmul gives only
    its input's gradient (its weight is frozen). No input gradient at all where nothing before
    needs one (the first block's qkv: the embedding and norm below are frozen)."""
    a, p, n, rank = act_bytes(setup), setup.param_bytes, tokens(setup), setup.lora_rank

    def weight_grad(elems: int) -> None:
        w.alloc("temporaries", elems * a)
        if setup.mixed:
            w.free("weights", elems * LOWP_WEIGHT_BYTES)
            w.alloc("temporaries", elems * FP32_BYTES)
            w.free("temporaries", elems * a)
        w.free("temporaries", elems * p)
        if setup.grad_accum == 1:
            w.alloc("gradients", elems * p)

    adapted = matrix in setup.lora
    if not adapted:  # its input was never saved (lora_unsaved_bytes)
        saved_input_bytes = 0
    if adapted:
        fan_in, fan_out = _matrix_shapes(spec)[matrix]
        low = n * rank * a
        w.alloc("temporaries", low)  # gradient of x·Aᵀ
        weight_grad(fan_out * rank)
        w.free("activations", low)
        release = w.stack.lora_input_release(spec, setup, matrix)  # None for memplan
        if release is None:
            if needs_input_grad:
                w.alloc("temporaries", input_grad_bytes)
        else:  # peft: A's input gradient in the adapter's dtype, then A's saved input goes, then the cast back
            extra_saved, grad_e = release
            if needs_input_grad:
                w.alloc("temporaries", grad_e)
            w.free("activations", saved_input_bytes + extra_saved)
            saved_input_bytes = 0
            if needs_input_grad and grad_e != input_grad_bytes:
                w.alloc("temporaries", input_grad_bytes)
                w.free("temporaries", grad_e)
        weight_grad(rank * fan_in)
        w.free("temporaries", low)
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


def _linear_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, weight_elems: int, grad_in_bytes: int,
                     saved_input_bytes: int, input_grad_bytes: int, input_cast: bool, matrix: str = "",
                     needs_input_grad: bool = True) -> None:
    """A matmul's backward: the input's gradient and the weight's gradient, then the saved input
    and the weight copy are released. Under autocast the weight gradient is computed in bf16
    and cast to fp32 (and, if the input was cast from fp32, the input gradient too). With
    gradient accumulation (or under DDP, whose buckets hold the gradients) the new weight
    gradient is added into ``.grad`` and freed; otherwise it becomes ``.grad``. Under LoRA:
    ``_lora_linear_backward``."""
    if setup.lora_rank:
        _lora_linear_backward(w, spec, setup, matrix, weight_elems, grad_in_bytes, saved_input_bytes,
                              input_grad_bytes, input_cast, needs_input_grad)
        return
    a = act_bytes(setup)
    w.alloc("temporaries", input_grad_bytes)
    w.alloc("temporaries", weight_elems * a)
    w.free("activations", saved_input_bytes)
    w.free("temporaries", grad_in_bytes)
    if setup.mixed:
        w.free("weights", weight_elems * LOWP_WEIGHT_BYTES)
        if input_cast:
            w.alloc("temporaries", input_grad_bytes // a * FP32_BYTES)
            w.free("temporaries", input_grad_bytes)
        w.alloc("temporaries", weight_elems * FP32_BYTES)
        w.free("temporaries", weight_elems * a)
    w.free("temporaries", weight_elems * setup.param_bytes)
    if not w.gradients_persist:
        w.alloc("gradients", weight_elems * setup.param_bytes)


def _norm_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, grad_in_bytes: int) -> int:
    """A norm's backward: RMSNorm's two fp32 buffers (plus an fp32 copy of a bf16 gradient),
    LayerNorm's none; the input's gradient n·H·r. Releases the saved input and statistics."""
    n, hidden = tokens(setup), spec.hidden
    r = residual_bytes_per_element(setup)
    out = n * hidden * r
    if spec.norm == "rmsnorm":
        work = NORM_BACKWARD_FP32_BUFFERS * n * hidden * FP32_BYTES
        w.alloc("temporaries", work)
        if grad_in_bytes != n * hidden * FP32_BYTES:  # grad.float(), freed once the scaled gradient exists
            w.alloc("temporaries", n * hidden * FP32_BYTES)
            w.free("temporaries", n * hidden * FP32_BYTES)
        if r == FP32_BYTES:  # the scaled gradient, updated in place, is the output
            w.free("temporaries", work - out)
        else:  # cast to the input's dtype
            w.alloc("temporaries", out)
            w.free("temporaries", work)
    else:
        w.alloc("temporaries", out)
    w.free("temporaries", grad_in_bytes)
    w.free("activations", norm_stat_bytes(spec, setup))
    return out


def _block_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, grad_bytes: int,
                    gqa_repeat: bool = False, first: bool = False) -> int:
    """One block's backward, op by op, from the gradient of its output (``grad_bytes``, live)
    to the gradient of its input (returned, live). Releases everything the block saved."""
    n, hidden, a = tokens(setup), spec.hidden, act_bytes(setup)
    r = residual_bytes_per_element(setup)
    m = _layer_matrices(spec)
    inner = mlp_inner_bytes(spec, setup)
    branch_cast = r != a  # fp32 residual, bf16 branch: the gradient is cast for the branch

    w.where = "block backward: MLP"
    g_branch = grad_bytes
    if branch_cast:
        g_branch = n * hidden * a
        w.alloc("temporaries", g_branch)
    # down: input gradient n·F·a
    _linear_backward(w, spec, setup, m["down"], g_branch if branch_cast else 0, inner, inner, input_cast=False,
                     matrix="down")
    if spec.mlp == "swiglu":
        w.alloc("temporaries", 2 * inner)  # gradients of silu(gate) and of up
        w.free("temporaries", inner)  # the product's gradient
        w.free("activations", inner)  # silu(gate)
        w.alloc("temporaries", inner)  # silu's input gradient
        w.free("temporaries", inner)
        w.free("activations", mlp_up_bytes(spec, setup))  # gate|up released
        w.alloc("temporaries", mlp_up_bytes(spec, setup))  # the fused gradient
        w.free("temporaries", 2 * inner)
    else:
        scratch = w.stack.mlp_backward_scratch_bytes(spec, setup)  # a stack's activation in Python ops: 0 for memplan
        w.alloc("temporaries", inner + scratch)  # gelu's input gradient
        w.free("temporaries", inner + scratch)
        w.free("activations", mlp_up_bytes(spec, setup))
    _linear_backward(w, spec, setup, m["up"], mlp_up_bytes(spec, setup), norm_output_bytes(spec, setup),
                     n * hidden * a, input_cast=setup.mixed, matrix="up")
    w.where = "block backward: norm"
    g_norm = n * hidden * (FP32_BYTES if setup.mixed else a)
    part = _norm_backward(w, spec, setup, g_norm)
    pending = 0  # input-gradient parts still to be summed (parallel residual: the MLP norm's)
    if spec.parallel_residual:
        pending = part
    else:
        w.free("activations", n * hidden * r)  # x + attention, saved by the norm
        w.alloc("temporaries", n * hidden * r)  # the residual's two gradients summed
        w.free("temporaries", part + grad_bytes)
        grad_bytes = n * hidden * r
    w.where = "block backward: attention"
    g_branch = grad_bytes
    if branch_cast:
        g_branch = n * hidden * a
        w.alloc("temporaries", g_branch)
    proj_saved = attention_output_copy_bytes(spec, setup) if setup.attention == "eager" else 0
    _linear_backward(w, spec, setup, m["proj"], g_branch if branch_cast else 0, proj_saved, n * spec.q_dim * a,
                     input_cast=False, matrix="proj")
    dq, dkv = n * spec.q_dim * a, n * spec.kv_dim * a
    repeated = sdpa_repeated_kv_bytes(spec, setup, gqa_repeat)
    if setup.attention == "sdpa" and repeated:
        w.alloc("temporaries", dq + repeated)  # dq and the repeated dk, dv
        w.free("temporaries", dq)  # the projection's input gradient
        w.free("activations", sdpa_output_bytes(spec, setup) + sdpa_logsumexp_bytes(spec, setup)
               + rotated_q_bytes(spec, setup) + repeated + (qkv_output_bytes(spec, setup) if spec.pos != "rope" else 0))
        w.alloc("temporaries", 2 * dkv)  # repeat_interleave backward sums the groups
        w.free("temporaries", repeated)
    elif setup.attention == "sdpa":
        w.alloc("temporaries", dq + 2 * dkv)
        w.free("temporaries", dq)  # the projection's input gradient
        w.free("activations", sdpa_output_bytes(spec, setup) + sdpa_logsumexp_bytes(spec, setup)
               + rotated_q_bytes(spec, setup) + rotated_k_bytes(spec, setup) + qkv_output_bytes(spec, setup))
    else:
        scores = attention_scores_bytes(spec, setup)
        kv_copy = eager_kv_bytes(spec, setup)
        w.alloc("temporaries", dq)  # the output gradient, contiguous in (B, heads, T, hd)
        w.free("temporaries", dq)  # ... replaces the projection's input gradient
        w.alloc("temporaries", kv_copy + scores)  # probs·v backward: dv, dprobs
        w.free("activations", kv_copy)  # v
        w.free("temporaries", dq)
        w.alloc("temporaries", scores)  # softmax backward
        w.free("temporaries", scores)
        w.free("activations", scores)  # probabilities
        w.alloc("temporaries", scores)  # masked_fill backward
        w.free("temporaries", scores)
        w.alloc("temporaries", scores)  # scaling backward
        w.free("temporaries", scores)
        w.alloc("temporaries", dq + kv_copy)  # q·kᵀ backward: dq, dk
        w.free("temporaries", scores)
        w.free("activations", eager_q_bytes(spec, setup) + kv_copy)
        if kv_copy != dkv:  # repeat_interleave backward sums the groups
            w.alloc("temporaries", 2 * dkv)
            w.free("temporaries", 2 * kv_copy)
    if spec.pos == "rope":
        w.alloc("temporaries", dkv)  # k rotated back
        w.free("temporaries", dkv)
        w.alloc("temporaries", dq)  # q rotated back
        w.free("temporaries", dq)
    w.alloc("temporaries", qkv_output_bytes(spec, setup))  # the three gradients concatenated
    w.free("temporaries", dq + 2 * dkv)
    released = sum(r[0] for r in (w.stack.lora_input_release(spec, setup, mm) for mm in ("proj", "up", "down")) if r)
    w.free("activations", w.stack.block_saved_bytes(spec, setup) - released)  # the stack's own, released by now
    frozen_below = bool(setup.lora_rank) and first  # LoRA: nothing below the first block's qkv trains
    _linear_backward(w, spec, setup, m["qkv"], qkv_output_bytes(spec, setup), norm_output_bytes(spec, setup),
                     n * hidden * a, input_cast=setup.mixed, matrix="qkv", needs_input_grad=not frozen_below)
    if frozen_below:  # the block input and norm statistics were never saved (see _walk_step)
        w.free("temporaries", pending + grad_bytes)
        return 0
    w.where = "block backward: norm"
    part = _norm_backward(w, spec, setup, g_norm)
    w.free("activations", n * hidden * r)  # the block input, saved by the first norm
    w.alloc("temporaries", n * hidden * r)  # its gradient: the residual's and the norms' summed
    w.free("temporaries", part + pending + grad_bytes)
    return n * hidden * r


def _walk_step(spec: ModelSpec, setup: TrainSetup, gqa_repeat: bool = False, stack: Stack = MEMPLAN) -> _StepWalk:
    """Walk one steady-state step (its last micro-batch) and return the walk with its peak.

    ``gqa_repeat``: SDPA gets K/V repeated to every head (a device without a flash kernel for
    grouped-query attention; see ``sdpa_gqa_repeats``). ``stack``: whose code runs the step; its
    hooks (``memplan.stacks``) add the tensors that code saves beyond memplan's own."""
    spec, setup = stack.walked_spec(spec), stack.walked_setup(setup)  # as the stack's code builds and steps
    w = _StepWalk(spec, setup, stack)
    n, hidden, a = tokens(setup), spec.hidden, act_bytes(setup)
    r = residual_bytes_per_element(setup)
    accum = gradients_persist(setup)
    separate_buckets = setup.sharding == "ddp" and not stack.ddp_gradient_as_bucket_view
    if separate_buckets:  # .grad is its own tensor, made by the backward as without DDP
        accum = w.gradients_persist = setup.grad_accum > 1
    ckpt = setup.checkpointing != "none"
    mode = setup.checkpointing
    vh_grad = head_weight_grad_bytes(spec, setup) if not setup.lora_rank else 0  # LoRA: the head is frozen
    lora = bool(setup.lora_rank)

    # persistent state
    w.alloc("weights", weight_bytes(spec, setup) + rope_buffer_bytes(spec, setup), "start of step")
    w.alloc("weights", stack.buffer_bytes_delta(spec, setup))  # a stack's own rotary tables
    w.alloc("optimizer", optimizer_state_bytes(spec, setup))
    extra_adapters = stack.lora_bytes_delta(spec, setup)  # e.g. peft's separate q, k, v adapters, in fp32
    w.alloc("weights", extra_adapters)
    w.alloc("optimizer", stack_adapter_state_bytes(setup, extra_adapters, stack.lora_tensors_delta(spec, setup)))
    if separate_buckets:
        w.alloc("gradients", ddp_separate_bucket_bytes(spec, setup, extra_adapters))
    if accum:  # earlier micro-batches' gradients, or DDP's buckets
        w.alloc("gradients", ddp_bucket_bytes(spec, setup) if setup.sharding == "ddp" and not separate_buckets
                else gradient_bytes(spec, setup) + extra_adapters)
    w.alloc("activations", input_bytes(spec, setup))

    w.mark("start of forward")

    # ---- forward
    w.where = "forward: embedding"
    w.alloc("activations", rope_cast_bytes(spec, setup) + causal_mask_bytes(spec, setup))
    w.alloc("activations", n * hidden * r)  # token embeddings
    if spec.pos == "learned":
        w.alloc("activations", setup.ctx * hidden * r)
        w.alloc("activations", n * hidden * r)  # + positions
        w.free("activations", n * hidden * r + setup.ctx * hidden * r)
    lowp = layer_lowp_weight_bytes(spec, setup)
    # what each earlier block left alive: its saved tensors (its input included) and, under
    # autocast, its weight copies (saved, or cached until the forward ends under checkpointing)
    stored = saved_per_layer_bytes(spec, setup, gqa_repeat) - (lowp if not ckpt else 0)
    if not ckpt:
        stored += stack.block_saved_bytes(spec, setup)
    # LoRA without checkpointing: the first block saves nothing before its first adapter (its input
    # and the weights before are frozen), memplan's tensors, the stack's, and autocast's weight copies
    first_unsaved = first_block_unsaved_bytes(spec, setup, gqa_repeat) + stack.first_block_unsaved_bytes(spec, setup)
    first_copies = terms.first_block_frozen_weight_copy_bytes(spec, setup)  # looked up in terms (tests patch it)
    if spec.layers > 1:
        w.alloc("activations", (spec.layers - 1) * stored - first_unsaved)
        w.alloc("weights", (spec.layers - 1) * lowp - first_copies)
    _block_forward(w, spec, setup, mode, gqa_repeat)
    if spec.layers == 1:  # the one block walked is the first: what it made and does not save goes now
        w.free("activations", first_unsaved)
        w.free("weights", first_copies)
    w.where = "forward: final norm and LM head"
    head_in = _norm_forward(w, spec, setup)
    w.alloc("activations", stack.final_norm_saved_bytes(spec, setup))
    if setup.mixed:
        w.alloc("weights", spec.vocab * hidden * LOWP_WEIGHT_BYTES)
    w.alloc("logits", logits_bytes(spec, setup))
    if lora:  # the head's weight is frozen: its input is not saved
        w.free("activations", head_in)
    if ckpt and setup.mixed:  # leaving autocast frees the cached copies nothing saved
        w.free("weights", spec.layers * layer_lowp_weight_bytes(spec, setup))
    w.where = "forward: loss"
    loss = fp32_logits_bytes(spec, setup) if stack.fp32_loss else logits_bytes(spec, setup)
    upcast = stack.fp32_loss and a != FP32_BYTES
    if upcast:
        w.alloc("logits", fp32_logits_bytes(spec, setup))  # logits.float()
    w.alloc("logits", stack.chunked_upcast_bytes(spec, setup))  # a loss upcasting chunk by chunk (≤ 0)
    w.alloc("logits", loss)  # log-softmax, saved
    w.free("logits", stack.chunked_upcast_bytes(spec, setup))
    if upcast:
        w.free("logits", fp32_logits_bytes(spec, setup))
    w.free("logits", logits_bytes(spec, setup))  # `del logits`: log_softmax saved its output only
    w.alloc("logits", stack.held_logits_bytes(spec, setup))  # logits a stack's loop keeps to the step's end
    w.mark("end of forward")

    # ---- backward: loss, LM head, final norm
    w.phase = "backward"
    w.where = "backward: loss"
    w.alloc("logits", stack.chunked_loss_backward_bytes(spec, setup))  # a chunked loss's freed log-probs (≤ 0)
    w.alloc("logits", loss)  # gradient of the log-probabilities
    w.alloc("logits", loss)  # gradient of the logits (fp32 when upcast)
    w.free("logits", 2 * loss)
    w.free("logits", stack.chunked_loss_backward_bytes(spec, setup))
    if upcast:
        w.alloc("logits", logits_bytes(spec, setup))
        w.free("logits", fp32_logits_bytes(spec, setup))
    w.where = "backward: LM head"
    head_grad = spec.vocab * hidden if not lora else 0
    w.alloc("temporaries", n * hidden * a)  # input gradient
    w.alloc("temporaries", head_grad * a)  # weight gradient in the compute dtype
    w.alloc("temporaries", stack.chunked_head_grad_bytes(spec, setup))  # a head run in chunks: its sums
    w.free("temporaries", stack.chunked_head_grad_bytes(spec, setup))
    if not lora:
        w.free("activations", head_in)
    w.free("logits", logits_bytes(spec, setup) if a != FP32_BYTES else fp32_logits_bytes(spec, setup))
    if setup.mixed:
        w.free("weights", spec.vocab * hidden * LOWP_WEIGHT_BYTES)
        w.alloc("temporaries", n * hidden * FP32_BYTES)  # the norm output's cast, backward
        w.free("temporaries", n * hidden * a)
        w.alloc("temporaries", head_grad * FP32_BYTES)
        w.free("temporaries", head_grad * a)
    w.free("temporaries", vh_grad)
    if not accum or spec.tied:  # tied: waits in autograd's buffer for the embedding's gradient
        w.alloc("gradients", vh_grad)
    w.where = "backward: final norm"
    grad = _norm_backward(w, spec, setup, n * hidden * (FP32_BYTES if setup.mixed else a))
    w.free("activations", stack.final_norm_saved_bytes(spec, setup))
    w.free("activations", n * hidden * r)  # the last block's output

    # ---- backward: the last block (recomputed first under checkpointing)
    def block_backward(grad: int, which: str) -> int:
        if ckpt:
            w.where = f"backward: recomputing the {which} block"
            _block_forward(w, spec, setup, "recompute", gqa_repeat)
        w.mark(f"start of the {which} block's backward")
        first = (which == "first" or spec.layers == 1) and bool(first_unsaved)
        grad = _block_backward(w, spec, setup, grad, gqa_repeat, first=first)
        if setup.checkpointing == "selective":  # kept outputs the recomputation never reached
            w.free("activations", n * hidden * a)  # the down-projection's
        return grad

    grad = block_backward(grad, "last")
    # ---- the blocks in between: each releases what it kept and adds its gradients
    middle = spec.layers - 2
    if middle > 0:
        w.free("activations", middle * stored)
        if not ckpt:  # (checkpointed blocks make and free their copies in their own backward)
            w.free("weights", middle * lowp)
        if not accum:
            trained = sum(lora_matrix_params(spec, setup, mm) for mm in setup.lora) if lora \
                else sum(_layer_matrices(spec).values())
            w.alloc("gradients", middle * trained * setup.param_bytes)
    # ---- the first block, with almost every gradient present
    if spec.layers > 1:
        grad = block_backward(grad, "first")
    # norm weights (and biases) of every block, which _block_backward did not add
    if not accum and not lora:  # (LoRA: norms and biases are frozen)
        vectors = spec.layer_params - sum(_layer_matrices(spec).values())
        w.alloc("gradients", spec.layers * vectors * setup.param_bytes + spec.norm_params * setup.param_bytes)

    if not accum:  # the stack's adapters beyond memplan's
        w.alloc("gradients", extra_adapters)
    # ---- backward: embeddings (frozen under LoRA: nothing to do)
    w.where = "backward: embedding"
    if lora:
        w.free("temporaries", grad)
    else:
        if spec.pos == "learned":
            pos_grad = spec.max_positions * hidden * setup.param_bytes
            w.alloc("temporaries", setup.ctx * hidden * r)  # summed over the batch
            w.alloc("gradients" if not accum else "temporaries", pos_grad)
            w.free("temporaries", setup.ctx * hidden * r)
            if accum:
                w.free("temporaries", pos_grad)
        w.alloc("temporaries", vh_grad)  # embedding_dense_backward
        w.free("temporaries", grad)
        if spec.tied:
            w.alloc("temporaries", vh_grad)  # head + embedding, summed out of place
            w.free("temporaries", vh_grad)
            w.free("gradients", vh_grad)  # the head's part, from autograd's buffer
            if accum:
                w.free("temporaries", vh_grad)  # added into .grad
            else:
                w.alloc("gradients", vh_grad)
                w.free("temporaries", vh_grad)
        else:
            w.free("temporaries", vh_grad)
            if not accum:
                w.alloc("gradients", vh_grad)
    w.free("activations", rope_cast_bytes(spec, setup) + causal_mask_bytes(spec, setup))
    w.mark("end of backward")

    # ---- optimizer step
    w.phase = "optimizer"
    w.where = "optimizer step"
    scratch = optimizer_temporary_bytes(spec, setup)
    if scratch:  # the foreach scratch of the adapters' group covers the stack's extra adapters too
        scratch += extra_adapters
    scratch += stack.optimizer_scratch_bytes(spec, setup)  # a stack's own optimizer loop in place of foreach's
    w.alloc("temporaries", scratch)
    w.free("temporaries", scratch)
    return w


def _walk_fsdp_step(spec: ModelSpec, setup: TrainSetup, rank: int = 0, collectives: str = "nccl",
                    gqa_repeat: bool = False) -> _StepWalk:
    """Walk one steady-state FSDP2 step (its last micro-batch) of ``rank``, as _walk_step walks a
    single-process step: the same forward and backward, op by op, in the compute setup
    (``fsdp_compute_setup``), with FSDP2's own tensors where FSDP2 makes and frees them.

    Forward: the root's parameters are all-gathered first and stay unsharded until the end of the
    backward. Before each block: its shard cast for the all-gather (mixed precision), the
    all-gather's output, then the unsharded parameters copied out of it (the previous group's
    output is released only then); after the block, the unsharded parameters are freed but the output is kept
    until the next block's copy-out (the root frees the last one when its forward ends).
    Backward: the loss's gradient reaching the logits all-gathers the last block (prefetch);
    before each block's backward its parameters are copied out (the output freed) and the block
    before it is all-gathered (but before the first block's: the root is unsharded); after it,
    the unsharded parameters are freed, the previous
    reduce-scatter input released, the block's gradients packed into this reduce-scatter input
    (the unsharded gradients freed) and reduce-scattered into the sharded gradients. The root's
    reduce-scatter ends the backward. Categories: sharded and unsharded parameters are weights;
    all-gather and reduce-scatter buffers, temporaries; unsharded and sharded gradients, gradients.
    """
    act = fsdp_compute_setup(setup)
    w = _StepWalk(spec, setup)
    n, hidden, a = tokens(act), spec.hidden, act_bytes(act)
    ckpt, mode = act.checkpointing != "none", act.checkpointing
    first_micro = setup.grad_accum == 1  # no sharded gradients before this micro-batch
    c = fsdp_gather_bytes(setup)
    gathered = {g: fsdp_unsharded_bytes(spec, setup, g) for g in ("block", "root")}
    copy_in = {g: fsdp_copy_in_bytes(spec, setup, g) for g in ("block", "root")}
    rs_input = {g: fsdp_reduce_scatter_input_bytes(spec, setup, g) for g in ("block", "root")}
    sharded_grad = {g: fsdp_sharded_grad_bytes(spec, setup, g) for g in ("block", "root")}
    gloo_copy = {g: gloo_reduce_scatter_copy_bytes(spec, setup, g, collectives) for g in ("block", "root")}
    root_params = spec.params - spec.layers * spec.layer_params  # embedding, positions, final norm, untied head
    vectors = spec.layer_params - sum(_layer_matrices(spec).values())  # a block's norms and biases
    vh_grad = head_weight_grad_bytes(spec, act)

    def all_gather(group: str) -> None:
        w.alloc("temporaries", copy_in[group])
        w.alloc("temporaries", gathered[group])
        w.free("temporaries", copy_in[group])

    def reduce_scatter(group: str, unsharded_grad_bytes: int, held: int) -> int:
        """A group's post-backward: reshard, release the held input, pack, free, reduce-scatter.

        FSDP2's foreach_reduce frees the unsharded gradients once they are packed, all but its
        last tensor's, which a loop variable keeps until the function returns."""
        last_rows, last_length = param_shapes(spec)[group][-1]
        last = last_rows * last_length * c
        w.free("weights", gathered[group])  # unsharded parameters
        w.free("temporaries", held)  # the previous group's reduce-scatter input
        w.alloc("temporaries", rs_input[group])
        w.free("gradients", unsharded_grad_bytes - last)
        w.alloc("gradients" if first_micro else "temporaries", sharded_grad[group])
        w.alloc("temporaries", gloo_copy[group])  # gloo's flat copy of the input, while it reduces
        w.free("temporaries", gloo_copy[group])
        if not first_micro:  # added into the sharded gradients of the earlier micro-batches, then freed
            w.free("temporaries", sharded_grad[group])
        w.free("gradients", last)
        return rs_input[group]

    # persistent state
    w.alloc("weights", fsdp_sharded_weight_bytes(spec, setup) + rope_buffer_bytes(spec, act), "start of step")
    w.alloc("optimizer", fsdp_optimizer_state_bytes(spec, setup, rank))
    if not first_micro:
        w.alloc("gradients", fsdp_all_sharded_grad_bytes(spec, setup))
    w.alloc("activations", input_bytes(spec, setup))
    w.mark("start of forward")

    # ---- forward
    w.where = "forward: root all-gather"
    all_gather("root")
    w.alloc("weights", gathered["root"])  # copied out; the output is kept until block 0's copy-out
    w.where = "forward: embedding"
    w.alloc("activations", rope_cast_bytes(spec, act) + causal_mask_bytes(spec, act))
    w.alloc("activations", n * hidden * a)  # token embeddings (the residual stream is 16-bit)
    if spec.pos == "learned":
        w.alloc("activations", act.ctx * hidden * a)
        w.alloc("activations", n * hidden * a)
        w.free("activations", n * hidden * a + act.ctx * hidden * a)
    stored = saved_per_layer_bytes(spec, act, gqa_repeat)
    w.where = "forward: block all-gather"
    all_gather("block")  # block 0
    w.alloc("weights", gathered["block"])
    w.free("temporaries", gathered["root"])  # released when the copy-out returns
    if spec.layers > 1:  # blocks 0 … L-2: each forward, reshard and the next all-gather alike
        w.free("weights", gathered["block"])
        w.alloc("activations", (spec.layers - 1) * stored)
        all_gather("block")  # the last block's, the one before still held
        w.alloc("weights", gathered["block"])
        w.free("temporaries", gathered["block"])
    _block_forward(w, spec, act, mode, gqa_repeat)
    w.free("weights", gathered["block"])  # resharded after forward
    w.where = "forward: final norm and LM head"
    head_in = _norm_forward(w, spec, act)
    w.alloc("logits", logits_bytes(spec, act))
    w.free("temporaries", gathered["block"])  # the root's forward ends: the last all-gather output released
    w.where = "forward: loss"
    if a != FP32_BYTES:
        w.alloc("logits", fp32_logits_bytes(spec, act))  # logits.float()
    w.alloc("logits", fp32_logits_bytes(spec, act))  # log-softmax, saved
    if a != FP32_BYTES:
        w.free("logits", fp32_logits_bytes(spec, act))
    w.free("logits", logits_bytes(spec, act))
    w.mark("end of forward")

    # ---- backward: loss, LM head, final norm
    w.phase = "backward"
    w.where = "backward: loss"
    w.alloc("logits", fp32_logits_bytes(spec, act))
    w.alloc("logits", fp32_logits_bytes(spec, act))
    w.free("logits", 2 * fp32_logits_bytes(spec, act))
    if a != FP32_BYTES:
        w.alloc("logits", logits_bytes(spec, act))
        w.free("logits", fp32_logits_bytes(spec, act))
    w.where = "backward: last block's all-gather (prefetch)"
    all_gather("block")
    w.where = "backward: LM head"
    w.alloc("temporaries", n * hidden * a)  # input gradient
    w.alloc("temporaries", spec.vocab * hidden * a)  # weight gradient
    w.free("activations", head_in)
    w.free("logits", logits_bytes(spec, act) if a != FP32_BYTES else fp32_logits_bytes(spec, act))
    w.free("temporaries", vh_grad)
    w.alloc("gradients", vh_grad)  # unsharded (tied: in autograd's buffer until the embedding's arrives)
    w.where = "backward: final norm"
    grad = _norm_backward(w, spec, act, n * hidden * a)
    w.alloc("gradients", spec.norm_params * c)
    w.free("activations", n * hidden * a)  # the last block's output

    held = 0  # the reduce-scatter input FSDP2 keeps in flight

    def block_backward(grad: int, which: str, prefetch: bool) -> int:
        nonlocal held
        w.where = f"backward: the {which} block's copy-out"
        w.alloc("weights", gathered["block"])
        w.free("temporaries", gathered["block"])
        if prefetch:
            w.where = f"backward: all-gather of the block before the {which}"
            all_gather("block")
        if ckpt:
            w.where = f"backward: recomputing the {which} block"
            _block_forward(w, spec, act, "recompute", gqa_repeat)
        w.mark(f"start of the {which} block's backward")
        grad = _block_backward(w, spec, act, grad, gqa_repeat)
        if act.checkpointing == "selective":
            w.free("activations", n * hidden * a)
        w.alloc("gradients", vectors * c)  # its norms' (and biases') gradients
        w.where = f"backward: the {which} block's reduce-scatter"
        held = reduce_scatter("block", spec.layer_params * c, held)
        return grad

    # The last block prefetches the one before it and holds no reduce-scatter input yet; the
    # first prefetches nothing (the root is still unsharded); the blocks in between do both and
    # are alike, so the peak over them is at the second block from either end.
    L = spec.layers
    grad = block_backward(grad, "last", prefetch=L > 1)
    if L >= 3:
        grad = block_backward(grad, "second-to-last", prefetch=True)
    middle = L - 4
    if middle > 0:  # each frees what it kept and leaves its sharded gradients
        w.free("activations", middle * stored)
        if first_micro:
            w.alloc("gradients", middle * sharded_grad["block"])
    if L >= 4:
        grad = block_backward(grad, "second", prefetch=True)
    if L > 1:
        grad = block_backward(grad, "first", prefetch=False)

    # ---- backward: embeddings, then the root's reduce-scatter
    w.where = "backward: embedding"
    if spec.pos == "learned":
        pos_grad = spec.max_positions * hidden * c
        w.alloc("temporaries", act.ctx * hidden * a)
        w.alloc("gradients", pos_grad)
        w.free("temporaries", act.ctx * hidden * a)
    w.alloc("temporaries", vh_grad)  # embedding_dense_backward
    w.free("temporaries", grad)
    if spec.tied:
        w.alloc("temporaries", vh_grad)  # head + embedding, summed out of place
        w.free("temporaries", vh_grad)
        w.free("gradients", vh_grad)
        w.alloc("gradients", vh_grad)
        w.free("temporaries", vh_grad)
    else:
        w.free("temporaries", vh_grad)
        w.alloc("gradients", vh_grad)
    w.free("activations", rope_cast_bytes(spec, act) + causal_mask_bytes(spec, act))
    w.where = "backward: the root's reduce-scatter"
    held = reduce_scatter("root", root_params * c, held)
    w.free("temporaries", held)  # released when the backward ends
    w.mark("end of backward")

    # ---- optimizer step
    w.phase = "optimizer"
    w.where = "optimizer step"
    w.alloc("temporaries", fsdp_optimizer_temporary_bytes(spec, setup, rank))
    w.free("temporaries", fsdp_optimizer_temporary_bytes(spec, setup, rank))
    return w


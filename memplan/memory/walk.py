"""One walk of a training step: live bytes by category through its allocations and frees, op by op.

``walk_step`` walks one steady-state step (its last micro-batch) in order (``_StepWalk``): the forward of
the last block, the loss, the LM head's and final norm's backward, the last block's backward (after its
recomputation under checkpointing), the first block's backward, the embedding's, and the optimizer step,
allocating and freeing the terms of ``memplan.memory.terms`` as PyTorch does. The largest live total on
the way is peak_allocated; where it happened is peak_phase. Blocks between the walked ones are not
walked one by one: each holds the same tensors, so live memory changes linearly from one to the next
and the peak over them is at one of the two ends.

The sequence is walked once, for every layout and every code: three kinds of hooks add what differs.

- the sharding hook (``memplan.memory.sharding``: ``Replicated`` for one process and DDP, ``FullyShard``
  for an FSDP2 rank): the persistent state, the all-gathers and reduce-scatters, where gradients live;
- the LoRA hooks (``memplan.memory.lora``): the adapters' forward and backward, the frozen matmuls;
- the stack's hooks (``memplan.memory.stacks.Stack``): the tensors transformers', litgpt's or torchtune's
  code saves beyond memplan's own.

What a block's forward keeps is its checkpointing policy (``BlockPass``).
"""

from __future__ import annotations

from dataclasses import dataclass

import memplan.memory.compiled as compiled
import memplan.memory.lora as lora
from memplan.memory.ledger import CATEGORIES, Moment, _StepWalk  # noqa: F401  (walk.Moment: callers import it here)
from memplan.memory.sharding import Replicated
from memplan.memory.terms import (LOWP_WEIGHT_BYTES, NORM_BACKWARD_FP32_BUFFERS, NORM_FORWARD_FP32_BUFFERS,
                                  _layer_matrices, act_bytes, attention_output_copy_bytes, attention_scores_bytes,
                                  attn_dropout_saved_bytes, block_dropout_saved_bytes, causal_mask_bytes,
                                  cpu_math_attention, embd_dropout_mask_bytes, math_attention_shapes, resid_dropout_mask_bytes, eager_kv_bytes, eager_q_bytes, fp32_logits_bytes,
                                  head_weight_grad_bytes, input_bytes, layer_lowp_weight_bytes, logits_bytes,
                                  mlp_inner_bytes, mlp_up_bytes, norm_output_bytes, norm_stat_bytes,
                                  qkv_output_bytes, residual_bytes_per_element, rope_buffer_bytes, rope_cast_bytes,
                                  rotated_k_bytes, rotated_q_bytes, saved_per_layer_bytes, sdpa_logsumexp_bytes,
                                  sdpa_output_bytes, sdpa_repeated_kv_bytes, stack_adapter_state_bytes, tokens)
from memplan.model import ModelSpec
from memplan.setup import FP32_BYTES, TrainSetup
from memplan.memory.stacks import MEMPLAN, Stack

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


# ---- a block's forward, by checkpointing policy ------------------------------------------------

@dataclass(frozen=True)
class BlockPass:
    """What one pass of a block's forward keeps: the checkpointing policy of ``trainer/model.py``.

    ``forward_pass`` gives the step's forward (none: what autograd saves; selective: the outputs of the
    matmuls and of attention; full: nothing, the caller keeps the block's input), ``recompute_pass``
    the recomputation a checkpointed block's backward starts with (non-reentrant checkpointing rebuilds
    what autograd saves and stops once the down matmul's input exists; under selective the kept outputs
    are reused, not recomputed)."""

    keeps_saved: bool  # what autograd saves stays (no checkpointing; a recomputation)
    keeps_outputs: bool  # the matmuls' and attention's outputs stay (selective checkpointing's forward)
    reuses_outputs: bool  # those outputs exist already and are not made again (selective's recomputation)
    saves_adapters: bool  # the adapters' x·Aᵀ and weight casts stay (all but full checkpointing's forward)
    recomputes: bool  # inside the backward: stops once the down matmul's input exists

    @staticmethod
    def forward_pass(checkpointing: str) -> BlockPass:
        """The step's forward under ``checkpointing`` (none | selective | full)."""
        return BlockPass(keeps_saved=checkpointing == "none", keeps_outputs=checkpointing == "selective",
                         reuses_outputs=False, saves_adapters=checkpointing != "full", recomputes=False)

    @staticmethod
    def recompute_pass(checkpointing: str) -> BlockPass:
        """The recomputation in a block's backward under ``checkpointing`` (selective | full)."""
        return BlockPass(keeps_saved=True, keeps_outputs=False, reuses_outputs=checkpointing == "selective",
                         saves_adapters=True, recomputes=True)


class _BlockForward:
    """One block's forward, each tensor allocated where it is made and freed where its last user is done,
    kept or not as the pass (``BlockPass``) says. The block input is live before. Afterwards the block's
    output (n·H·r) is live too, except after a recomputation."""

    def __init__(self, w: _StepWalk, spec: ModelSpec, setup: TrainSetup, p: BlockPass, gqa_repeat: bool):
        self.w, self.spec, self.setup, self.p, self.gqa_repeat = w, spec, setup, p, gqa_repeat
        self.n, self.a, self.r = tokens(setup), act_bytes(setup), residual_bytes_per_element(setup)
        self.cpu = w.stack.cpu  # dropout masks as the CPU makes them
        # SDPA's math path on the CPU under attention dropout: the T×T scores, as eager attention
        self.math = cpu_math_attention(spec, setup, self.cpu)
        self.eager = setup.attention == "eager" or self.math

    def resid_dropout(self, out: int) -> int:
        """A residual dropout over a projection's output (``out`` bytes, live; GPT-2's ``resid_dropout``): its
        mask, kept where autograd's saved tensors are, and its output, which replaces the projection's."""
        mask = resid_dropout_mask_bytes(self.spec, self.setup, self.cpu)
        if not self.spec.resid_dropout:
            return out
        self.make(mask)
        dropped = self.make(out)
        self.drop(out, self.p.keeps_outputs)
        self.drop(mask, self.p.keeps_saved)
        return dropped

    def make(self, nbytes: int, reused: bool = False) -> int:
        """A tensor made (unless the pass reuses it) and its bytes."""
        if not reused:
            self.w.alloc("activations", nbytes)
        return nbytes

    def drop(self, nbytes: int, keep: bool) -> None:
        """A tensor's last user is done: freed unless it is kept."""
        if not keep:
            self.w.free("activations", nbytes)

    def weight_copy(self, matrix: str) -> None:
        """Under autocast, the matmul weight's bf16 copy (cached, saved)."""
        if self.setup.mixed:
            self.w.alloc("weights", _layer_matrices(self.spec)[matrix] * LOWP_WEIGHT_BYTES)

    def adapter(self, matrix: str) -> None:
        """LoRA on ``matrix`` (the LoRA hook); nothing without an adapter."""
        lora.adapter_forward(self.w, self.spec, self.setup, matrix, self.p.saves_adapters, self.p.keeps_outputs)

    def norm(self) -> int:
        """A norm, its statistics kept if autograd's saved tensors are; its output's bytes."""
        out = _norm_forward(self.w, self.spec, self.setup)
        if self.p.keeps_saved:  # the stack's norm saves its own (memplan.memory.stacks): 0 for memplan
            self.w.alloc("activations", self.w.stack.norm_saved_bytes(self.spec, self.setup))
        self.drop(norm_stat_bytes(self.spec, self.setup), self.p.keeps_saved)
        return out

    def normed_linear(self, matrix: str, out_bytes: int) -> int:
        """A norm and the matmul that reads it (``qkv`` or ``up``, with its adapter); the norm's output is kept
        only where that matmul saves its input. Returns the matmul output's bytes."""
        norm_out = self.norm()
        self.weight_copy(matrix)
        out = self.make(out_bytes, self.p.reuses_outputs)
        self.adapter(matrix)
        self.drop(norm_out, self.p.keeps_saved and lora.saves_input(self.setup, matrix))
        return out

    def run(self) -> None:
        spec, setup, p, w = self.spec, self.setup, self.p, self.w
        w.where = "block forward: attention"
        qkv = self.normed_linear("qkv", qkv_output_bytes(spec, setup))
        if p.keeps_saved:  # the stack's per-head q/k norms save their own (memplan.memory.stacks): 0 for memplan
            w.alloc("activations", w.stack.qk_norm_saved_bytes(spec, setup))
        q_rot = self.make(rotated_q_bytes(spec, setup))
        k_rot = self.make(rotated_k_bytes(spec, setup))
        held = w.stack.rotary_held_bytes(spec, setup)  # a stack's own rotary outputs, to the out-projection
        w.alloc("activations", held)
        w.alloc("temporaries", w.stack.rotary_transient_bytes(spec, setup))  # its qk norms' and rotary's at once
        w.free("temporaries", w.stack.rotary_transient_bytes(spec, setup))
        if self.math:
            proj_in = self.math_attention(qkv, q_rot + k_rot)
        elif self.eager:
            proj_in = self.eager_attention(qkv, q_rot + k_rot)
        elif sdpa_repeated_kv_bytes(spec, setup, self.gqa_repeat):
            proj_in = self.sdpa_repeated(qkv, q_rot, k_rot)
        else:
            proj_in = self.sdpa(qkv, q_rot + k_rot)
        if p.keeps_saved:  # the stack's attention saves its own (memplan.memory.stacks): 0 for memplan
            w.alloc("activations", w.stack.attention_saved_bytes(spec, setup))
        w.where = "block forward: output projection"
        self.weight_copy("proj")
        o = self.make(self.n * spec.hidden * self.a, p.reuses_outputs)  # out-projection output
        self.adapter("proj")
        w.free("activations", held)  # the attention's forward returns
        if not self.eager:
            self.drop(proj_in, p.keeps_saved or p.keeps_outputs)
        else:
            self.drop(proj_in, p.keeps_saved and lora.saves_input(setup, "proj"))
        keep_o = p.keeps_outputs and not spec.resid_dropout  # (the dropout released it, or kept it, itself)
        o = self.resid_dropout(o)
        x_mid = self.make(self.n * spec.hidden * self.r)  # x + attention (parallel: a partial sum nothing saves)
        self.drop(o, keep_o)
        self.mlp(x_mid)

    def sdpa(self, qkv: int, rotated: int) -> int:
        """SDPA on q, k, v as they are; its output (the projection's input)."""
        spec, setup, p = self.spec, self.setup, self.p
        out = self.make(sdpa_output_bytes(spec, setup) + sdpa_logsumexp_bytes(spec, setup), p.reuses_outputs)
        self.drop(rotated, p.keeps_saved)
        self.drop(qkv, p.keeps_saved or p.keeps_outputs)
        return out

    def sdpa_repeated(self, qkv: int, q_rot: int, k_rot: int) -> int:
        """K and V repeated to every head, then SDPA; its output (the projection's input)."""
        spec, setup, p = self.spec, self.setup, self.p
        repeated = self.make(sdpa_repeated_kv_bytes(spec, setup, self.gqa_repeat))
        self.drop(k_rot, False)
        out = self.make(sdpa_output_bytes(spec, setup) + sdpa_logsumexp_bytes(spec, setup), p.reuses_outputs)
        self.drop(q_rot + repeated, p.keeps_saved)
        self.drop(qkv, p.keeps_outputs or (p.keeps_saved and spec.pos != "rope"))
        return out

    def math_attention(self, qkv: int, rotated: int) -> int:
        """SDPA's math path on the CPU under attention dropout, in fp32 (``terms.math_attention_shapes``): q, k,
        v cast up and repeated to every head, q·√s and k·√s, the scores, softmax, the dropout's noise and
        output, the product with v (cast back), transposed back to (B, T, q_dim); the projection's input."""
        spec, setup, p = self.spec, self.setup, self.p
        t = math_attention_shapes(spec, setup)
        self.make(t["casts"])
        self.drop(rotated, False)  # the rotated q and k, read by the casts (or the scaling)
        self.make(t["repeated"])
        q, k = self.make(t["q"]), self.make(t["k"])
        self.make(t["v"])  # v as the second bmm saves it: a contiguous copy
        self.drop(t["casts"] + t["repeated"], False)
        self.make(t["scores"])  # q·kᵀ, the causal mask added in place
        probs = self.make(t["scores"])  # softmax, saved
        self.drop(t["scores"], False)
        dropout = self.make(2 * t["scores"])  # the noise and the dropped probabilities, saved
        self.drop(qkv, p.keeps_outputs)
        out = self.make(t["out"])
        if self.a != FP32_BYTES:
            self.make(self.n * spec.q_dim * self.a)  # cast back to the inputs' dtype
            self.drop(out, False)
            out = self.n * spec.q_dim * self.a
        proj_in = self.make(attention_output_copy_bytes(spec, setup))  # transposed back to (B, T, q_dim)
        self.drop(out, False)
        self.drop(q + k + t["v"] + probs + dropout, p.keeps_saved)
        return proj_in

    def eager_attention(self, qkv: int, rotated: int) -> int:
        """Eager attention: contiguous copies, q·kᵀ, softmax, probs·v transposed back; the projection's input."""
        spec, setup, p = self.spec, self.setup, self.p
        scores = attention_scores_bytes(spec, setup)
        q = self.make(eager_q_bytes(spec, setup))  # contiguous copies for the matmuls
        k = self.make(eager_kv_bytes(spec, setup))
        self.drop(rotated, False)
        self.make(scores)  # q·kᵀ, scaled and masked in place; recomputed even when the probabilities are reused
        probs = self.make(scores, p.reuses_outputs)
        self.drop(scores, False)
        dropout = attn_dropout_saved_bytes(spec, setup, self.cpu)  # its mask and the dropped probabilities
        self.make(dropout)
        v = self.make(eager_kv_bytes(spec, setup))
        self.drop(qkv, p.keeps_outputs)
        pv = self.make(self.n * spec.q_dim * self.a)  # probs·v, (B, heads, T, hd)
        proj_in = self.make(attention_output_copy_bytes(spec, setup))  # transposed back to (B, T, q_dim)
        self.drop(pv, False)
        self.drop(q + k + v, p.keeps_saved)
        self.drop(probs, p.keeps_saved or p.keeps_outputs)
        self.drop(dropout, p.keeps_saved)
        return proj_in

    def mlp(self, x_mid: int) -> None:
        """The MLP's norm, up, activation (and product), down, and the block's output."""
        spec, setup, p, w = self.spec, self.setup, self.p, self.w
        w.where = "block forward: MLP"
        up = self.normed_linear("up", mlp_up_bytes(spec, setup))
        if w.compiled:  # compiled under full checkpointing: silu's fp32 chain (memplan.memory.compiled)
            gate32 = self.make(compiled.compiled_gate_fp32_bytes(spec, setup))
            w.alloc("temporaries", compiled.compiled_silu_fp32_transient_bytes(spec, setup))
            w.free("temporaries", compiled.compiled_silu_fp32_transient_bytes(spec, setup))
            self.drop(gate32, p.recomputes)  # the recomputation keeps it for silu's backward
        fused = compiled.compiled_silu_unsaved_bytes(spec, setup) if w.compiled and p.keeps_saved else 0
        inner = self.make(mlp_inner_bytes(spec, setup) - fused)  # silu(gate) (compiled: fused away), or gelu(up)
        if spec.mlp == "swiglu":
            inner += self.make(mlp_inner_bytes(spec, setup))  # silu(gate)·up
        self.weight_copy("down")
        if p.keeps_saved:  # the stack's own saved tensors beyond memplan's (memplan.memory.stacks): 0 for memplan
            made = sum(w.stack.adapter_saved_bytes(spec, setup, m) for m in setup.lora)  # made by the adapters
            made += w.stack.attention_saved_bytes(spec, setup) + 2 * w.stack.norm_saved_bytes(spec, setup)  # attention, norms
            made += w.stack.qk_norm_saved_bytes(spec, setup)  # the per-head q/k norms
            w.alloc("activations", w.stack.block_saved_bytes(spec, setup) - made)
        if p.recomputes:
            self.stop(x_mid)
        else:
            self.down(x_mid, up, inner)

    def stop(self, x_mid: int) -> None:
        """A recomputation stops here: everything the backward needs exists. Where a stack's adapter on down
        saves past this point (peft's lora_B saves lora_A's output: ``Stack.recompute_reaches_down_adapter``),
        the recomputation runs on into that adapter and stops there (``lora.adapter_recompute_stop``)."""
        if self.spec.parallel_residual:
            self.w.free("activations", x_mid)  # the partial sum dies with the interrupted forward
        if not lora.saves_input(self.setup, "down"):  # a frozen down matmul without an adapter keeps none of its input
            self.w.free("activations", mlp_inner_bytes(self.spec, self.setup))
        if self.w.stack.recompute_reaches_down_adapter(self.setup):  # a stack's recomputation runs on into down's adapter
            lora.adapter_recompute_stop(self.w, self.spec, self.setup, "down")

    def down(self, x_mid: int, up: int, inner: int) -> None:
        """The down projection and the block's output; what the pass does not keep is released."""
        spec, setup, p, w = self.spec, self.setup, self.p, self.w
        d = self.make(self.n * spec.hidden * self.a)  # down-projection output
        self.adapter("down")
        if p.keeps_saved and not lora.saves_input(setup, "down"):
            w.free("activations", mlp_inner_bytes(spec, setup))
            inner -= mlp_inner_bytes(spec, setup)
        keep_d = p.keeps_outputs and not spec.resid_dropout
        d = self.resid_dropout(d)
        self.make(self.n * spec.hidden * self.r)  # the block's output
        self.drop(d, keep_d)
        self.drop(x_mid, p.keeps_saved and not spec.parallel_residual)
        self.drop(inner, p.keeps_saved)
        self.drop(up, p.keeps_saved or p.keeps_outputs)


def _block_forward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, p: BlockPass, gqa_repeat: bool = False) -> None:
    """One block's forward under the pass ``p`` (``BlockPass``), op by op (``_BlockForward``)."""
    _BlockForward(w, spec, setup, p, gqa_repeat).run()


# ---- a block's backward --------------------------------------------------------------------------

def _linear_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, weight_elems: int, grad_in_bytes: int,
                     saved_input_bytes: int, input_grad_bytes: int, input_cast: bool, matrix: str = "",
                     needs_input_grad: bool = True) -> None:
    """A matmul's backward: the input's gradient and the weight's gradient, then the saved input
    and the weight copy are released. Under autocast the weight gradient is computed in bf16
    and cast to fp32 (and, if the input was cast from fp32, the input gradient too). With
    gradient accumulation (or under DDP, whose buckets hold the gradients) the new weight
    gradient is added into ``.grad`` and freed; otherwise it becomes ``.grad``. Under LoRA:
    the LoRA hook, ``lora.linear_backward``."""
    if setup.lora_rank:
        lora.linear_backward(w, spec, setup, matrix, weight_elems, grad_in_bytes, saved_input_bytes,
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


def _stack_norm_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, held: int, stack_saved: bool) -> None:
    """What a stack's own RMSNorm backward holds at once beyond the ``held`` bytes of memplan's fused norm
    (its buffers and the incoming gradient), made and freed at that moment: ``Stack.norm_backward_bytes``
    (transformers' Python RMSNorm; 0 for memplan). ``stack_saved``: the walk still holds what the stack's
    norm saved (``Stack.block_saved_bytes``, ``Stack.final_norm_saved_bytes``)."""
    extra = w.stack.norm_backward_bytes(spec, setup, held, stack_saved)
    if extra:
        w.alloc("temporaries", extra)
        w.free("temporaries", extra)


def _norm_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, grad_in_bytes: int,
                   stack_saved: bool = True) -> int:
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
            _stack_norm_backward(w, spec, setup, work + n * hidden * FP32_BYTES + grad_in_bytes, stack_saved)
            w.free("temporaries", n * hidden * FP32_BYTES)
        else:
            _stack_norm_backward(w, spec, setup, work + grad_in_bytes, stack_saved)
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


def _resid_dropout_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, g_in: int) -> int:
    """A residual dropout's backward (grad·mask/(1 − p), a new n·H·a gradient, ``g_in`` released); its mask
    released. Returns the gradient the projection's backward takes (``g_in`` without the dropout)."""
    if not spec.resid_dropout:
        return g_in
    out = tokens(setup) * spec.hidden * act_bytes(setup)
    w.alloc("temporaries", out)
    w.free("temporaries", g_in)
    w.free("activations", resid_dropout_mask_bytes(spec, setup, w.stack.cpu))
    return out


def _eager_attention_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, dq: int, dkv: int) -> None:
    """Eager attention's backward, from the projection's input gradient (``dq``, live) to q's, k's and v's
    gradients (dq + 2·dkv, live): probs·v, the attention dropout, softmax, the mask, the scaling, q·kᵀ."""
    scores = attention_scores_bytes(spec, setup)
    kv_copy = eager_kv_bytes(spec, setup)
    w.alloc("temporaries", dq)  # the output gradient, contiguous in (B, heads, T, hd)
    w.free("temporaries", dq)  # ... replaces the projection's input gradient
    w.alloc("temporaries", kv_copy + scores)  # probs·v backward: dv, dprobs
    w.free("activations", kv_copy)  # v
    w.free("temporaries", dq)
    dropout = attn_dropout_saved_bytes(spec, setup, w.stack.cpu)
    if dropout:  # the dropout's backward: dprobs = d(dropped)·mask/(1 − p); its mask and output released
        w.alloc("temporaries", scores)
        w.free("temporaries", scores)
        w.free("activations", dropout)
    w.alloc("temporaries", scores)  # softmax backward
    softmax = w.stack.softmax_backward_bytes(spec, setup)  # a stack's fp32 softmax backward
    w.alloc("temporaries", softmax)
    w.free("temporaries", softmax)
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


def _math_attention_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, dq: int, dkv: int) -> None:
    """SDPA's math path backward (``_BlockForward.math_attention``), from the projection's input gradient
    (``dq``, live) to q's, k's and v's gradients (dq + 2·dkv, live), in fp32 between the casts."""
    t, f = math_attention_shapes(spec, setup), FP32_BYTES
    s = t["scores"]
    g = dq
    if act_bytes(setup) != f:  # the cast back's backward
        w.alloc("temporaries", t["out"])
        w.free("temporaries", dq)
        g = t["out"]
    w.alloc("temporaries", s + t["kv_w"])  # the second bmm's backward: d(dropped), dv
    w.free("temporaries", g)
    w.free("activations", s + t["v"])  # the dropped probabilities and v as saved
    w.alloc("temporaries", s)  # the dropout's backward: d(probs) = d(dropped)·noise
    w.free("temporaries", s)
    w.free("activations", s)  # the noise
    w.alloc("temporaries", s)  # softmax's backward
    w.free("temporaries", s)
    w.free("activations", s)  # softmax's output
    w.alloc("temporaries", t["q"] + t["k"])  # the first bmm's backward: d(q·√s), d(k·√s)
    w.free("temporaries", s)
    w.free("activations", t["q"] + t["k"])
    w.alloc("temporaries", t["q"] + t["k"])  # the scaling's backward
    w.free("temporaries", t["q"] + t["k"])
    if t["repeated"]:  # repeat_interleave's backward sums the groups
        w.alloc("temporaries", 2 * t["kv_w"] // spec.heads * spec.kv_heads)
        w.free("temporaries", 2 * t["kv_w"])
    fp32_grads = t["q"] + 2 * t["kv_w"] // spec.heads * spec.kv_heads if t["repeated"] else t["q"] + 2 * t["kv_w"]
    w.alloc("temporaries", dq + 2 * dkv)  # cast to the inputs' dtype (a copy in fp32 too: the same size)
    w.free("temporaries", fp32_grads)


def _compiled_silu_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, gate32: int) -> None:
    """SwiGLU's backward in the compiled step's backward graph under full checkpointing with a 16-bit branch,
    from the down matmul's input gradient dh (n·F·a, live) to the fused gate|up gradient (live), op by op as the
    partitioned graph runs it: dh·silu(g) (up's gradient) and dh·up; silu's output gradient cast to fp32; then
    sigmoid(g) and the product beside the fp32 gate (``compiled.compiled_gate_fp32_bytes``, made by the
    recomputation) — the step's peak; silu's input gradient cast back and concatenated with up's."""
    inner, up = mlp_inner_bytes(spec, setup), mlp_up_bytes(spec, setup)
    chain = compiled.compiled_silu_fp32_transient_bytes(spec, setup)
    w.alloc("temporaries", 2 * inner)  # dh·silu(g), dh·up
    w.free("temporaries", inner)  # dh
    w.free("activations", inner)  # silu(g), 16-bit
    w.alloc("temporaries", gate32)  # dh·up cast to fp32
    w.free("temporaries", inner)  # dh·up, 16-bit
    w.free("activations", up)  # gate|up: its last reader is done
    w.alloc("temporaries", chain)  # sigmoid(g) and the product
    w.free("temporaries", gate32 + chain)
    w.free("activations", gate32)  # the fp32 gate, read last by silu's backward
    w.alloc("temporaries", inner)  # silu's input gradient, cast back
    w.alloc("temporaries", up)  # concatenated with up's: the fused gradient
    w.free("temporaries", 2 * inner)


def _mlp_activation_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, inner: int) -> None:
    """The MLP's activation backward, between down's and up's: from the gradient of the activation's output
    (``inner`` bytes) to the gradient of up's output, releasing what the activation saved (silu(gate) and
    gate|up for SwiGLU; gelu's input otherwise)."""
    gate32 = compiled.compiled_gate_fp32_bytes(spec, setup) if w.compiled else 0
    if gate32:  # compiled under full checkpointing, 16-bit: silu's backward through fp32 buffers
        _compiled_silu_backward(w, spec, setup, gate32)
    elif spec.mlp == "swiglu":
        recomputed = compiled.compiled_silu_unsaved_bytes(spec, setup) if w.compiled else 0
        w.alloc("temporaries", recomputed)  # compiled: silu(gate) recomputed from the saved gate
        w.alloc("temporaries", 2 * inner)  # gradients of silu(gate) and of up
        w.free("temporaries", inner)  # the product's gradient
        w.free("activations", inner - recomputed)  # silu(gate)
        w.free("temporaries", recomputed)
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


def _block_backward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, grad_bytes: int,
                    gqa_repeat: bool = False, first: bool = False) -> int:
    """One block's backward, op by op, from the gradient of its output (``grad_bytes``, live)
    to the gradient of its input (returned, live). Releases everything the block saved."""
    n, hidden, a = tokens(setup), spec.hidden, act_bytes(setup)
    r = residual_bytes_per_element(setup)
    m = _layer_matrices(spec)
    inner = mlp_inner_bytes(spec, setup)
    branch_cast = r != a  # fp32 residual, bf16 branch: the gradient is cast for the branch
    cpu = w.stack.cpu
    math = cpu_math_attention(spec, setup, cpu)  # SDPA's math path on the CPU (attention dropout)
    eager = setup.attention == "eager" or math

    w.where = "block backward: MLP"
    g_branch = grad_bytes
    if branch_cast:
        g_branch = n * hidden * a
        w.alloc("temporaries", g_branch)
    # down: input gradient n·F·a
    _linear_backward(w, spec, setup, m["down"], _resid_dropout_backward(w, spec, setup, g_branch if branch_cast else 0), inner, inner,
                     input_cast=False, matrix="down")
    _mlp_activation_backward(w, spec, setup, inner)
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
    proj_saved = attention_output_copy_bytes(spec, setup) if eager else 0
    _linear_backward(w, spec, setup, m["proj"], _resid_dropout_backward(w, spec, setup, g_branch if branch_cast else 0), proj_saved,
                     n * spec.q_dim * a, input_cast=False, matrix="proj")
    dq, dkv = n * spec.q_dim * a, n * spec.kv_dim * a
    repeated = sdpa_repeated_kv_bytes(spec, setup, gqa_repeat)
    if not eager and repeated:
        w.alloc("temporaries", dq + repeated)  # dq and the repeated dk, dv
        w.free("temporaries", dq)  # the projection's input gradient
        w.free("activations", sdpa_output_bytes(spec, setup) + sdpa_logsumexp_bytes(spec, setup)
               + rotated_q_bytes(spec, setup) + repeated + (qkv_output_bytes(spec, setup) if spec.pos != "rope" else 0))
        w.alloc("temporaries", 2 * dkv)  # repeat_interleave backward sums the groups
        w.free("temporaries", repeated)
    elif math:
        _math_attention_backward(w, spec, setup, dq, dkv)
    elif not eager:
        w.alloc("temporaries", dq + 2 * dkv)
        w.free("temporaries", dq)  # the projection's input gradient
        w.free("activations", sdpa_output_bytes(spec, setup) + sdpa_logsumexp_bytes(spec, setup)
               + rotated_q_bytes(spec, setup) + rotated_k_bytes(spec, setup) + qkv_output_bytes(spec, setup))
    else:
        _eager_attention_backward(w, spec, setup, dq, dkv)
    if spec.pos == "rope":
        w.alloc("temporaries", dkv)  # k rotated back
        w.free("temporaries", dkv)
        w.alloc("temporaries", dq)  # q rotated back
        w.free("temporaries", dq)
        qk_norms = w.stack.qk_norm_backward_bytes(spec, setup)  # a stack's per-head q/k norms' backward
        w.alloc("temporaries", qk_norms)
        w.free("temporaries", qk_norms)
    w.alloc("temporaries", qkv_output_bytes(spec, setup))  # the three gradients concatenated
    w.free("temporaries", dq + 2 * dkv)
    released = sum(r[0] for r in (w.stack.lora_input_release(spec, setup, mm) for mm in ("qkv", "proj", "up", "down")) if r)
    w.free("activations", w.stack.block_saved_bytes(spec, setup) - released)  # the stack's own, released by now
    frozen_below = bool(setup.lora_rank) and first  # LoRA: nothing below the first block's qkv trains
    _linear_backward(w, spec, setup, m["qkv"], qkv_output_bytes(spec, setup), norm_output_bytes(spec, setup),
                     n * hidden * a, input_cast=setup.mixed, matrix="qkv", needs_input_grad=not frozen_below)
    if frozen_below:  # the block input and norm statistics were never saved (_Step.first_unsaved)
        w.free("temporaries", pending + grad_bytes)
        return 0
    w.where = "block backward: norm"
    part = _norm_backward(w, spec, setup, g_norm, stack_saved=False)  # (the stack's own saved tensors are gone)
    w.free("activations", n * hidden * r)  # the block input, saved by the first norm
    w.alloc("temporaries", n * hidden * r)  # its gradient: the residual's and the norms' summed
    w.free("temporaries", part + pending + grad_bytes)
    return n * hidden * r


# ---- the step ------------------------------------------------------------------------------------

_NAMES = {-1: "last", -2: "second-to-last", 0: "first", 1: "second"}


def _walked_blocks(layers: int, ends: int) -> tuple[list[tuple[int, str]], list[tuple[int, str]], int]:
    """The blocks the backward walks one by one, ``ends`` at each end of the stack (from the last down): those
    before the blocks in between, those after, and how many are in between. A block is named by its place
    (last, second-to-last, first, second), the last and the first first."""
    top = [i for i in range(layers - 1, max(layers - 1 - ends, -1), -1)]
    bottom = [i for i in range(min(ends, layers) - 1, -1, -1) if i not in top]

    def name(i: int) -> str:
        return next(_NAMES[k] for k in (-1, 0, -2, 1) if (k if k >= 0 else layers + k) == i)

    return [(i, name(i)) for i in top], [(i, name(i)) for i in bottom], layers - len(top) - len(bottom)


class _Step:
    """One steady-state step (its last micro-batch), walked phase by phase (``walk_step``).

    ``spec`` and ``setup`` are the model and step the stack's code builds and takes; ``cs``, the setup the
    activations follow (the sharding hook's ``compute_setup``: the step's own, or FSDP2's 16-bit one)."""

    def __init__(self, spec: ModelSpec, setup: TrainSetup, gqa_repeat: bool, stack: Stack, sharding: Replicated):
        self.spec, self.setup, self.gqa, self.stack, self.sh = spec, setup, gqa_repeat, stack, sharding
        cs = self.cs = sharding.compute_setup
        self.w = _StepWalk(spec, setup, stack)
        self.w.gradients_persist = sharding.block_gradients_persist
        self.n, self.a, self.r = tokens(cs), act_bytes(cs), residual_bytes_per_element(cs)
        self.accum = sharding.accum  # .grad exists before this backward
        self.lora = bool(cs.lora_rank) and sharding.lora_outside_blocks  # the head and embedding frozen
        self.ckpt = cs.checkpointing != "none"
        self.forward_policy = cs.checkpointing  # what the blocks' forward keeps (BlockPass.forward_pass)
        self.vh_grad = head_weight_grad_bytes(spec, cs) if not self.lora else 0
        self.extra_adapters = stack.lora_bytes_delta(spec, cs)  # e.g. peft's separate q, k, v adapters, in fp32
        self.lowp = layer_lowp_weight_bytes(spec, cs)
        # what each earlier block left alive: its saved tensors (its input included) and, under
        # autocast, its weight copies (saved, or cached until the forward ends under checkpointing)
        self.stored = saved_per_layer_bytes(spec, cs, gqa_repeat) - (self.lowp if not self.ckpt else 0)
        if not self.ckpt:
            self.stored += stack.block_saved_bytes(spec, cs) + block_dropout_saved_bytes(spec, cs, stack.cpu)
        # LoRA without checkpointing: the first block saves nothing before its first adapter (its input
        # and the weights before are frozen), memplan's tensors, the stack's, and autocast's weight copies
        self.first_unsaved = self.first_copies = 0
        if sharding.lora_outside_blocks:
            self.first_unsaved = lora.first_block_unsaved_bytes(spec, cs, gqa_repeat, stack)
            self.first_copies = lora.first_block_weight_copy_bytes(spec, cs)
        # torch.compile (memplan.memory.compiled): what inductor's partitioner saves less, where it is modelled
        self.w.compiled = compiled.compiled_modelled(spec, cs, stack) is None
        self.first_residual = 0
        if self.w.compiled:
            self.stored -= compiled.compiled_silu_unsaved_bytes(spec, cs)
            self.first_residual = compiled.compiled_first_residual_unsaved_bytes(spec, cs)
            self.first_unsaved += self.first_residual - compiled.compiled_first_silu_unsaved_bytes(spec, cs)

    def persistent_state(self) -> None:
        """Weights, buffers, optimizer state, gradients that outlive the step, and the step's inputs."""
        w, spec, cs, stack = self.w, self.spec, self.cs, self.stack
        w.alloc("weights", self.sh.weight_bytes() + rope_buffer_bytes(spec, cs), "start of step")
        w.alloc("weights", stack.buffer_bytes_delta(spec, cs))  # a stack's own rotary tables
        w.alloc("optimizer", self.sh.optimizer_state_bytes())
        extra = self.sh.stack_adapter_bytes(self.extra_adapters)  # (an FSDP2 rank's: its shard)
        w.alloc("weights", extra)
        w.alloc("optimizer", stack_adapter_state_bytes(cs, extra, stack.lora_tensors_delta(spec, cs)))
        self.sh.persistent_gradients(w, self.extra_adapters)
        w.alloc("activations", input_bytes(spec, self.setup))
        w.mark("start of forward")

    def embedding_forward(self) -> None:
        """Token embeddings (plus learned positions), RoPE's cast tables, eager attention's mask."""
        w, spec, cs, n, r = self.w, self.spec, self.cs, self.n, self.r
        self.sh.before_embedding(w)
        w.where = "forward: embedding"
        w.alloc("activations", rope_cast_bytes(spec, cs) + causal_mask_bytes(spec, cs))
        w.alloc("activations", n * spec.hidden * r)  # token embeddings
        if spec.pos == "learned":
            w.alloc("activations", cs.ctx * spec.hidden * r)
            w.alloc("activations", n * spec.hidden * r)  # + positions
            w.free("activations", n * spec.hidden * r + cs.ctx * spec.hidden * r)
        if spec.embd_dropout:  # its mask (saved where the embedding trains), its output in place of the sum
            w.alloc("activations", embd_dropout_mask_bytes(spec, cs, self.stack.cpu) + n * spec.hidden * r)
            w.free("activations", n * spec.hidden * r)

    def blocks_forward(self) -> None:
        """The blocks before the last, as what they leave alive, then the last block op by op."""
        w, spec, L = self.w, self.spec, self.spec.layers
        self.sh.before_blocks_forward(w)
        if L > 1:
            self.sh.between_blocks_forward(w)
            w.alloc("activations", (L - 1) * self.stored - self.first_unsaved)
            w.alloc("weights", (L - 1) * self.lowp - self.first_copies)
            self.sh.before_last_block_forward(w)
        _block_forward(w, spec, self.cs, BlockPass.forward_pass(self.forward_policy), self.gqa)
        self.sh.after_block_forward(w)
        if L == 1:  # the one block walked is the first: what it made and does not save goes now
            w.free("activations", self.first_unsaved)
            w.free("weights", self.first_copies)

    def head_forward(self) -> None:
        """The final norm and the LM head; leaving autocast frees the cached copies nothing saved."""
        w, spec, cs, stack = self.w, self.spec, self.cs, self.stack
        w.where = "forward: final norm and LM head"
        self.head_in = _norm_forward(w, spec, cs)
        w.alloc("activations", stack.final_norm_saved_bytes(spec, cs))
        if cs.mixed:
            w.alloc("weights", spec.vocab * spec.hidden * LOWP_WEIGHT_BYTES)
            w.alloc("weights", stack.head_weight_casts_bytes(spec, cs))  # a frozen head in chunks: one per chunk
        w.alloc("logits", logits_bytes(spec, cs))
        self.head_input_held = lora.head_input_held(w, spec, cs)
        self.head_adapter = self.lora and lora.head_adapter_forward(w, spec, cs)  # its A saves head_in
        if self.lora and not self.head_adapter:  # the head's weight is frozen: its input is not saved
            w.free("activations", self.head_in)
        if self.ckpt and cs.mixed:
            w.free("weights", spec.layers * layer_lowp_weight_bytes(spec, cs))
        self.sh.after_head_forward(w)

    def loss_forward(self) -> None:
        """Cross-entropy: the logits' fp32 copy (``logits.float()``), the saved log-probabilities."""
        w, spec, cs, stack = self.w, self.spec, self.cs, self.stack
        w.where = "forward: loss"
        self.loss = fp32_logits_bytes(spec, cs) if stack.fp32_loss else logits_bytes(spec, cs)
        self.upcast = stack.fp32_loss and self.a != FP32_BYTES
        if self.upcast:
            w.alloc("logits", fp32_logits_bytes(spec, cs))  # logits.float()
        converted = self.upcast and stack.upcasts_output  # the model returned the fp32 copy: its own logits go
        if converted:
            w.free("logits", logits_bytes(spec, cs))
        w.alloc("logits", stack.chunked_upcast_bytes(spec, cs))  # a loss upcasting chunk by chunk (≤ 0)
        w.alloc("logits", self.loss)  # log-softmax, saved
        w.free("logits", stack.chunked_upcast_bytes(spec, cs))
        if self.upcast:
            w.free("logits", fp32_logits_bytes(spec, cs))
        if not converted:
            w.free("logits", logits_bytes(spec, cs))  # `del logits`: log_softmax saved its output only
        w.alloc("logits", stack.held_logits_bytes(spec, cs))  # logits a stack's loop keeps to the step's end
        w.free("activations", getattr(self, "head_input_held", 0))  # the model's forward has returned
        w.mark("end of forward")

    def loss_backward(self) -> None:
        """The gradients of the log-probabilities and of the logits (cast back when upcast)."""
        w, spec, cs, stack, loss = self.w, self.spec, self.cs, self.stack, self.loss
        w.phase = "backward"
        w.where = "backward: loss"
        w.alloc("logits", stack.chunked_loss_backward_bytes(spec, cs))  # a chunked loss's freed log-probs (≤ 0)
        w.alloc("logits", loss)  # gradient of the log-probabilities
        w.alloc("logits", loss)  # gradient of the logits (fp32 when upcast)
        w.free("logits", 2 * loss)
        w.free("logits", stack.chunked_loss_backward_bytes(spec, cs))
        if self.upcast and stack.logits_grad_chunks(spec, cs) > 1:  # each chunk cast back on its own: the
            w.free("logits", fp32_logits_bytes(spec, cs))  # whole fp32 gradient and its cast never live at once
            w.alloc("logits", logits_bytes(spec, cs))
        elif self.upcast:
            w.alloc("logits", logits_bytes(spec, cs))
            w.free("logits", fp32_logits_bytes(spec, cs))

    def head_backward(self) -> None:
        """The LM head's input and weight gradients (none for a frozen head), then the final norm's backward."""
        w, spec, cs, stack, n, a = self.w, self.spec, self.cs, self.stack, self.n, self.a
        self.sh.before_head_backward(w)
        w.where = "backward: LM head"
        head_grad = spec.vocab * spec.hidden if not self.lora else 0
        adapter_grad = lora.head_adapter_backward(w, spec, cs, self.head_in, n * spec.hidden * a) \
            if self.head_adapter else 0
        w.alloc("temporaries", n * spec.hidden * a)  # input gradient
        if adapter_grad:  # ... summed with the head adapter's
            w.alloc("temporaries", n * spec.hidden * a)
            w.free("temporaries", 2 * n * spec.hidden * a)
        w.alloc("temporaries", head_grad * a)  # weight gradient in the compute dtype
        w.alloc("temporaries", stack.chunked_head_grad_bytes(spec, cs))  # a head run in chunks: its sums
        w.free("temporaries", stack.chunked_head_grad_bytes(spec, cs))
        if not self.lora:
            w.free("activations", self.head_in)
        w.free("logits", logits_bytes(spec, cs) if a != FP32_BYTES else fp32_logits_bytes(spec, cs))
        self.sh.after_head_chunks(w, stack.chunked_head_grad_bytes(spec, cs))  # a stack's FSDP2: the last chunk
        if cs.mixed:
            w.free("weights", spec.vocab * spec.hidden * LOWP_WEIGHT_BYTES + stack.head_weight_casts_bytes(spec, cs))
            w.alloc("temporaries", n * spec.hidden * FP32_BYTES)  # the norm output's cast, backward
            w.free("temporaries", n * spec.hidden * a)
            w.alloc("temporaries", head_grad * FP32_BYTES)
            w.free("temporaries", head_grad * a)
        w.free("temporaries", self.vh_grad)
        if not self.accum or spec.tied:  # tied: waits in autograd's buffer for the embedding's gradient
            w.alloc("gradients", self.vh_grad)
        w.where = "backward: final norm"
        self.grad = _norm_backward(w, spec, cs, n * spec.hidden * (FP32_BYTES if cs.mixed else a))
        self.sh.after_final_norm_backward(w)
        w.free("activations", stack.final_norm_saved_bytes(spec, cs))
        w.free("activations", n * spec.hidden * self.r)  # the last block's output

    def block_backward(self, index: int, which: str) -> None:
        """One block's backward (after its recomputation under checkpointing), in the sharding hook's frame."""
        w, spec, cs = self.w, self.spec, self.cs
        self.sh.before_block_backward(w, which, index)
        if self.ckpt:
            w.where = f"backward: recomputing the {which} block"
            before = self.stack.recompute_gradient_bytes(spec, cs)  # a stack's gradients made before it: 0 for memplan
            w.alloc("temporaries", before)
            _block_forward(w, spec, cs, BlockPass.recompute_pass(cs.checkpointing), self.gqa)
            w.free("temporaries", before)
        w.mark(f"start of the {which} block's backward")
        first = (which == "first" or spec.layers == 1) and bool(self.first_unsaved)
        if first:  # compiled: the first block saved its projection's output for x + attention, freed as the sum
            w.alloc("activations", self.first_residual)
        self.grad = _block_backward(w, spec, cs, self.grad, self.gqa, first=first)
        if cs.checkpointing == "selective":  # kept outputs the recomputation never reached
            w.free("activations", self.n * spec.hidden * self.a)  # the down-projection's
        self.sh.after_block_backward(w, which)

    def blocks_backward(self) -> None:
        """The walked blocks from the last down; those in between release what they kept and leave gradients."""
        w, spec, cs = self.w, self.spec, self.cs
        top, bottom, middle = _walked_blocks(spec.layers, self.sh.ends)
        for index, which in top:
            self.block_backward(index, which)
        if middle > 0:
            w.free("activations", middle * self.stored)
            if not self.ckpt:  # (checkpointed blocks make and free their copies in their own backward)
                w.free("weights", middle * self.lowp)
            self.sh.middle_gradients(w, middle, lora.trained_block_elems(spec, cs) * cs.param_bytes)
        for index, which in bottom:
            self.block_backward(index, which)
        self.sh.after_blocks_backward(w, self.lora, self.extra_adapters)

    def embedding_backward(self) -> None:
        """The embedding's (and learned positions') gradients; nothing to do when frozen (LoRA)."""
        w, spec, cs = self.w, self.spec, self.cs
        w.where = "backward: embedding"
        if self.lora:
            w.free("temporaries", self.grad)
        else:
            mask = embd_dropout_mask_bytes(spec, cs, self.stack.cpu)
            if mask:  # the embedding dropout's backward: a new gradient, its mask released
                w.alloc("temporaries", self.grad)
                w.free("temporaries", self.grad)
                w.free("activations", mask)
            if spec.pos == "learned":
                self.position_backward()
            w.alloc("temporaries", self.vh_grad)  # embedding_dense_backward
            w.free("temporaries", self.grad)
            self.embedding_gradient()
        w.free("activations", rope_cast_bytes(spec, cs) + causal_mask_bytes(spec, cs))
        self.sh.after_embedding_backward(w)
        w.mark("end of backward")

    def position_backward(self) -> None:
        """The learned position table's gradient: summed over the batch, then ``.grad`` (or added into it)."""
        w, spec, cs, accum = self.w, self.spec, self.cs, self.accum
        pos_grad = spec.max_positions * spec.hidden * cs.param_bytes
        w.alloc("temporaries", cs.ctx * spec.hidden * self.r)  # summed over the batch
        w.alloc("gradients" if not accum else "temporaries", pos_grad)
        w.free("temporaries", cs.ctx * spec.hidden * self.r)
        if accum:
            w.free("temporaries", pos_grad)

    def embedding_gradient(self) -> None:
        """The embedding's gradient (``embedding_dense_backward``'s, live): tied, the head's part is summed in
        out of place; it becomes ``.grad`` or is added into it."""
        w, vh, accum = self.w, self.vh_grad, self.accum
        if self.spec.tied:
            w.alloc("temporaries", vh)  # head + embedding, summed out of place
            w.free("temporaries", vh)
            w.free("gradients", vh)  # the head's part, from autograd's buffer
            if not accum:
                w.alloc("gradients", vh)
            w.free("temporaries", vh)  # (added into .grad under accumulation)
        else:
            w.free("temporaries", vh)
            if not accum:
                w.alloc("gradients", vh)

    def optimizer_step(self) -> None:
        """The optimizer's scratch."""
        w = self.w
        w.phase = "optimizer"
        w.where = "optimizer step"
        scratch = self.sh.optimizer_temporary_bytes()
        if scratch:  # the foreach scratch of the adapters' group covers the stack's extra adapters too
            scratch += self.extra_adapters
        if not getattr(self.sh, "owns_stack_optimizer_scratch", False):  # (FSDP1's hook counts litgpt's own)
            scratch += self.stack.optimizer_scratch_bytes(self.spec, self.cs)  # a stack's own optimizer loop
        w.alloc("temporaries", scratch)
        w.free("temporaries", scratch)


def sharding_hook(spec: ModelSpec, setup: TrainSetup, stack: Stack = MEMPLAN, rank: int = 0,
                  collectives: str = "nccl") -> Replicated:
    """The sharding hook of ``setup``'s step: the stack's FSDP2 hook of ``rank`` under FSDP (``Stack.fsdp_hook``:
    ``FullyShard``, or the stack's own layout), else ``Replicated``."""
    if setup.sharding == "fsdp":
        return stack.fsdp_hook(spec, setup, rank, collectives)
    return Replicated(spec, setup, stack)


def walk_step(spec: ModelSpec, setup: TrainSetup, gqa_repeat: bool = False, stack: Stack = MEMPLAN, rank: int = 0,
              collectives: str = "nccl", sharding: Replicated | None = None) -> _StepWalk:
    """Walk one steady-state step (its last micro-batch) of ``rank`` and return the walk with its peak.

    ``gqa_repeat``: SDPA gets K/V repeated to every head (a device without a flash kernel for grouped-query
    attention; see ``sdpa_gqa_repeats``). ``stack``: whose code runs the step; its hooks (``memplan.memory.stacks``)
    add the tensors that code saves beyond memplan's own (FSDP2 with a stack whose ``Stack.shardings`` have it,
    memplan's and torchtune's; another's is walked as memplan's step). ``sharding``: the sharding hook (``sharding_hook``'s by default)."""
    if setup.sharding == "fsdp" and "fsdp" not in stack.shardings:
        stack = MEMPLAN
    spec, setup = stack.walked_spec(spec), stack.walked_setup(setup)  # as the stack's code builds and steps
    step = _Step(spec, setup, gqa_repeat, stack, sharding or sharding_hook(spec, setup, stack, rank, collectives))
    if step.lora and not step.cs.lora and not (step.ckpt and stack.checkpointed_input_needs_grad):
        # only the head adapted: nothing before it trains (_FrozenBlocksStep)
        step = _FrozenBlocksStep(spec, setup, gqa_repeat, stack, step.sh)
    for phase in (step.persistent_state, step.embedding_forward, step.blocks_forward, step.head_forward,
                  step.loss_forward, step.loss_backward, step.head_backward, step.blocks_backward,
                  step.embedding_backward, step.optimizer_step):
        phase()
    return step.w


class _FrozenBlocksStep(_Step):
    """A step whose only adapter is the LM head's (``--lora-targets head``): the embedding, every block and
    the final norm are frozen and their inputs need no gradient, so autograd saves nothing of them and
    the backward stops at the head adapter (``lora.head_adapter_backward`` without an input gradient).
    Each block frees its input once its output exists; autocast caches no cast of a frozen weight, so a
    matmul's weight copy lives for its matmul only (walked with the block, freed after it)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.forward_policy = "full"  # the last block walked as full checkpointing's forward walks one: nothing kept
        self.stored, self.first_unsaved = 0, 0  # the earlier blocks leave nothing ...
        self.first_copies = (self.spec.layers - 1) * self.lowp  # ... nor autocast's copies of their weights

    def blocks_forward(self) -> None:
        """The blocks, the last one's input and weight copies released after it."""
        super().blocks_forward()
        self.w.free("activations", self.n * self.spec.hidden * self.r)  # the block's input
        if self.cs.mixed:
            self.w.free("weights", self.lowp)

    def head_forward(self) -> None:
        """The final norm (its statistics and input released: nothing saves them) and the adapted head."""
        w, spec, cs = self.w, self.spec, self.cs
        w.where = "forward: final norm and LM head"
        self.head_in = _norm_forward(w, spec, cs)
        w.free("activations", norm_stat_bytes(spec, cs) + self.n * spec.hidden * self.r)
        if cs.mixed:  # the frozen head's matmul saves nothing: its weight's copy goes with it
            w.alloc("weights", spec.vocab * spec.hidden * LOWP_WEIGHT_BYTES)
        w.alloc("logits", logits_bytes(spec, cs))
        if cs.mixed:
            w.free("weights", spec.vocab * spec.hidden * LOWP_WEIGHT_BYTES)
        self.head_input_held = lora.head_input_held(w, spec, cs)
        self.head_adapter = lora.head_adapter_forward(w, spec, cs, frozen_input=True)
        self.sh.after_head_forward(w)

    def head_backward(self) -> None:
        """The head adapter's backward alone: no input gradient anywhere (nothing below trains)."""
        w, spec, cs = self.w, self.spec, self.cs
        self.sh.before_head_backward(w)
        w.where = "backward: LM head"
        lora.head_adapter_backward(w, spec, cs, self.head_in, 0, frozen_input=True)
        w.free("logits", logits_bytes(spec, cs) if self.a != FP32_BYTES else fp32_logits_bytes(spec, cs))

    def blocks_backward(self) -> None:
        """No block has a backward; a stack's extra adapter gradients (the head's) are made here."""
        self.sh.after_blocks_backward(self.w, self.lora, self.extra_adapters)

    def embedding_backward(self) -> None:
        """Nothing to do but release the rotary casts and the mask the blocks read."""
        w, spec, cs = self.w, self.spec, self.cs
        w.where = "backward: embedding"
        w.free("activations", rope_cast_bytes(spec, cs) + causal_mask_bytes(spec, cs))
        self.sh.after_embedding_backward(w)
        w.mark("end of backward")


def _walk_step(spec: ModelSpec, setup: TrainSetup, gqa_repeat: bool = False, stack: Stack = MEMPLAN) -> _StepWalk:
    """The walk of a single-process or DDP step (``walk_step``)."""
    return walk_step(spec, setup, gqa_repeat, stack)

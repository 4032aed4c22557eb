"""Memory of a training step: one small pure function per tensor, and a walk over the step that finds the peak.

Every term names the tensors of ``trainer/model.py`` and ``trainer/step.py`` it counts and returns
bytes. Notation in the docstrings: B micro-batch, T context, n = B·T tokens, H hidden, F ffn,
V vocab, L layers, kv = kv_heads·head_dim, h heads, a = bytes of an activation in the compute
dtype (2 under bf16/fp16, else 4), r = bytes of the residual stream (4 unless pure bf16),
p = bytes of a stored weight (2 under pure bf16, else 4).

``peak_memory`` walks one steady-state step in order (``_StepWalk``): the forward of the last
block, the loss, the LM head's and final norm's backward, the last block's backward (after its
recomputation under checkpointing), the first block's backward, the embedding's, and the
optimizer step, allocating and freeing these terms as PyTorch does. The largest live total on
the way is peak_allocated; where it happened is peak_phase. Blocks between the last and the
first are not walked one by one: each holds the same tensors, so live memory changes linearly
from one to the next and the peak over them is at one of the two ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.model import ModelSpec
from memplan.setup import FP32_BYTES, HALF_BYTES, LORA_TARGETS as LORA_MATRICES, TrainSetup
from memplan.stacks import MEMPLAN, Stack

INDEX_BYTES = 8  # token ids are int64
MASK_BYTES = 1  # torch.bool
ADAMW_STATES_PER_PARAM = 2  # exp_avg, exp_avg_sq
SGD_STATES_PER_PARAM = 1  # momentum_buffer
ADAM_STEP_BYTES = 4  # AdamW keeps a 0-dim fp32 `step` tensor per parameter tensor
BNB_BLOCK = 256  # bitsandbytes' 8-bit optimizers quantise states in blocks of 256 values ...
LOWP_WEIGHT_BYTES = HALF_BYTES  # autocast's cached bf16/fp16 copy of a matmul weight
NORM_BACKWARD_FP32_BUFFERS = 2  # RMSNorm backward: the normalised input and the scaled gradient, fp32
NORM_FORWARD_FP32_BUFFERS = 2  # RMSNorm forward: x², then x·rstd before the weight, fp32

COLLECTIVES = ("nccl", "gloo")  # process-group backends: NCCL (RCCL on ROCm), gloo (CPU)
COLLECTIVES_OF_FAMILY = {"cuda": "nccl", "rocm": "nccl", "cpu": "gloo", "mps": "gloo"}
CATEGORIES = ("weights", "gradients", "optimizer", "activations", "logits", "temporaries")


# ---- dtype sizes and shapes ----------------------------------------------------------------

def act_bytes(setup: TrainSetup) -> int:
    """a: bytes per activation element; matmul outputs are in the compute dtype."""
    return setup.compute_bytes


def residual_bytes_per_element(setup: TrainSetup) -> int:
    """r: the residual stream stays fp32 under autocast (fp32 embedding + bf16 branch → fp32)."""
    return HALF_BYTES if setup.precision == "bf16" else FP32_BYTES


def tokens(setup: TrainSetup) -> int:
    """n = B·T, tokens in one micro-batch."""
    return setup.micro_batch * setup.ctx


def _up_width(spec: ModelSpec) -> int:
    """Output width of the first MLP matmul: 2F for SwiGLU's fused gate|up, F for GELU."""
    return (2 if spec.mlp == "swiglu" else 1) * spec.ffn


def _qkv_width(spec: ModelSpec) -> int:
    """q, k and v together: q_dim + 2·kv (q_dim = heads·head_dim: H unless a config sets head_dim)."""
    return spec.q_dim + 2 * spec.kv_dim


def _layer_matrices(spec: ModelSpec) -> dict[str, int]:
    """Elements of each weight matrix in a block."""
    h = spec.hidden
    return {"qkv": h * _qkv_width(spec), "proj": spec.q_dim * h, "up": h * _up_width(spec), "down": spec.ffn * h}


# ---- LoRA ------------------------------------------------------------------------------------

def _matrix_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) of each block matrix."""
    h = spec.hidden
    return {"qkv": (h, _qkv_width(spec)), "proj": (spec.q_dim, h), "up": (h, _up_width(spec)), "down": (spec.ffn, h)}


def lora_matrix_params(spec: ModelSpec, setup: TrainSetup, matrix: str) -> int:
    """One adapter on one block matrix (in → out): A (r × in) and B (out × r), r·(in + out);
    0 if the matrix carries none (``trainer/lora.py``)."""
    if matrix not in setup.lora:
        return 0
    fan_in, fan_out = _matrix_shapes(spec)[matrix]
    return setup.lora_rank * (fan_in + fan_out)


def lora_params(spec: ModelSpec, setup: TrainSetup) -> int:
    """All adapters: layers × Σ over the targeted matrices of r·(in + out). 0 without LoRA."""
    return spec.layers * sum(lora_matrix_params(spec, setup, m) for m in setup.lora)


def lora_tensors(spec: ModelSpec, setup: TrainSetup) -> int:
    """Adapter parameter tensors (A and B per targeted matrix per block)."""
    return 2 * spec.layers * len(setup.lora)


def trainable_params(spec: ModelSpec, setup: TrainSetup) -> int:
    """Parameters that get gradients and optimizer state: all N, or under LoRA only the adapters."""
    return lora_params(spec, setup) if setup.lora_rank else spec.params


def lora_saved_bytes(spec: ModelSpec, setup: TrainSetup, matrix: str) -> int:
    """What one adapter saves for backward: x·Aᵀ (n·r·a, B's matmul input), plus under autocast
    the bf16 copies of A and B (r·(in + out)·2, cached and saved); under selective checkpointing
    also the adapter's output (x·Aᵀ)·Bᵀ (n·out·a: an mm output, which the policy keeps)."""
    if matrix not in setup.lora:
        return 0
    saved = tokens(setup) * setup.lora_rank * act_bytes(setup)
    if setup.mixed:
        saved += lora_matrix_params(spec, setup, matrix) * LOWP_WEIGHT_BYTES
    if setup.checkpointing == "selective":
        saved += tokens(setup) * _matrix_shapes(spec)[matrix][1] * act_bytes(setup)
    return saved


# ---- weights, gradients, optimizer ---------------------------------------------------------

def weight_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """All parameters in their storage dtype: N·p (fp32 master weights under mixed precision),
    plus LoRA's adapters (their parameters · p)."""
    return (spec.params + lora_params(spec, setup)) * setup.param_bytes


def rope_buffer_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """RoPE's cos and sin buffers, T × rotary_dim/2 each, fp32. 0 for learned positions."""
    return 2 * setup.ctx * (spec.rotary_dim // 2) * FP32_BYTES if spec.pos == "rope" else 0


def rope_cast_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The cos/sin tables cast to the compute dtype once per forward (saved by every rotary op);
    0 when the compute dtype is fp32."""
    if spec.pos != "rope" or act_bytes(setup) == FP32_BYTES:
        return 0
    return 2 * setup.ctx * (spec.rotary_dim // 2) * act_bytes(setup)


def lowp_weight_copy_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Autocast's low-precision copies of all matmul weights, matmul_params × 2 under
    bf16-mixed / fp16-mixed, else 0. Each matmul saves its copy for backward."""
    return spec.matmul_params * LOWP_WEIGHT_BYTES if setup.mixed else 0


def gradient_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """One gradient per trainable parameter, in the parameter's dtype: N·p (LoRA: the adapters' only)."""
    return trainable_params(spec, setup) * setup.param_bytes


def layer_gradient_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The gradients of one block's parameters: layer_params·p."""
    return spec.layer_params * setup.param_bytes


def decay_params(spec: ModelSpec) -> int:
    """Parameters in the weight-decay group: every matrix and the embeddings (norms and biases are not):
    N less each block's vectors (layer_params less its matrices), the final norm and phi's head bias."""
    vectors = spec.layer_params - sum(_layer_matrices(spec).values())
    return spec.params - spec.layers * vectors - spec.norm_params - (spec.vocab if spec.head_bias else 0)


def optimizer_state_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Optimizer state.

    - adamw, adamw-fused: exp_avg and exp_avg_sq in the parameter dtype (2·N·p), plus a
      0-dim fp32 ``step`` per parameter tensor.
    - sgd: momentum_buffer (N·p).
    - adamw8bit: two uint8 states per matrix element plus one fp32 absmax per 256-value block
      (bitsandbytes); norms and biases, under 4096 elements, keep fp32 states.

    Under LoRA only the adapters have state (frozen weights have none); 8-bit states for
    adapter matrices of 4096 elements and more, fp32 below.
    """
    n = trainable_params(spec, setup)
    n_tensors = lora_tensors(spec, setup) if setup.lora_rank else spec.n_tensors
    if setup.optimizer in ("adamw", "adamw-fused"):
        return ADAMW_STATES_PER_PARAM * n * setup.param_bytes + n_tensors * ADAM_STEP_BYTES
    if setup.optimizer == "sgd":
        return SGD_STATES_PER_PARAM * n * setup.param_bytes
    if setup.lora_rank:
        total = n_tensors * ADAM_STEP_BYTES
        for m in setup.lora:
            fan_in, fan_out = _matrix_shapes(spec)[m]
            for elems in (setup.lora_rank * fan_in, setup.lora_rank * fan_out):
                per = (elems + -(-elems // BNB_BLOCK) * FP32_BYTES) if elems >= 4096 else elems * FP32_BYTES
                total += spec.layers * ADAMW_STATES_PER_PARAM * per
        return total
    big = decay_params(spec)
    quantised = ADAMW_STATES_PER_PARAM * (big + -(-big // BNB_BLOCK) * FP32_BYTES)
    return quantised + ADAMW_STATES_PER_PARAM * (n - big) * FP32_BYTES + spec.n_tensors * ADAM_STEP_BYTES


def optimizer_temporary_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Scratch memory of the optimizer step.

    foreach AdamW computes ``sqrt(exp_avg_sq)`` for a whole parameter group at once
    (``torch._foreach_sqrt``): one parameter-sized temporary of the largest group, the
    weight-decay group. foreach SGD adds ``weight_decay·param`` to the gradients out of place
    (``torch._foreach_add``), the same size. The fused AdamW kernel and bitsandbytes' 8-bit
    kernel update in place: 0. Under LoRA the group is the adapters (all matrices).
    """
    if setup.optimizer in ("adamw", "sgd"):
        return (lora_params(spec, setup) if setup.lora_rank else decay_params(spec)) * setup.param_bytes
    return 0


def input_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Token ids and targets of all micro-batches of a step (int64): grad_accum · 2 · n · 8."""
    return setup.grad_accum * 2 * tokens(setup) * INDEX_BYTES


# ---- activations one block saves for backward ----------------------------------------------

def residual_stream_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The block's input (saved by the first norm) and, unless the residual is parallel, the
    stream after attention (saved by the second norm): n·H·r each."""
    copies = 1 if spec.parallel_residual else 2
    return copies * tokens(setup) * spec.hidden * residual_bytes_per_element(setup)


def norm_stat_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """One norm's per-token statistics: RMSNorm's rstd (n·4, fp32); LayerNorm's mean and rstd
    (2·n·r: the input's dtype on the CPU; CUDA keeps them fp32 under pure bf16)."""
    per_token = FP32_BYTES if spec.norm == "rmsnorm" else 2 * residual_bytes_per_element(setup)
    return per_token * tokens(setup)


def norm_output_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """A norm's output as the next matmul saves it, n·H·a (under autocast, the bf16 copy made
    for the matmul; the fp32 norm output itself is freed)."""
    return tokens(setup) * spec.hidden * act_bytes(setup)


def qkv_output_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The fused qkv matmul's output, n·(H + 2·kv)·a."""
    return tokens(setup) * _qkv_width(spec) * act_bytes(setup)


def rotated_q_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Rotary's output for q, n·q_dim·a (0 for learned positions)."""
    return tokens(setup) * spec.q_dim * act_bytes(setup) if spec.pos == "rope" else 0


def rotated_k_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Rotary's output for k, n·kv·a (0 for learned positions)."""
    return tokens(setup) * spec.kv_dim * act_bytes(setup) if spec.pos == "rope" else 0


def sdpa_output_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """SDPA's output, n·q_dim·a, in (B, T, heads, hd) layout, so the output projection saves a view of it."""
    return tokens(setup) * spec.q_dim * act_bytes(setup)


def sdpa_logsumexp_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """SDPA's log-sum-exp per head and query, fp32: n·heads·4."""
    return tokens(setup) * spec.heads * FP32_BYTES


def attention_scores_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Eager attention's T×T scores or probabilities for all heads: B·heads·T²·a."""
    return setup.micro_batch * spec.heads * setup.ctx * setup.ctx * act_bytes(setup)


def causal_mask_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Eager attention's boolean causal mask, T², made once per forward and shared by all blocks."""
    return setup.ctx * setup.ctx * MASK_BYTES if setup.attention == "eager" else 0


def eager_q_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The contiguous (B, heads, T, hd) copy of q that eager attention's first matmul makes and saves: n·q_dim·a."""
    return tokens(setup) * spec.q_dim * act_bytes(setup)


def eager_kv_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Eager attention's copy of k or of v, saved by its matmul: repeated to all heads under
    grouped-query attention (``repeat_interleave``, n·H·a), else a contiguous copy (n·kv·a)."""
    width = spec.q_dim if spec.kv_heads != spec.heads else spec.kv_dim
    return tokens(setup) * width * act_bytes(setup)


def sdpa_repeated_kv_bytes(spec: ModelSpec, setup: TrainSetup, gqa_repeat: bool) -> int:
    """K and V repeated to all heads for SDPA under grouped-query attention where no flash kernel
    takes them unrepeated (``Device.flash_attention``): 2·n·H·a, saved by SDPA instead of k
    and the qkv output."""
    if not gqa_repeat or setup.attention != "sdpa" or spec.kv_heads == spec.heads:
        return 0
    return 2 * tokens(setup) * spec.q_dim * act_bytes(setup)


def attention_output_copy_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Eager attention's output transposed back to (B, T, H), a contiguous copy saved by the
    output projection: n·q_dim·a."""
    return tokens(setup) * spec.q_dim * act_bytes(setup)


def mlp_up_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The first MLP matmul's output: SwiGLU's fused gate|up n·2F·a (its halves are saved by
    silu and the product), GELU's n·F·a (saved by gelu)."""
    return tokens(setup) * _up_width(spec) * act_bytes(setup)


def mlp_inner_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """One n·F·a MLP intermediate: silu(gate), the SwiGLU product, or gelu's output."""
    return tokens(setup) * spec.ffn * act_bytes(setup)


def layer_lowp_weight_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """One block's autocast weight copies: its matmul weights × 2 (mixed precision only)."""
    return sum(_layer_matrices(spec).values()) * LOWP_WEIGHT_BYTES if setup.mixed else 0


def layer_activation_terms(spec: ModelSpec, setup: TrainSetup, gqa_repeat: bool = False) -> dict[str, int]:
    """Everything one block saves for backward without checkpointing, by tensor."""
    terms = {
        "residual": residual_stream_bytes(spec, setup),
        "norm_stats": 2 * norm_stat_bytes(spec, setup),
        "norm_outputs": 2 * norm_output_bytes(spec, setup),
    }
    repeated = sdpa_repeated_kv_bytes(spec, setup, gqa_repeat)
    if setup.attention == "sdpa" and repeated:
        terms["qkv"] = qkv_output_bytes(spec, setup) if spec.pos != "rope" else 0
        terms["rotary"] = rotated_q_bytes(spec, setup)
        terms["repeated_kv"] = repeated
        terms["attention"] = sdpa_output_bytes(spec, setup) + sdpa_logsumexp_bytes(spec, setup)
    elif setup.attention == "sdpa":
        terms["qkv"] = qkv_output_bytes(spec, setup)
        terms["rotary"] = rotated_q_bytes(spec, setup) + rotated_k_bytes(spec, setup)
        terms["attention"] = sdpa_output_bytes(spec, setup) + sdpa_logsumexp_bytes(spec, setup)
    else:
        terms["attention_qkv_copies"] = eager_q_bytes(spec, setup) + 2 * eager_kv_bytes(spec, setup)
        terms["attention"] = attention_scores_bytes(spec, setup)
        terms["attention_output"] = attention_output_copy_bytes(spec, setup)
    inner = 2 if spec.mlp == "swiglu" else 1
    terms["mlp"] = mlp_up_bytes(spec, setup) + inner * mlp_inner_bytes(spec, setup)
    terms["lowp_weights"] = layer_lowp_weight_bytes(spec, setup)
    return terms


def block_input_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """A block's input, n·H·r: what full checkpointing keeps of a block."""
    return tokens(setup) * spec.hidden * residual_bytes_per_element(setup)


def selective_kept_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """What selective checkpointing keeps of a block besides its input: the outputs of its
    matmuls (qkv n·(H+2kv), out-projection n·H, MLP up, MLP down n·H) and of attention
    (SDPA's output and log-sum-exp, or eager attention's softmax probabilities)."""
    n, a = tokens(setup), act_bytes(setup)
    kept = qkv_output_bytes(spec, setup) + 2 * n * spec.hidden * a + mlp_up_bytes(spec, setup)
    if setup.attention == "sdpa":
        return kept + sdpa_output_bytes(spec, setup) + sdpa_logsumexp_bytes(spec, setup)
    return kept + attention_scores_bytes(spec, setup)


def saved_per_layer_bytes(spec: ModelSpec, setup: TrainSetup, gqa_repeat: bool = False) -> int:
    """What one block holds between its forward and its backward, by checkpointing mode."""
    if setup.checkpointing == "full":
        return block_input_bytes(spec, setup)
    adapters = sum(lora_saved_bytes(spec, setup, m) for m in setup.lora)
    if setup.checkpointing == "selective":
        return block_input_bytes(spec, setup) + selective_kept_bytes(spec, setup) + adapters
    return sum(layer_activation_terms(spec, setup, gqa_repeat).values()) + adapters - lora_unsaved_bytes(spec, setup)


def first_block_unsaved_bytes(spec: ModelSpec, setup: TrainSetup, gqa_repeat: bool = False) -> int:
    """Under LoRA without checkpointing, what the first block saves less than the others: nothing
    before it trains, so nothing is saved until the first adapter. Always its input and first
    norm's statistics (n·H·r + the norm's); without a qkv adapter also everything attention
    saves (except the output a proj adapter keeps); with neither a qkv nor a proj adapter also
    the second norm's input and statistics."""
    if not setup.lora_rank or setup.checkpointing != "none":
        return 0
    n, r = tokens(setup), residual_bytes_per_element(setup)
    out = n * spec.hidden * r + norm_stat_bytes(spec, setup)
    if "qkv" not in setup.lora:
        terms = layer_activation_terms(spec, setup, gqa_repeat)
        out += sum(terms.get(k, 0) for k in ("qkv", "rotary", "repeated_kv", "attention", "attention_qkv_copies"))
        if "proj" in setup.lora and setup.attention == "sdpa":  # the proj adapter keeps SDPA's output
            out -= sdpa_output_bytes(spec, setup)
        if "proj" not in setup.lora and not spec.parallel_residual:
            out += n * spec.hidden * r + norm_stat_bytes(spec, setup)
    return out + first_block_frozen_mlp_bytes(spec, setup)


def first_block_frozen_mlp_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Under LoRA without checkpointing, what the first block's MLP saves less when only its down
    matrix trains (no qkv, proj or up adapter): the MLP's input needs no gradient, so the up
    matmul's output (SwiGLU's gate and up, n·2F·a; GELU's input, n·F·a) is saved by neither the
    activation nor the product (SwiGLU's ``F.silu(gate) * up``, trainer/model.py; transformers'
    ``act_fn(gate_proj(x)) * up_proj(x)``, modeling_llama.py LlamaMLP.forward), nor is silu(gate);
    only down's input (SwiGLU's product, GELU's output), which the down adapter's A saves, stays:
    mlp_up + (inner − 1)·n·F·a. 0 where the MLP's input needs a gradient: up trains, or qkv or
    proj does in a sequential block (a parallel block's MLP, gpt_neox's, reads the frozen input)."""
    if not setup.lora_rank or setup.checkpointing != "none" or "up" in setup.lora:
        return 0
    if not spec.parallel_residual and {"qkv", "proj"} & set(setup.lora):
        return 0
    inner = 2 if spec.mlp == "swiglu" else 1
    return mlp_up_bytes(spec, setup) + (inner - 1) * mlp_inner_bytes(spec, setup)


def first_block_frozen_weight_copy_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Under LoRA without checkpointing and autocast, the bf16 weight copies the first block does
    not keep: autocast caches the cast of a leaf weight that requires grad only (``cached_cast``:
    ``arg.is_leaf() && arg.requires_grad()``), so a frozen matrix's copy lives on only where its
    matmul saves it, for its input's gradient; in the first block a matmul's input needs none
    until an adapter has run before it. qkv's copy is never kept there; proj's unless qkv trains;
    up's unless qkv or proj trains; down's unless one of qkv, proj, up trains: Σ weights·2 over
    those matrices. 0 without autocast."""
    if not setup.lora_rank or setup.checkpointing != "none" or not setup.mixed:
        return 0
    out, m = 0, _layer_matrices(spec)
    for i, matrix in enumerate(LORA_MATRICES):
        if not any(before in setup.lora for before in LORA_MATRICES[:i]):
            out += m[matrix] * LOWP_WEIGHT_BYTES
    return out


def lora_unsaved_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Under LoRA, the matmul inputs a block no longer saves: a frozen matrix without an adapter
    needs no input for backward (its weight gets no gradient). qkv's and up's: a norm output
    (n·H·a each); down's: the SwiGLU product or GELU output (n·F·a); proj's, under eager
    attention, the transposed attention output (n·H·a; SDPA saves its output itself)."""
    if not setup.lora_rank:
        return 0
    out = 0
    for matrix in LORA_MATRICES:
        if matrix in setup.lora:
            continue
        if matrix in ("qkv", "up"):
            out += norm_output_bytes(spec, setup)
        elif matrix == "down":
            out += mlp_inner_bytes(spec, setup)
        elif setup.attention == "eager":
            out += attention_output_copy_bytes(spec, setup)
    return out


# ---- the loss ------------------------------------------------------------------------------

def logits_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The LM head's output, n·V·a."""
    return tokens(setup) * spec.vocab * act_bytes(setup)


def fp32_logits_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """One fp32 (n, V) tensor of the loss: the logits' fp32 copy, the log-probabilities, or
    either's gradient: n·V·4. The loss is always computed in fp32."""
    return tokens(setup) * spec.vocab * FP32_BYTES


def head_weight_grad_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The LM head's (or tied embedding's) weight gradient, V·H·p."""
    return spec.vocab * spec.hidden * setup.param_bytes


# ---- data parallel: DDP's buckets -------------------------------------------------------

def ddp_bucket_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """DDP's gradient buckets, N·p: one flat tensor per bucket in the gradients' dtype, made
    when DDP wraps the model and kept for the whole run. With ``gradient_as_bucket_view`` (and
    ``zero_grad(set_to_none=False)``) every ``.grad`` is a view into them, so under DDP the
    gradients exist for the whole step, all-reduced in place; each new weight gradient of a
    backward is a temporary that is added into its view and freed, as under accumulation."""
    return spec.params * setup.param_bytes


def ddp_separate_bucket_bytes(spec: ModelSpec, setup: TrainSetup, extra_gradient_bytes: int = 0) -> int:
    """DDP's buckets where ``.grad`` is not a view into them (PyTorch's default,
    ``DistributedDataParallel(gradient_as_bucket_view=False)``, as transformers' Trainer wraps the
    model): a second gradient-sized buffer, one flat tensor per bucket of the trainable parameters
    (T·p, T = trainable_params, LoRA: the adapters, plus a stack's extra adapter bytes), kept for
    the whole run; each ``.grad`` is copied into its bucket for the all-reduce and copied back
    (``Reducer::copy_bucket_to_grad``)."""
    return trainable_params(spec, setup) * setup.param_bytes + extra_gradient_bytes


def gradients_persist(setup: TrainSetup) -> bool:
    """Whether ``.grad`` exists before a micro-batch's backward: under gradient accumulation (the
    earlier micro-batches') and under DDP (its buckets)."""
    return setup.grad_accum > 1 or setup.sharding == "ddp"


def stack_adapter_state_bytes(setup: TrainSetup, extra_bytes: int, extra_tensors: int) -> int:
    """Optimizer state of the adapter bytes a stack keeps beyond memplan's (``Stack.lora_bytes_delta``):
    AdamW's two moments (and a 0-dim fp32 ``step`` per extra tensor) or SGD's momentum, each the size of
    the parameters; adamw8bit's 8-bit states are left as memplan's."""
    if setup.optimizer in ("adamw", "adamw-fused"):
        return ADAMW_STATES_PER_PARAM * extra_bytes + extra_tensors * ADAM_STEP_BYTES
    if setup.optimizer == "sgd":
        return SGD_STATES_PER_PARAM * extra_bytes
    return 0


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


def _linear_forward(w: _StepWalk, spec: ModelSpec, setup: TrainSetup, matrix: str, out_bytes: int) -> None:
    """A matmul's forward: under autocast, its weight's bf16 copy (cached, saved), then its output."""
    if setup.mixed:
        w.alloc("weights", _layer_matrices(spec)[matrix] * LOWP_WEIGHT_BYTES)
    w.alloc("activations", out_bytes)


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
    first_copies = first_block_frozen_weight_copy_bytes(spec, setup)
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


# ---- FSDP2: shards, all-gathers and reduce-scatters ------------------------------------------
#
# trainer/distributed.py applies ``fully_shard`` to every block and then to the root (embedding,
# position table, final norm, untied head): L + 1 parameter groups, each sharded on dim 0 across
# the W ranks. Notation: c = bytes of an all-gathered parameter (FSDP2's param_dtype: 2 under
# bf16-mixed / fp16-mixed, else p), g = bytes of a reduced gradient (reduce_dtype: 4 under mixed
# precision, else p), pad(G) = Σ over G's tensors of ceil(rows/W)·row_length, the padded shard
# every rank stores, and local(G, rank) = the rows that rank really holds (rank 0 holds the
# most: ceil(rows/W); the last may hold fewer, even none).

def param_shapes(spec: ModelSpec) -> dict[str, list[tuple[int, int]]]:
    """(rows, row length) of every parameter tensor of one block and of the root, as
    trainer/model.py makes them: nn.Linear weights are (out, in), 1-D tensors are (n, 1)."""
    h = spec.hidden
    norm = [(h, 1)] * (2 if spec.norm == "layernorm" else 1)
    qkv, up = _qkv_width(spec), _up_width(spec)
    block = [*norm, (qkv, h)]
    if spec.bias or spec.qkv_bias:
        block.append((qkv, 1))
    block.append((h, h))
    if spec.bias:
        block.append((h, 1))
    block += [*norm, (up, h)]
    if spec.bias:
        block.append((up, 1))
    block.append((h, spec.ffn))
    if spec.bias:
        block.append((h, 1))
    root = [(spec.vocab, h)]
    if spec.pos == "learned":
        root.append((spec.max_positions, h))
    root += norm
    if not spec.tied:
        root.append((spec.vocab, h))
    return {"block": block, "root": root}


def shard_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of a dim-0 shard on ``rank``: torch.chunk's split, ceil(rows/W) each, the last ones short."""
    per = -(-rows // world_size)
    return max(0, min(per, rows - rank * per))


def padded_shard_numel(shapes: list[tuple[int, int]], world_size: int) -> int:
    """pad(G): the elements of a group's padded shard, Σ ceil(rows/W)·row_length; what every
    rank stores as its sharded parameters and what each rank sends to an all-gather."""
    return sum(-(-rows // world_size) * length for rows, length in shapes)


def local_shard_numel(shapes: list[tuple[int, int]], world_size: int, rank: int) -> int:
    """local(G, rank): the elements a rank's shard really holds (no padding); optimizer states
    are made like the sharded parameters' local tensors, so they have this size."""
    return sum(shard_rows(rows, world_size, rank) * length for rows, length in shapes)


def fsdp_gather_bytes(setup: TrainSetup) -> int:
    """c: bytes per all-gathered parameter element (FSDP2's param_dtype)."""
    return HALF_BYTES if setup.mixed else setup.param_bytes


def fsdp_reduce_bytes(setup: TrainSetup) -> int:
    """g: bytes per reduce-scattered gradient element (reduce_dtype fp32 under mixed precision)."""
    return FP32_BYTES if setup.mixed else setup.param_bytes


def fsdp_group_numel(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """pad(G) of a block or of the root."""
    return padded_shard_numel(param_shapes(spec)[group], setup.world_size)


def fsdp_sharded_weight_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Every rank's sharded parameters (fp32 master weights under mixed precision), padded:
    (L·pad(block) + pad(root))·p."""
    return (spec.layers * fsdp_group_numel(spec, setup, "block")
            + fsdp_group_numel(spec, setup, "root")) * setup.param_bytes


def fsdp_unsharded_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """A group's all-gathered parameters, W·pad(G)·c: once as the all-gather's output buffer,
    once more as the unsharded parameters copied out of it (each its own tensor)."""
    return setup.world_size * fsdp_group_numel(spec, setup, group) * fsdp_gather_bytes(setup)


def fsdp_copy_in_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """Under mixed precision, the shard cast to param_dtype for the all-gather, pad(G)·c (FSDP2's
    foreach copy-in); 0 otherwise (the shard itself is sent)."""
    return fsdp_group_numel(spec, setup, group) * fsdp_gather_bytes(setup) if setup.mixed else 0


def fsdp_reduce_scatter_input_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """A group's gradients packed for the reduce-scatter in the reduce dtype, W·pad(G)·g. FSDP2
    keeps it until the next group's reduce-scatter is issued (one in flight), the root's until
    the end of the backward."""
    return setup.world_size * fsdp_group_numel(spec, setup, group) * fsdp_reduce_bytes(setup)


def fsdp_sharded_grad_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """A group's reduce-scatter output, pad(G)·g: the sharded ``.grad`` of its parameters are
    views into it (under accumulation the next micro-batches' outputs are added in and freed)."""
    return fsdp_group_numel(spec, setup, group) * fsdp_reduce_bytes(setup)


def fsdp_all_sharded_grad_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """All sharded gradients, (L·pad(block) + pad(root))·g."""
    return (spec.layers * fsdp_sharded_grad_bytes(spec, setup, "block")
            + fsdp_sharded_grad_bytes(spec, setup, "root"))


def fsdp_local_params(spec: ModelSpec, setup: TrainSetup, rank: int, decay_only: bool = False) -> int:
    """Parameters whose shard ``rank`` holds (all, or only the weight-decay group: tensors of 2 dims)."""
    shapes = param_shapes(spec)
    pick = (lambda s: [t for t in s if t[1] > 1]) if decay_only else (lambda s: s)
    return (spec.layers * local_shard_numel(pick(shapes["block"]), setup.world_size, rank)
            + local_shard_numel(pick(shapes["root"]), setup.world_size, rank))


def fsdp_optimizer_state_bytes(spec: ModelSpec, setup: TrainSetup, rank: int = 0) -> int:
    """The optimizer state of ``rank``'s shards: as ``optimizer_state_bytes`` with local(rank)
    parameters (AdamW's 0-dim ``step`` per tensor stays whole)."""
    n = fsdp_local_params(spec, setup, rank)
    if setup.optimizer in ("adamw", "adamw-fused"):
        return ADAMW_STATES_PER_PARAM * n * setup.param_bytes + spec.n_tensors * ADAM_STEP_BYTES
    if setup.optimizer == "sgd":
        return SGD_STATES_PER_PARAM * n * setup.param_bytes
    raise ValueError("adamw8bit does not run under FSDP2")  # TrainSetup refuses the combination


def fsdp_optimizer_temporary_bytes(spec: ModelSpec, setup: TrainSetup, rank: int = 0) -> int:
    """The foreach optimizer's parameter-sized scratch over ``rank``'s shards of the weight-decay
    group (see ``optimizer_temporary_bytes``); 0 for the fused kernel."""
    if setup.optimizer in ("adamw", "sgd"):
        return fsdp_local_params(spec, setup, rank, decay_only=True) * setup.param_bytes
    return 0


def gloo_reduce_scatter_copy_bytes(spec: ModelSpec, setup: TrainSetup, group: str, collectives: str) -> int:
    """gloo (CPU) reduce-scatters a copy of its input, W·pad(G)·g, made and freed within the
    call; NCCL/RCCL work on the buffers they are given (their own staging is outside PyTorch's
    allocator). 0 unless ``collectives`` is gloo."""
    return fsdp_reduce_scatter_input_bytes(spec, setup, group) if collectives == "gloo" else 0


def fsdp_compute_setup(setup: TrainSetup) -> TrainSetup:
    """The setup the activations of an FSDP2 step follow. Under bf16-mixed / fp16-mixed the
    MixedPrecisionPolicy replaces autocast: the gathered parameters are 16-bit, so the embedding,
    the residual stream and every activation and unsharded gradient are too, as in a pure bf16
    step (fp16's sizes are bf16's). Walked as one micro-batch, without accumulation."""
    return setup.replace(precision="bf16" if setup.mixed else setup.precision, grad_accum=1, world_size=1,
                         sharding="none")


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

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("weights", "gradients", "optimizer", "activations", "logits",
                                              "temporaries", "runtime", "peak_allocated", "peak_reserved",
                                              "peak_phase")}


def activation_terms(spec: ModelSpec, setup: TrainSetup) -> dict[str, int]:
    """Activation terms of a step without checkpointing, for reports: per-layer terms × layers."""
    terms = {f"layer.{k}": v * spec.layers for k, v in layer_activation_terms(spec, setup).items()}
    terms["loss.fp32_logits"] = fp32_logits_bytes(spec, setup)
    terms["inputs"] = input_bytes(spec, setup)
    return terms


GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (mallopt(3))


def largest_transient_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The largest single tensor a step allocates and frees again: an fp32 (n, V) tensor of the loss,
    the logits, the LM head's weight gradient (set to None after every step), the MLP's up projection,
    or eager attention's scores."""
    sizes = [fp32_logits_bytes(spec, setup), logits_bytes(spec, setup), head_weight_grad_bytes(spec, setup),
             mlp_up_bytes(spec, setup)]
    if setup.attention == "eager":
        sizes.append(attention_scores_bytes(spec, setup))
    return max(sizes)


def glibc_heap_retention_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """CPU (glibc malloc): what the C heap keeps resident beyond the live tensors, 3·T with
    T = min(largest transient tensor, 32 MiB).

    glibc serves an allocation above M_MMAP_THRESHOLD with mmap and unmaps it on free, but each free
    of such a chunk raises the threshold to the chunk's size (at most DEFAULT_MMAP_THRESHOLD_MAX, 32 MiB
    on 64-bit) and the trim threshold to twice that (mallopt(3), "dynamic mmap threshold"). From the
    second step on, the step's transient tensors up to T come from the heap: its top keeps up to 2·T
    free without trimming, and a freed chunk of up to T stays stranded below a live one. Measured on
    CPU steps (benchmarks/local_memory.py): with MALLOC_MMAP_THRESHOLD_=131072 (the dynamic threshold
    off) the resident growth matched the live-tensor peak within 5%; with glibc's default it exceeded
    it by 74-134 MiB where T = 32 MiB (about 3·T), and by about 20 MiB where T = 4-16 MiB."""
    return 3 * min(largest_transient_bytes(spec, setup), GLIBC_MMAP_THRESHOLD_MAX)


def runtime_bytes(peak_allocated: int, runtime_context_bytes: int, allocator_overhead: float) -> int:
    """What the device's monitor shows beyond live tensors: the caching allocator's reserve
    (allocator_overhead × peak_allocated) and the runtime context (CUDA/HIP context, libraries)."""
    return int(peak_allocated * allocator_overhead) + int(runtime_context_bytes)


def sdpa_gqa_repeats(spec: ModelSpec, setup: TrainSetup, flash_attention: bool, family: str) -> bool:
    """Whether the reference model repeats K/V for SDPA: grouped-query attention where no flash
    kernel takes them as they are (the CPU's always does; CUDA/ROCm flash needs fp16/bf16)."""
    if setup.attention != "sdpa" or spec.kv_heads == spec.heads:
        return False
    if family == "cpu":
        return False
    return not (flash_attention and setup.compute_dtype in ("bf16", "fp16"))


def peak_memory(spec: ModelSpec, setup: TrainSetup, runtime_context_bytes: int = 0,
                allocator_overhead: float = 0.0, gqa_repeat: bool = False,
                collectives: str = "nccl", heap_retention: bool = False, stack: Stack = MEMPLAN) -> MemoryBreakdown:
    """The peak of a steady-state step, by category, with the runtime on top for peak_reserved.

    Under FSDP the step of rank 0, which holds the largest shards (every rank's within a few
    rows of it); ``peak_memory_of_rank`` gives any other rank's.
    """
    return peak_memory_of_rank(spec, setup, 0, runtime_context_bytes, allocator_overhead, gqa_repeat, collectives,
                               heap_retention, stack)


def peak_memory_of_rank(spec: ModelSpec, setup: TrainSetup, rank: int, runtime_context_bytes: int = 0,
                        allocator_overhead: float = 0.0, gqa_repeat: bool = False,
                        collectives: str = "nccl", heap_retention: bool = False,
                        stack: Stack = MEMPLAN) -> MemoryBreakdown:
    """``peak_memory`` of one rank (the ranks of a DDP or single-process step are alike).
    ``collectives``: the process group's backend, nccl (NVIDIA, and RCCL on ROCm) or gloo (CPU),
    which (under FSDP) allocates differently (``gloo_reduce_scatter_copy_bytes``). ``heap_retention``
    (a CPU: the process's resident memory is the peak) adds ``glibc_heap_retention_bytes`` to the runtime."""
    if collectives not in COLLECTIVES:
        raise ValueError(f"collectives {collectives!r} is not one of {COLLECTIVES}")
    if setup.sharding == "fsdp":
        w = _walk_fsdp_step(spec, setup, rank, collectives, gqa_repeat)
    else:
        w = _walk_step(spec, setup, gqa_repeat, stack)
    peak = w.peak
    runtime = runtime_bytes(peak.total, runtime_context_bytes, allocator_overhead)
    if heap_retention:
        runtime += glibc_heap_retention_bytes(spec, setup)
    return MemoryBreakdown(**peak.bytes, runtime=runtime, peak_allocated=peak.total,
                           peak_reserved=peak.total + runtime, peak_phase=peak.phase, peak_moment=peak.name,
                           moments=tuple(w.marks), terms=activation_terms(spec, setup))

"""The closed-form memory terms of a training step: one small pure function per tensor.

Every term names the tensors of ``trainer/model.py`` and ``trainer/step.py`` it counts and returns
bytes. Notation in the docstrings: B micro-batch, T context, n = B·T tokens, H hidden, F ffn,
V vocab, L layers, kv = kv_heads·head_dim, h heads, a = bytes of an activation in the compute
dtype (2 under bf16/fp16, else 4), r = bytes of the residual stream (4 unless pure bf16),
p = bytes of a stored weight (2 under pure bf16, else 4).

The walk (``memplan.memory.walk``) allocates and frees these terms in the order a step makes them;
the sharding terms (DDP's buckets, FSDP2's shards) are in ``memplan.memory.sharding``.
"""

from __future__ import annotations

from memplan.model import ModelSpec
from memplan.setup import FP32_BYTES, HALF_BYTES, LORA_TARGETS as LORA_MATRICES, TrainSetup

INDEX_BYTES = 8  # token ids are int64
MASK_BYTES = 1  # torch.bool
ADAMW_STATES_PER_PARAM = 2  # exp_avg, exp_avg_sq
SGD_STATES_PER_PARAM = 1  # momentum_buffer
ADAM_STEP_BYTES = 4  # AdamW keeps a 0-dim fp32 `step` tensor per parameter tensor
BNB_BLOCK = 256  # bitsandbytes' 8-bit optimizers quantise states in blocks of 256 values ...
LOWP_WEIGHT_BYTES = HALF_BYTES  # autocast's cached bf16/fp16 copy of a matmul weight
NORM_BACKWARD_FP32_BUFFERS = 2  # RMSNorm backward: the normalised input and the scaled gradient, fp32
NORM_FORWARD_FP32_BUFFERS = 2  # RMSNorm forward: x², then x·rstd before the weight, fp32


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
    """(in, out) of each block matrix, of the q, k and v slices of the fused qkv (heads·head_dim, then
    kv_heads·head_dim twice: ``trainer/model.py``), and of the LM head (H → V)."""
    h = spec.hidden
    return {"qkv": (h, _qkv_width(spec)), "proj": (spec.q_dim, h), "up": (h, _up_width(spec)), "down": (spec.ffn, h),
            "q": (h, spec.q_dim), "k": (h, spec.kv_dim), "v": (h, spec.kv_dim), "head": (h, spec.vocab)}


def lora_adapter_shapes(spec: ModelSpec, setup: TrainSetup, matrix: str) -> list[tuple[int, int]]:
    """(in, out) of each adapter on ``matrix`` (a block matrix, or ``head``), in the order the forward runs
    them (``trainer/lora.py``): one over the whole output, or on the fused qkv one per slice of q, k, v
    adapted alone (each its own A, r × H, and a B as tall as its slice). [] without one."""
    if matrix == "head":
        return [_matrix_shapes(spec)["head"]] if setup.lora_head else []
    if matrix not in setup.lora:
        return []
    names = [t for t in setup.lora_adapters if t == matrix or (matrix == "qkv" and t in ("q", "k", "v"))]
    return [_matrix_shapes(spec)[t] for t in names]


def lora_matrix_params(spec: ModelSpec, setup: TrainSetup, matrix: str) -> int:
    """The adapters on one block matrix (or the head), in → out each: A (r × in) and B (out × r), r·(in + out)
    per adapter (``lora_adapter_shapes``); 0 if the matrix carries none (``trainer/lora.py``)."""
    return sum(setup.lora_rank * (fan_in + fan_out) for fan_in, fan_out in lora_adapter_shapes(spec, setup, matrix))


def lora_params(spec: ModelSpec, setup: TrainSetup) -> int:
    """All adapters: layers × Σ over the targeted block matrices of their adapters' r·(in + out), plus the
    head's r·(H + V). 0 without LoRA."""
    return spec.layers * sum(lora_matrix_params(spec, setup, m) for m in setup.lora) + lora_head_params(spec, setup)


def lora_head_params(spec: ModelSpec, setup: TrainSetup) -> int:
    """The LM head's adapter (``--lora-targets head``): A (r × H) and B (V × r), r·(H + V); 0 without it."""
    return lora_matrix_params(spec, setup, "head")


def lora_tensors(spec: ModelSpec, setup: TrainSetup) -> int:
    """Adapter parameter tensors (A and B per adapter per block, and the head's two)."""
    return 2 * spec.layers * len(setup.lora_adapters) + (2 if setup.lora_head else 0)


def trainable_params(spec: ModelSpec, setup: TrainSetup) -> int:
    """Parameters that get gradients and optimizer state: all N, or under LoRA only the adapters."""
    return lora_params(spec, setup) if setup.lora_rank else spec.params


def input_gradient_sum_bytes(in_place: bool, input_grad_bytes: int) -> int:
    """The sum of a frozen matmul's input gradient and its adapter's (x feeds both the base matmul and lora_A),
    made by autograd's input buffer. memplan's ``LoRALinear`` (trainer/lora.py): the base's gradient is added
    into the adapter's in place (``InputBuffer::accumulate`` repurposes a buffer holding the only reference to
    its storage), making nothing; the FakeTensor traces show it. Other stacks' adapters (peft, litgpt,
    torchtune) keep the out-of-place sum, n·in·a, their walks were checked with (not re-traced here). ``in_place``:
    the stack's adapters sum in place (``Stack.sums_input_gradient_in_place``)."""
    return 0 if in_place else input_grad_bytes


def lora_input_casts_bytes(spec: ModelSpec, setup: TrainSetup, matrix: str) -> int:
    """Under autocast, the casts of the fp32 input that adapters on one matrix save beyond the first: q, k, v
    adapted alone each run ``F.linear(x, lora_a_<name>)`` (``trainer/lora.py``) on the fp32 norm output, and
    autocast casts an activation anew at every matmul (it caches only leaf weights' casts), each A saving its
    own bf16 copy: (k − 1)·n·H·2 for k adapters. 0 for one adapter or without autocast."""
    shapes = lora_adapter_shapes(spec, setup, matrix)
    if not setup.mixed or len(shapes) < 2 or residual_bytes_per_element(setup) == LOWP_WEIGHT_BYTES:
        return 0
    return (len(shapes) - 1) * tokens(setup) * shapes[0][0] * LOWP_WEIGHT_BYTES


def lora_saved_bytes(spec: ModelSpec, setup: TrainSetup, matrix: str) -> int:
    """What one adapter saves for backward: x·Aᵀ (n·r·a, B's matmul input), plus under autocast
    the bf16 copies of A and B (r·(in + out)·2, cached and saved); under selective checkpointing
    also the adapter's output (x·Aᵀ)·Bᵀ (n·out·a: an mm output, which the policy keeps)."""
    shapes = lora_adapter_shapes(spec, setup, matrix)  # q, k, v alone: each adapter its own x·Aᵀ and output
    saved = len(shapes) * tokens(setup) * setup.lora_rank * act_bytes(setup) + lora_input_casts_bytes(spec, setup, matrix)
    if setup.mixed:
        saved += lora_matrix_params(spec, setup, matrix) * LOWP_WEIGHT_BYTES
    if setup.checkpointing == "selective":
        saved += sum(tokens(setup) * fan_out * act_bytes(setup) for _, fan_out in shapes)
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
        shapes = [(spec.layers, s) for m in setup.lora for s in lora_adapter_shapes(spec, setup, m)]
        for count, (fan_in, fan_out) in shapes + [(1, s) for s in lora_adapter_shapes(spec, setup, "head")]:
            for elems in (setup.lora_rank * fan_in, setup.lora_rank * fan_out):
                per = (elems + -(-elems // BNB_BLOCK) * FP32_BYTES) if elems >= 4096 else elems * FP32_BYTES
                total += count * ADAMW_STATES_PER_PARAM * per
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
    those matrices. In a parallel block (gpt_neox's ``use_parallel_residual``, phi's shared norm) the MLP
    reads the frozen block input, not the attention's output: up's copy is never kept there, and down's
    unless up trains (Phi-2, bf16-mixed, LoRA on every matrix: fc1's copy, 10240 × 2560 × 2 = 52.4 MB,
    was counted). 0 without autocast."""
    if not setup.lora_rank or setup.checkpointing != "none" or not setup.mixed:
        return 0
    out, m = 0, _layer_matrices(spec)
    for i, matrix in enumerate(LORA_MATRICES):
        earlier = LORA_MATRICES[:i]
        if spec.parallel_residual and matrix in ("up", "down"):
            earlier = [before for before in earlier if before == "up"]
        if not any(before in setup.lora for before in earlier):
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


# ---- model dropout (ModelSpec.attn_dropout, resid_dropout, embd_dropout) -----------------------

def dropout_mask_bytes(elems: int, input_bytes: int, cpu: bool) -> int:
    """What one dropout saves for backward over ``elems`` elements of an input of ``input_bytes`` each.

    On an accelerator ATen's ``dropout`` runs the fused ``native_dropout`` (``is_fused_kernel_acceptable``:
    a CUDA tensor), which saves its bool mask: elems·1. On the CPU ``_dropout_impl`` makes ``noise =
    at::empty_like(input).bernoulli_(1 - p)``, divides it by 1 − p and returns ``input * noise``, whose
    backward keeps the noise in the input's dtype: elems·input_bytes. (The output is the next op's input,
    counted where that op saves it.)"""
    return elems * (input_bytes if cpu else MASK_BYTES)


def cpu_math_attention(spec: ModelSpec, setup: TrainSetup, cpu: bool) -> bool:
    """Whether SDPA runs its math path (explicit T×T scores, as eager attention): attention dropout in
    training on the CPU, whose flash kernel takes no dropout. On an accelerator flash and memory-efficient
    attention drop in the kernel from a Philox seed and save no mask: the walk's SDPA as it is."""
    return setup.attention == "sdpa" and cpu and spec.attn_dropout > 0


def resid_dropout_mask_bytes(spec: ModelSpec, setup: TrainSetup, cpu: bool) -> int:
    """One residual dropout's mask (after the attention output projection, or after the MLP's down
    projection: GPT-2's ``resid_dropout``), over that projection's output (n·H, in the compute dtype a):
    n·H·1 on an accelerator, n·H·a on the CPU (``dropout_mask_bytes``). 0 without residual dropout."""
    if not spec.resid_dropout:
        return 0
    return dropout_mask_bytes(tokens(setup) * spec.hidden, act_bytes(setup), cpu)


def attn_dropout_saved_bytes(spec: ModelSpec, setup: TrainSetup, cpu: bool) -> int:
    """What attention dropout saves beyond the probabilities under eager attention: its mask over
    B·heads·T² and the dropped probabilities the product with v saves in their place (B·heads·T²·a;
    softmax keeps its own output for its backward). 0 under SDPA (``math_attention_saved_bytes``) or
    without dropout."""
    if not spec.attn_dropout or setup.attention != "eager":
        return 0
    scores = setup.micro_batch * spec.heads * setup.ctx * setup.ctx
    return dropout_mask_bytes(scores, act_bytes(setup), cpu) + scores * act_bytes(setup)


def math_attention_shapes(spec: ModelSpec, setup: TrainSetup) -> dict[str, int]:
    """The tensors of SDPA's math path (``_scaled_dot_product_attention_math``, ATen), on the CPU in fp32
    whatever the inputs' dtype (16-bit inputs are upcast, the output cast back): ``casts``, the fp32 copies
    of q, k, v (n·(q_dim + 2·kv)·4; 0 for fp32 inputs); ``repeated``, k and v repeated to every head under
    grouped-query attention (2·n·q_dim·4); ``q``, ``k``, the scaled copies ``q·√s`` and ``k·√s`` the first
    bmm saves (n·q_dim·4, n·kv_w·4, kv_w the repeated width); ``v``, what the second bmm saves of v, a
    contiguous copy (n·kv_w·4: ``matmul`` reshapes the transposed (B, heads, T, hd) view to (B·heads, T, hd),
    which copies; the qkv output it was a view of is not kept); ``scores``, one B·heads·T²·4 tensor (the scores, the softmax output, the noise,
    the dropped probabilities); ``out``, the product with v, n·q_dim·4."""
    n, f = tokens(setup), FP32_BYTES
    gqa = spec.kv_heads != spec.heads
    kv_w = spec.q_dim if gqa else spec.kv_dim
    up = act_bytes(setup) != f
    return {"casts": n * (spec.q_dim + 2 * spec.kv_dim) * f if up else 0,
            "repeated": 2 * n * spec.q_dim * f if gqa else 0, "q": n * spec.q_dim * f, "k": n * kv_w * f,
            "v": n * kv_w * f, "kv_w": n * kv_w * f,
            "scores": setup.micro_batch * spec.heads * setup.ctx * setup.ctx * f, "out": n * spec.q_dim * f}


def math_attention_saved_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """What a block saves under SDPA's math path with attention dropout (``cpu_math_attention``) beyond what
    the walk's SDPA saves (its output and log-sum-exp, the rotated q and k, the qkv output): the scaled q
    and k, v as saved, the softmax output, the noise mask and the dropped probabilities (3·B·heads·T²·4),
    and the transposed copy of the output the out-projection saves (n·q_dim·a) (``math_attention_shapes``)."""
    t = math_attention_shapes(spec, setup)
    math = t["q"] + t["k"] + t["v"] + 3 * t["scores"] + attention_output_copy_bytes(spec, setup)
    sdpa = sdpa_output_bytes(spec, setup) + sdpa_logsumexp_bytes(spec, setup) + rotated_q_bytes(spec, setup) \
        + rotated_k_bytes(spec, setup) + qkv_output_bytes(spec, setup)
    return math - sdpa


def block_dropout_saved_bytes(spec: ModelSpec, setup: TrainSetup, cpu: bool) -> int:
    """Everything one block's dropouts save without checkpointing: two residual dropouts' masks and the
    attention dropout's mask and dropped probabilities. 0 at dropout 0."""
    math = math_attention_saved_bytes(spec, setup) if cpu_math_attention(spec, setup, cpu) else 0
    return 2 * resid_dropout_mask_bytes(spec, setup, cpu) + attn_dropout_saved_bytes(spec, setup, cpu) + math


def embd_dropout_mask_bytes(spec: ModelSpec, setup: TrainSetup, cpu: bool) -> int:
    """The embedding dropout's mask (GPT-2's ``drop`` after ``wte + wpe``) over the embedding sum, n·H in the
    residual dtype r: n·H·1 on an accelerator, n·H·r on the CPU. 0 under LoRA (the frozen embedding's output
    needs no gradient, so the dropout records nothing) or without embedding dropout."""
    if not spec.embd_dropout or setup.lora_rank:
        return 0
    return dropout_mask_bytes(tokens(setup) * spec.hidden, residual_bytes_per_element(setup), cpu)


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


def stack_adapter_state_bytes(setup: TrainSetup, extra_bytes: int, extra_tensors: int) -> int:
    """Optimizer state of the adapter bytes a stack keeps beyond memplan's (``Stack.lora_bytes_delta``):
    AdamW's two moments (and a 0-dim fp32 ``step`` per extra tensor) or SGD's momentum, each the size of
    the parameters; adamw8bit's 8-bit states are left as memplan's."""
    if setup.optimizer in ("adamw", "adamw-fused"):
        return ADAMW_STATES_PER_PARAM * extra_bytes + extra_tensors * ADAM_STEP_BYTES
    if setup.optimizer == "sgd":
        return SGD_STATES_PER_PARAM * extra_bytes
    return 0



# ---- reports and the runtime ----------------------------------------------------------------

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


def mapped_logits_high_water_bytes(spec: ModelSpec, setup: TrainSetup, rest_high: int, logits_high: int,
                                   peak_total: int) -> int:
    """CPU (glibc malloc): what the step's resident peak holds beyond its live peak when the loss's (n, V)
    tensors are mmapped, ``rest_high + logits_high − peak_total``; 0 when they come from the heap.

    A tensor of at least M_MMAP_THRESHOLD (32 MiB: its dynamic cap, where memplan's trainer fixes it,
    ``trainer.device.keep_heap_resident``) is mmapped and unmapped on free, so its pages come and go with
    it. Everything smaller comes from the heap, whose pages stay resident at their high-water mark (the
    trim threshold out of reach in the trainer; glibc's default trims only the top). The process then
    holds the heap's high-water and the mmapped tensors' own high-water at once, though the walk's live
    peak has them at different moments: ``rest_high`` is the highest live total besides the logits
    (with full checkpointing, a block recomputed in the backward, after the loss's tensors are gone),
    ``logits_high`` the highest live logits (the logits, their fp32 copy, the log-probabilities and
    their gradients at the loss's backward). Counted when every tensor of the logits category is
    mmapped, i.e. the compute-dtype logits, its smallest, reach the threshold, and the loss is not
    taken chunk by chunk; measured in benchmarks/heap_fragmentation.py (4x256 ctx512 b4 full-ckpt:
    123.7 + 96.0 MiB against a live peak of 159.2 MiB, 60.5 MiB)."""
    if logits_bytes(spec, setup) < GLIBC_MMAP_THRESHOLD_MAX:
        return 0
    return max(0, rest_high + logits_high - peak_total)


# What transformers' model code (and peft's, for LoRA) keeps resident in a CPU training process at its steps,
# when the calibration did not measure it (a bundled profile, or a calibration from before it measured this):
# measured here by trainer.calibrate.model_code_bytes on this project's build machine (AMD EPYC, 2 cores, Linux,
# Python 3.11, torch 2.13.0+cpu, transformers 5.24.0, peft 0.21.2): 43.7 MiB (llama, qwen3), 44.0 (gemma),
# 44.1 (stablelm), 44.4 (phi) over the same process with memplan's own model; peft 11.2 MiB more (qwen3, rank 4).
TRANSFORMERS_CODE_BYTES = 46_137_344  # 44.0 MiB
PEFT_CODE_BYTES = 11_744_051  # 11.2 MiB


def model_code_resident_bytes(lora: bool, transformers_bytes: int | None = None,
                              peft_bytes: int | None = None) -> int:
    """CPU (the process's resident memory is the peak): what transformers' model code keeps resident beyond
    the runtime context when its model class trains, ``C_transformers + [LoRA] C_peft`` (the transformers
    stack's ``model_code_bytes`` hook; memplan's own code is in the context:
    ``trainer.calibrate.process_baseline_bytes`` runs memplan's model).

    C is the growth of a trimmed process's resident set from importing transformers' modelling code (peft's,
    with LoRA), building a tiny model of its class and running its training steps: the module objects,
    code and tables that stay live while it trains, over a process that already holds the runtime context
    (its command line loaded, memplan's model run). Not the import's growth from a bare process: most of
    what transformers imports (torch.distributed, torch._dynamo, sympy: 110 MiB from ``import trainer.loop``
    alone) the context already holds, and only 44 MiB is new. ``transformers_bytes``/``peft_bytes``: this machine's measurement
    (``memplan calibrate``, a profile's ``[runtime] transformers_code_bytes``/``peft_code_bytes``); None:
    TRANSFORMERS_CODE_BYTES / PEFT_CODE_BYTES, measured on this project's build machine."""
    code = TRANSFORMERS_CODE_BYTES if transformers_bytes is None else int(transformers_bytes)
    if lora:
        code += PEFT_CODE_BYTES if peft_bytes is None else int(peft_bytes)
    return code


# What the ``datasets`` package keeps resident in a process that runs transformers' ``Trainer``
# (``transformers.trainer`` imports it, and with it pandas and pyarrow, whenever it is installed): measured on the
# build machine (Python 3.11, torch 2.13.0+cpu, transformers 5, datasets 5.2.0) as
# trainer.calibrate.library_code_bytes("transformers") (the Trainer's two steps on a tiny llama) in fresh
# processes with and without datasets installed, 145,502,208 − 58,478,592.
DATASETS_CODE_BYTES = 87_023_616  # 83.0 MiB


def trainer_datasets_resident_bytes(installed: bool) -> int:
    """CPU: what transformers' ``Trainer`` step keeps resident beyond its model's code (``model_code_resident_bytes``)
    because the ``datasets`` package is installed, ``[installed] C_datasets``: ``transformers.trainer`` imports
    datasets (its ``is_datasets_available()``), and datasets pandas and pyarrow, whether or not the run reads a
    dataset. Without datasets the Trainer's own modules and accelerate's add nothing the verify trials see beyond
    the model code (``autotune --stack transformers --verify``: 0.97 of the plan before this term, as with it).
    ``installed``: where the plan is made (``memplan.memory.stacks.transformers.datasets_installed``)."""
    return DATASETS_CODE_BYTES if installed else 0


# What litgpt's and torchtune's code keeps resident in a CPU training process at its steps, likewise beyond the
# runtime context: measured by trainer.calibrate.library_code_bytes on the same machine (Python 3.11, torch
# 2.13.0+cpu), each in the environment of its extra: litgpt 0.5.13 with lightning 2.6.6, torchtune 0.6.1 with
# torchao 0.14.1. No calibration measures them per machine (they live in environments of their own).
LIBRARY_CODE_BYTES = {"litgpt": 23_216_128,  # 22.1 MiB
                      "torchtune": 162_725_888}  # 155.2 MiB


def library_code_resident_bytes(library: str) -> int:
    """CPU: what ``library``'s code (litgpt with lightning, torchtune with torchao) keeps resident beyond the
    runtime context when its own model and step train, ``C_library`` (the litgpt and torchtune stacks'
    ``model_code_bytes`` hook, as ``model_code_resident_bytes`` is transformers').

    C is the growth of a trimmed process's resident set, over one that holds the runtime context (memplan's
    model run), from two steps of the library's own code on a tiny llama, the library imported there: its
    module objects, code and tables (``trainer.calibrate.library_code_bytes``; LIBRARY_CODE_BYTES)."""
    return LIBRARY_CODE_BYTES[library]


# What torch.compile keeps resident in a CPU training process beyond the runtime context (which is calibrated in an
# eager process): measured by trainer.calibrate.compiled_code_bytes on this project's build machine (Python 3.11,
# torch 2.13.0+cpu, g++), each in a fresh process with an empty inductor cache: importing inductor
# (torch._inductor.compile_fx) 43.7 MiB; then compiling a tiny llama (hidden 32) and running three steps: 45.2 MiB at
# 1 block, 64.5 MiB at 4 (6.43 MiB a block; 4 blocks at hidden 128 measured the same, a cached compile 12-14 MiB
# less), of which 12.8 MiB are the modules the compile imports on first use and 3.5-3.9 MiB file-backed pages (the
# kernels' .so files, the C++ runtime's libraries).
COMPILE_IMPORT_BYTES = 45_822_771  # 43.7 MiB
COMPILE_GRAPH_BYTES = 40_653_045  # 38.77 MiB: 45.2 MiB at one block, less its block
COMPILE_LAYER_BYTES = 6_742_343  # 6.43 MiB: (64.5 - 45.2) / 3


def compiled_code_resident_bytes(layers: int) -> int:
    """CPU (the process's resident memory is the peak), under torch.compile: what compiling the step keeps
    resident beyond the runtime context, ``C_import + C_graph + L · C_layer`` (``compiled_code``, a runtime term).

    C_import: inductor's modules (``torch._inductor.compile_fx`` and what it imports: the scheduler, lowerings,
    sympy's tables; dynamo itself the context holds). C_graph: what the first compile adds whatever the model's
    depth: the modules it imports on first use (the C++ code generator, the partitioner, the FX graph cache) and
    the graph's fixed part (embedding, loss, the forward and backward modules' wrappers). C_layer: per transformer
    block, its share of the compiled graph kept resident: its FX nodes, the generated Python wrapper's code and the
    C++ kernels' code (the loaded .so of the forward and the backward graph), the guards. Measured
    (``trainer.calibrate.compiled_code_bytes``) as the growth of a trimmed process's resident set from importing
    inductor, then from compiling a tiny llama and running its steps; C_graph and C_layer from two depths. A
    compile whose graph is in inductor's on-disk cache only loads its code: about 12 MiB less here. Not counted:
    full checkpointing's recomputed forward in the backward graph (+3.0 MiB measured at 4 blocks)."""
    return COMPILE_IMPORT_BYTES + COMPILE_GRAPH_BYTES + layers * COMPILE_LAYER_BYTES


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


"""Memory of a training step, term by term. Pure functions of (ModelSpec, TrainSetup) returning bytes.

Every term names the tensors of ``trainer/model.py`` and ``trainer/step.py`` it counts. Notation
in the docstrings: B micro-batch, T context, H hidden, F ffn, V vocab, L layers, kv = kv_heads ·
head_dim, n = B·T tokens, a = bytes of an activation in the compute dtype (2 under bf16/fp16,
else 4), r = bytes of the residual stream (4 unless pure bf16), p = bytes of a stored weight.

The peak is found by phase (``step_moments``): the live total at each moment of a steady-state
step where memory can peak (end of forward, start of backward, the LM head's backward, the last
layer's backward, the end of backward, the optimizer step); the largest is peak_allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.model import ModelSpec
from memplan.setup import FP32_BYTES, HALF_BYTES, TrainSetup

INDEX_BYTES = 8  # token ids are int64
ADAMW_STATES_PER_PARAM = 2  # exp_avg, exp_avg_sq
SGD_STATES_PER_PARAM = 1  # momentum_buffer
ADAM_STEP_BYTES = 4  # AdamW keeps a 0-dim fp32 `step` tensor per parameter tensor
BNB_BLOCK = 256  # bitsandbytes' 8-bit optimizers quantise states in blocks of 256 values ...
BNB_MIN_NUMEL = 4096  # ... for tensors of at least 4096 elements; smaller ones keep 32-bit states
CE_LIVE_FP32_COPIES = 3  # at the start of backward: log-probs, their gradient, the logits' gradient
LOWP_WEIGHT_BYTES = HALF_BYTES  # autocast's cached bf16/fp16 copy of each matmul weight


# ---- dtype sizes ---------------------------------------------------------------------------

def act_bytes(setup: TrainSetup) -> int:
    """a: bytes per activation element: matmul outputs are in the compute dtype."""
    return setup.compute_bytes


def residual_bytes_per_element(setup: TrainSetup) -> int:
    """r: the residual stream stays fp32 under autocast (fp32 embedding + bf16 branch → fp32)."""
    return HALF_BYTES if setup.precision == "bf16" else FP32_BYTES


def tokens(setup: TrainSetup) -> int:
    """n = B·T, tokens in one micro-batch."""
    return setup.micro_batch * setup.ctx


# ---- weights, gradients, optimizer ---------------------------------------------------------

def weight_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """All parameters in their storage dtype: N·p (fp32 master weights under mixed precision)."""
    return spec.params * setup.param_bytes


def rope_buffer_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """RoPE tables: cos and sin buffers (T × rotary_dim/2, fp32), plus their per-forward copies
    in the compute dtype when that is not fp32. 0 for learned positions."""
    if spec.pos != "rope":
        return 0
    table = setup.ctx * (spec.rotary_dim // 2)
    n = 2 * table * FP32_BYTES
    if setup.compute_bytes != FP32_BYTES or setup.precision == "bf16":
        n += 2 * table * setup.compute_bytes
    return n


def lowp_weight_copy_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Autocast's low-precision copies of the matmul weights: matmul_params × 2 under
    bf16-mixed / fp16-mixed, else 0. Each matmul saves its copy for backward, so they live
    from the forward until that layer's backward."""
    return spec.matmul_params * LOWP_WEIGHT_BYTES if setup.mixed else 0


def gradient_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """One gradient per parameter, in the parameter's dtype: N·p."""
    return spec.params * setup.param_bytes


def decay_params(spec: ModelSpec) -> int:
    """Parameters in the weight-decay group: every matrix and the embedding (norms and biases are not)."""
    per_layer_vectors = 2 * spec.norm_params
    if spec.bias:
        per_layer_vectors += spec.hidden + 2 * spec.kv_dim + spec.hidden
        per_layer_vectors += (2 if spec.mlp == "swiglu" else 1) * spec.ffn + spec.hidden
    elif spec.qkv_bias:
        per_layer_vectors += spec.hidden + 2 * spec.kv_dim
    return spec.params - spec.layers * per_layer_vectors - spec.norm_params


def optimizer_state_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Optimizer state.

    - adamw, adamw-fused: exp_avg and exp_avg_sq in the parameter dtype (2·N·p), plus a
      0-dim fp32 ``step`` per parameter tensor.
    - sgd: momentum_buffer (N·p).
    - adamw8bit: two uint8 states (2·N) plus one fp32 absmax per 256-value block, for tensors
      of ≥ 4096 elements; smaller tensors keep fp32 states (bitsandbytes).
    """
    n = spec.params
    if setup.optimizer in ("adamw", "adamw-fused"):
        return ADAMW_STATES_PER_PARAM * n * setup.param_bytes + spec.n_tensors * ADAM_STEP_BYTES
    if setup.optimizer == "sgd":
        return SGD_STATES_PER_PARAM * n * setup.param_bytes
    big = decay_params(spec)  # matrices: quantised
    small = n - big  # norms and biases: under 4096 elements at any planned width, fp32 states
    quantised = ADAMW_STATES_PER_PARAM * (big + -(-big // BNB_BLOCK) * FP32_BYTES)
    return quantised + ADAMW_STATES_PER_PARAM * small * FP32_BYTES + spec.n_tensors * ADAM_STEP_BYTES


def optimizer_temporary_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Scratch memory of the optimizer step.

    foreach AdamW computes ``sqrt(exp_avg_sq)`` for a whole parameter group at once
    (``torch._foreach_sqrt``), so it holds one parameter-sized temporary of the largest group,
    the weight-decay group; foreach SGD with weight decay adds ``weight_decay·param`` to the
    gradients out of place (``torch._foreach_add``), the same size. The fused AdamW kernel and
    bitsandbytes' 8-bit kernel update in place: 0.
    """
    if setup.optimizer in ("adamw", "sgd"):
        return decay_params(spec) * setup.param_bytes
    return 0


def input_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Token ids and targets of all micro-batches of a step (int64): grad_accum · 2 · n · 8."""
    return setup.grad_accum * 2 * tokens(setup) * INDEX_BYTES


# ---- activations saved for backward, per layer ---------------------------------------------

def residual_stream_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The block's input (saved by the first norm) and, unless the residual is parallel, the
    stream after attention (saved by the second norm): n·H·r each."""
    copies = 1 if spec.parallel_residual else 2
    return copies * tokens(setup) * spec.hidden * residual_bytes_per_element(setup)


def norm_stat_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Per-token statistics of the two norms: RMSNorm's rstd (n·4 each, always fp32),
    LayerNorm's mean and rstd (2·n·r each: the input's dtype on CPU; CUDA keeps them fp32 for
    bf16 input, 2·n·2 bytes more per norm under pure bf16)."""
    return 2 * _norm_stats_per_token_bytes(spec, setup) * tokens(setup)


def _norm_stats_per_token_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    if spec.norm == "rmsnorm":
        return FP32_BYTES
    return 2 * residual_bytes_per_element(setup)


def norm_output_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The two norms' outputs, saved as the inputs of the qkv and MLP-up matmuls: 2·n·H·a
    (under autocast, the bf16 copy made for the matmul; the fp32 norm output is freed)."""
    return 2 * tokens(setup) * spec.hidden * act_bytes(setup)


def _kv_repeated(spec: ModelSpec, setup: TrainSetup) -> bool:
    """Eager attention repeats K and V to the query head count under grouped-query attention."""
    return setup.attention == "eager" and spec.kv_heads != spec.heads


def qkv_output_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The fused qkv matmul's output, n·(H + 2·kv)·a, kept alive while attention saves a view of it.

    SDPA saves v as a view of it (and q and k too without rotary). Eager attention saves it
    only without rotary (q and k are views); with rotary it saves its own copies of k and v.
    """
    if setup.attention == "sdpa" or spec.pos != "rope":
        return tokens(setup) * (spec.hidden + 2 * spec.kv_dim) * act_bytes(setup)
    return 0


def rotary_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Rotated q (n·H·a) and, unless eager attention repeats it, rotated k (n·kv·a), saved by
    attention. 0 for learned positions (q and k are views of the qkv output)."""
    if spec.pos != "rope":
        return 0
    k = 0 if _kv_repeated(spec, setup) else spec.kv_dim
    return tokens(setup) * (spec.hidden + k) * act_bytes(setup)


def eager_kv_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Eager attention's own copies of K and V.

    Under grouped-query attention, K and V repeated to all heads (``repeat_interleave``):
    2·n·H·a. Without it and with rotary, the second matmul's contiguous copy of the transposed
    v view: n·kv·a. 0 for SDPA, and for eager without rotary (the qkv output holds them).
    """
    if setup.attention != "eager":
        return 0
    if _kv_repeated(spec, setup):
        return 2 * tokens(setup) * spec.hidden * act_bytes(setup)
    if spec.pos == "rope":
        return tokens(setup) * spec.kv_dim * act_bytes(setup)
    return 0


def attention_core_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """What the attention kernel saves besides q, k, v.

    - sdpa: its output (n·H·a) and the log-sum-exp per head and query (n·heads·4).
    - eager: the softmax probabilities B·heads·T²·a (saved once, used by softmax's and the
      second matmul's backward) and the T×T boolean causal mask.
    """
    n = tokens(setup)
    if setup.attention == "sdpa":
        return n * spec.hidden * act_bytes(setup) + n * spec.heads * FP32_BYTES
    return setup.micro_batch * spec.heads * setup.ctx * setup.ctx * act_bytes(setup) + setup.ctx * setup.ctx


def attention_output_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Eager attention's output transposed back to (B, T, H), a contiguous copy saved by the
    output projection: n·H·a. SDPA returns its output in (B, T, heads, hd) layout, so the
    transpose back is a view of the output SDPA saves anyway: 0."""
    return tokens(setup) * spec.hidden * act_bytes(setup) if setup.attention == "eager" else 0


def mlp_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """MLP intermediates saved for backward.

    - SwiGLU: the fused gate|up output (n·2F, saved through its halves by silu and the
      product), silu(gate) (n·F) and the product (n·F, the down matmul's input): n·4F·a.
    - GELU: the up output (n·F, saved by gelu) and gelu's output (n·F): n·2F·a.
    """
    widths = 4 if spec.mlp == "swiglu" else 2
    return tokens(setup) * widths * spec.ffn * act_bytes(setup)


def layer_activation_terms(spec: ModelSpec, setup: TrainSetup) -> dict[str, int]:
    """Everything one block saves for backward without checkpointing, by tensor."""
    return {
        "residual": residual_stream_bytes(spec, setup),
        "norm_stats": norm_stat_bytes(spec, setup),
        "norm_outputs": norm_output_bytes(spec, setup),
        "qkv": qkv_output_bytes(spec, setup),
        "rotary": rotary_bytes(spec, setup),
        "eager_kv": eager_kv_bytes(spec, setup),
        "attention": attention_core_bytes(spec, setup),
        "attention_output": attention_output_bytes(spec, setup),
        "mlp": mlp_bytes(spec, setup),
    }


def layer_lowp_weight_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """One block's share of the autocast weight copies: its matmul weights × 2 (mixed only)."""
    if not setup.mixed:
        return 0
    per_layer = 2 * spec.hidden * spec.hidden + 2 * spec.hidden * spec.kv_dim
    per_layer += (3 if spec.mlp == "swiglu" else 2) * spec.hidden * spec.ffn
    return per_layer * LOWP_WEIGHT_BYTES


def layer_matmul_output_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """What selective checkpointing keeps of a block besides its input: the outputs of its
    linear layers and of attention, in the compute dtype.

    qkv n·(H+2kv), out-projection n·H, MLP up n·2F (SwiGLU) or n·F, MLP down n·H; SDPA's
    output n·H and log-sum-exp n·heads·4, or eager attention's softmax probabilities B·heads·T².
    """
    n, a = tokens(setup), act_bytes(setup)
    up = (2 if spec.mlp == "swiglu" else 1) * spec.ffn
    total = (n * (spec.hidden + 2 * spec.kv_dim) + n * spec.hidden + n * up + n * spec.hidden) * a
    if setup.attention == "sdpa":
        return total + n * spec.hidden * a + n * spec.heads * FP32_BYTES
    return total + setup.micro_batch * spec.heads * setup.ctx * setup.ctx * a


def block_input_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """A checkpointed block's input, the one tensor full checkpointing keeps per layer: n·H·r."""
    return tokens(setup) * spec.hidden * residual_bytes_per_element(setup)


def saved_per_layer_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """What one block holds between its forward and its backward, by checkpointing mode."""
    if setup.checkpointing == "full":
        return block_input_bytes(spec, setup)
    if setup.checkpointing == "selective":
        return block_input_bytes(spec, setup) + layer_matmul_output_bytes(spec, setup)
    return sum(layer_activation_terms(spec, setup).values()) + layer_lowp_weight_bytes(spec, setup)


def recomputed_layer_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Under checkpointing, the one block being recomputed in backward holds everything it
    would have saved without checkpointing."""
    if setup.checkpointing == "none":
        return 0
    return sum(layer_activation_terms(spec, setup).values()) + layer_lowp_weight_bytes(spec, setup)


def final_stage_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """After the last block: its output (saved by the final norm, n·H·r), the norm's statistics,
    the norm output (saved by the LM head, n·H·a), and the head's low-precision weight copy."""
    n = tokens(setup)
    stats = _norm_stats_per_token_bytes(spec, setup) * n
    lowp = spec.vocab * spec.hidden * LOWP_WEIGHT_BYTES if setup.mixed else 0
    return n * spec.hidden * (residual_bytes_per_element(setup) + act_bytes(setup)) + stats + lowp


# ---- logits and the loss -------------------------------------------------------------------

def logits_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The LM head's output, n·V·a."""
    return tokens(setup) * spec.vocab * act_bytes(setup)


def loss_forward_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Inside the fp32 cross-entropy's forward: the logits (n·V·a), their fp32 copy if a < 4
    (n·V·4), and the log-probabilities (n·V·4)."""
    n_v = tokens(setup) * spec.vocab
    copy = n_v * FP32_BYTES if act_bytes(setup) != FP32_BYTES else 0
    return logits_bytes(spec, setup) + copy + n_v * FP32_BYTES


def loss_backward_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """At the start of backward: the log-probabilities, their gradient and the logits' gradient,
    all fp32: 3·n·V·4. This is what dominates memory for a 50k vocabulary."""
    return CE_LIVE_FP32_COPIES * tokens(setup) * spec.vocab * FP32_BYTES


def head_backward_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """The LM head's backward: the logits' gradient in the compute dtype (n·V·a), the input's
    gradient (n·H·a), the weight's gradient in the compute dtype (V·H·a) and, under autocast,
    its fp32 cast (V·H·4) before it lands in ``.grad``."""
    n = tokens(setup)
    a = act_bytes(setup)
    w = spec.vocab * spec.hidden
    return n * spec.vocab * a + n * spec.hidden * a + w * a + (w * FP32_BYTES if setup.mixed else 0)


# ---- the step's moments and the peak -------------------------------------------------------

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "logits", "temporaries")


@dataclass(frozen=True)
class Moment:
    """Live bytes by category at one moment of a step."""

    name: str
    phase: str  # forward | backward | optimizer
    bytes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def embedding_grad_temporary_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Gradient buffers at the end of backward, beyond the gradients themselves.

    Tied: the LM head's gradient waits in autograd's input buffer until the embedding's
    gradient arrives, and the two are summed out of place (the sum is the new gradient):
    2·V·H·p more; with gradient accumulation the sum is then added to ``.grad``: 3·V·H·p.
    Untied with accumulation: the embedding's new gradient before it is added in place: V·H·p.
    """
    vh = spec.vocab * spec.hidden * setup.param_bytes
    accum = setup.grad_accum > 1
    return (3 if accum else 2) * vh if spec.tied else (vh if accum else 0)


def block_backward_temporary_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Inside a block's backward, at its largest: the gradient flowing in along the residual
    (n·H·r), the gradient of the MLP's inner activation (n·F·a) and the one being computed
    from it (n·F·a: silu's or gelu's input gradient)."""
    n = tokens(setup)
    return n * spec.hidden * residual_bytes_per_element(setup) + 2 * n * spec.ffn * act_bytes(setup)


def step_moments(spec: ModelSpec, setup: TrainSetup) -> list[Moment]:
    """The moments of a steady-state step at which memory can peak, each with its live bytes."""
    w = weight_bytes(spec, setup) + rope_buffer_bytes(spec, setup)
    g = gradient_bytes(spec, setup)
    s = optimizer_state_bytes(spec, setup)
    g_accum = g if setup.grad_accum > 1 else 0  # earlier micro-batches' gradients
    inputs = input_bytes(spec, setup)
    stored = spec.layers * saved_per_layer_bytes(spec, setup)
    final = final_stage_bytes(spec, setup)
    acts = inputs + stored + final
    # the last block's backward: the others as stored, this one whole (recomputed if checkpointed)
    last_block = inputs + stored - saved_per_layer_bytes(spec, setup) + \
        sum(layer_activation_terms(spec, setup).values()) + layer_lowp_weight_bytes(spec, setup)
    head_grad = spec.vocab * spec.hidden * setup.param_bytes  # in .grad, or autograd's buffer if tied
    down_grad = spec.ffn * spec.hidden * setup.param_bytes

    def moment(name, phase, **b):
        return Moment(name, phase, {c: int(b.get(c, 0)) for c in CATEGORIES})

    return [
        moment("end of forward (loss)", "forward", weights=w, gradients=g_accum, optimizer=s, activations=acts,
               logits=loss_forward_bytes(spec, setup)),
        moment("start of backward (loss gradient)", "backward", weights=w, gradients=g_accum, optimizer=s,
               activations=acts, logits=loss_backward_bytes(spec, setup)),
        moment("LM head backward", "backward", weights=w, gradients=g_accum, optimizer=s, activations=acts,
               logits=head_backward_bytes(spec, setup)),
        moment("last block's backward", "backward", weights=w, gradients=max(g_accum, head_grad + down_grad),
               optimizer=s, activations=last_block, temporaries=block_backward_temporary_bytes(spec, setup)),
        moment("end of backward", "backward", weights=w, gradients=g, optimizer=s, activations=inputs,
               temporaries=embedding_grad_temporary_bytes(spec, setup)),
        moment("optimizer step", "optimizer", weights=w, gradients=g, optimizer=s,
               temporaries=optimizer_temporary_bytes(spec, setup)),
    ]


@dataclass(frozen=True)
class MemoryBreakdown:
    """The contract's ``memory`` object, plus the moments it was found from."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    temporaries: int
    runtime: int
    peak_allocated: int
    peak_reserved: int
    peak_phase: str
    peak_moment: str
    moments: tuple[Moment, ...] = field(default=())
    terms: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("weights", "gradients", "optimizer", "activations", "logits",
                                              "temporaries", "runtime", "peak_allocated", "peak_reserved",
                                              "peak_phase")}


def activation_terms(spec: ModelSpec, setup: TrainSetup) -> dict[str, int]:
    """All activation terms of a step, for reports: per-layer terms × layers, then the rest."""
    terms = {f"layer.{k}": v * spec.layers for k, v in layer_activation_terms(spec, setup).items()}
    terms["layer.lowp_weights"] = layer_lowp_weight_bytes(spec, setup) * spec.layers
    terms["final_stage"] = final_stage_bytes(spec, setup)
    terms["inputs"] = input_bytes(spec, setup)
    return terms


def peak_memory(spec: ModelSpec, setup: TrainSetup, runtime_context_bytes: int = 0,
                allocator_overhead: float = 0.0) -> MemoryBreakdown:
    """The peak of a steady-state step: the largest moment, by category, plus the runtime.

    peak_reserved = peak_allocated · (1 + allocator_overhead) + runtime_context_bytes, the
    figure a device monitor shows and that must fit in the device's usable memory.
    """
    moments = step_moments(spec, setup)
    peak = max(moments, key=lambda m: m.total)
    allocated = peak.total
    runtime = int(allocated * allocator_overhead) + int(runtime_context_bytes)
    return MemoryBreakdown(**peak.bytes, runtime=runtime, peak_allocated=allocated,
                           peak_reserved=allocated + runtime, peak_phase=peak.phase, peak_moment=peak.name,
                           moments=tuple(moments), terms=activation_terms(spec, setup))

"""The reference decoder-only transformer that memplan plans for and ``memplan train`` trains.

One file, a few plain modules, built from a ``memplan.model.ModelSpec``:

- Llama family: RMSNorm, rotary embeddings (RoFormer, Su et al. 2021), SwiGLU (Shazeer 2020),
  grouped-query attention (Ainslie et al. 2023), tied or untied embeddings.
- GPT-2 family: LayerNorm, learned positions, GELU (tanh approximation), biases.
- GPT-NeoX: LayerNorm, partial rotary, GELU, parallel residual.

Attention is ``eager`` (explicit scores, causal mask, softmax) or ``sdpa``
(``F.scaled_dot_product_attention``; grouped-query attention through ``enable_gqa`` so repeated
K/V are never materialised). Activation checkpointing is applied per block by
``apply_checkpointing``: ``full`` keeps only each block's input, ``selective`` keeps the outputs
of matmuls and attention and recomputes norms, rotary and pointwise ops.

Every tensor this module saves for backward is accounted for by a term in ``memplan/memory/terms.py``;
change one and you must change the other (``memplan validate`` will tell you).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memplan.model import ModelSpec


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm that saves only its input and the per-token 1/rms for backward.

    PyTorch's ``F.rms_norm`` saves the normalised tensor too on some devices (its CPU path is
    a composite of pointwise ops) and not on others (fused CUDA kernel), so the memory it takes
    would depend on the device. This function takes the same on every device: its input
    (shared with the residual stream) plus rstd (B·T fp32), and in backward two fp32
    (B, T, H) buffers beyond its output (``memplan.memory.walk._norm_backward``).
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)  # (B, T, 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        n = x.float().mul_(rstd) if x.dtype != torch.float32 else x * rstd  # normalised input n̂, fp32
        g = grad.float() * n  # first grad ⊙ n̂, in the second fp32 buffer ...
        grad_w = None
        if ctx.needs_input_grad[1]:  # ... for the weight's gradient, Σ over tokens of grad ⊙ n̂ (a plain
            # reduction: einsum("...h,...h->h") runs as H tiny strided matmuls, each copying its inputs)
            grad_w = g.sum(dim=tuple(range(g.dim() - 1))).to(weight.dtype)
        torch.mul(grad.float(), weight.float(), out=g)  # ... then the gradient w.r.t. n̂, grad ⊙ weight
        dot = torch.einsum("...h,...h->...", g, n).unsqueeze(-1).div_(x.shape[-1])  # (B, T, 1)
        g.sub_(n.mul_(dot)).mul_(rstd)  # in place: rstd · (g − n̂·mean(g·n̂))
        return g.to(x.dtype), grad_w, None


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return RMSNorm(spec.hidden, spec.norm_eps)
    return nn.LayerNorm(spec.hidden, eps=spec.norm_eps)


def rope_frequencies(rotary_dim: int, theta: float, scaling: tuple = (), seq_len: int | None = None,
                     max_positions: int = 2048, device=None) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies (rotary_dim/2, fp32) and the factor on cos and sin, for ``scaling``
    (``ModelSpec.rope_scaling``), op for op as transformers computes them (modeling_rope_utils.py):

    - default: θ^(−2i/d).
    - linear (``_compute_linear_scaling_rope_parameters``): θ^(−2i/d) / factor.
    - dynamic NTK (``_compute_dynamic_ntk_parameters``): the base grows with the sequence, θ·(factor·L/M −
      (factor − 1))^(d/(d−2)), L = max(seq_len, M), M = max_positions; so up to M it is the default.
      transformers recomputes it when a forward's largest position + 1 exceeds what it has cached (as a
      0-dim int64 tensor, hence in fp32 arithmetic), as here.
    - yarn (``_compute_yarn_parameters``): interpolation 1/(factor·θ^(2i/d)) and extrapolation 1/θ^(2i/d)
      blended by a linear ramp between the correction dims of beta_fast and beta_slow rotations over
      original_max_position_embeddings; cos and sin scaled by attention_factor (default 0.1·ln(factor) + 1,
      or the mscale / mscale_all_dim ratio).
    - llama3 (``_compute_llama3_parameters``): wavelengths beyond original/low_freq_factor divided by factor,
      those below original/high_freq_factor kept, a smooth blend between.
    """
    p = dict(scaling)
    kind, dim, base = p.get("rope_type", "default"), rotary_dim, theta
    if kind == "default":
        return 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)), 1.0
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    factor = p["factor"]
    if kind == "linear":
        inv_freq = 1.0 / (base ** exponents)
        inv_freq /= factor
        return inv_freq, 1.0
    if kind == "dynamic":
        if seq_len is not None and seq_len > max_positions:  # transformers' growth path: seq_len a tensor
            length = torch.tensor(seq_len, dtype=torch.int64, device=device)
        else:
            length = max_positions  # at init (seq_len None): max_position_embeddings, a Python int
        base = base * ((factor * length / max_positions) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** exponents), 1.0
    if kind == "llama3":
        inv_freq = 1.0 / (base ** exponents)
        low, high, old = p["low_freq_factor"], p["high_freq_factor"], p["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama), 1.0
    # yarn
    original = p["original_max_position_embeddings"]
    attention_factor, mscale, mscale_all_dim = p.get("attention_factor"), p.get("mscale"), p.get("mscale_all_dim")

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        attention_factor = (float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
                            if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(device=device, dtype=torch.float)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def rotary_tables(rotary_dim: int, ctx: int, theta: float, device=None, scaling: tuple = (),
                  max_positions: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (ctx, rotary_dim/2), fp32 (cast to the compute dtype once per forward), with the
    RoPE scaling ``scaling`` (``rope_frequencies``; a dynamic one computed for a ``ctx``-token sequence)."""
    inv_freq, attention_factor = rope_frequencies(rotary_dim, theta, scaling, ctx, max_positions, device)
    angles = torch.outer(torch.arange(ctx, device=device, dtype=torch.float32), inv_freq)  # (T, rd/2)
    if attention_factor != 1.0:  # yarn: as transformers, cos and sin scaled in fp32 before the cast
        return angles.cos() * attention_factor, angles.sin() * attention_factor
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[x1·cos − x2·sin, x2·cos + x1·sin] on the first rotary dims, the rest copied; into one new tensor."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    if torch.compiler.is_compiling():  # torch.compile cannot trace writes into views of a new tensor; it fuses this
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], dim=-1)
    out = torch.empty_like(x)
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out[..., half:2 * half]).addcmul_(x1, sin)
    if 2 * half < x.shape[-1]:
        out[..., 2 * half:] = x[..., 2 * half:]
    return out


class _Rotary(torch.autograd.Function):
    """RoPE as one op: saves only the cos/sin tables, its backward rotates the gradient back."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of each head, half-split layout (as HF Llama, GPT-NeoX).

    x: (B, T, heads, head_dim); cos, sin: (T, rotary_dim/2). The result keeps the (B, T, heads,
    head_dim) layout, so attention's output comes back in it too and the transpose back to
    (B, T, H) is free.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, rd/2), broadcast over heads
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rotary.apply(x, cos, sin)
    return _rotate(x, cos, sin)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, attention: str):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.attention = attention
        qkv_bias = spec.bias or spec.qkv_bias
        # q, k and v in one matmul: (H) -> (H + 2·kv_dim)
        self.qkv = nn.Linear(spec.hidden, spec.hidden + 2 * spec.kv_dim, bias=qkv_bias)
        self.proj = nn.Linear(spec.hidden, spec.hidden, bias=spec.bias)
        self.attn_dropout = spec.attn_dropout  # on the probabilities (GPT-2's attn_pdrop)
        self.resid_dropout = _dropout(spec.resid_dropout)  # after the output projection (resid_pdrop)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split([C, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(B, T, self.heads, self.head_dim)  # (B, T, heads, hd)
        k = k.view(B, T, self.kv_heads, self.head_dim)  # (B, T, kv_heads, hd)
        v = v.view(B, T, self.kv_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        # attention wants (B, heads, T, hd): a transposed view, no copy
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.attention == "sdpa":
            if self.kv_heads != self.heads and not sdpa_takes_gqa(q, k, v):
                groups = self.heads // self.kv_heads
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != self.heads,
                                               dropout_p=self.attn_dropout if self.training else 0.0)
        else:
            y = eager_attention(q, k, v, causal_mask(T, x.device) if mask is None else mask,
                                self.attn_dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, H): a view after SDPA, a copy after eager
        return self.resid_dropout(self.proj(y))


def _dropout(p: float) -> nn.Module:
    """``nn.Dropout(p)``, or nothing at all where p is 0 (no module, no op: the step is as without dropout)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


def sdpa_takes_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether SDPA will run grouped-query attention without repeating K/V.

    Only the flash kernels do (CPU's, and CUDA/ROCm's where ``can_use_flash_attention`` says the
    inputs qualify: sm80+, fp16/bf16, head_dim ≤ 256); any other backend would fall back to
    the math kernel, which materialises the T×T scores. Then K/V are repeated here instead, so
    the memory-efficient kernel runs (memplan counts the repeated K/V: ``Device.flash_attention``).
    """
    if q.device.type == "cpu":
        return True
    if q.device.type != "cuda":
        return False
    try:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        return bool(can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, True, True), False))
    except (ImportError, TypeError, RuntimeError):
        return False


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    dropout: float = 0.0) -> torch.Tensor:
    """softmax(q·kᵀ/√d + causal mask)·v with the (B, heads, T, T) scores materialised; with ``dropout``
    (training) the probabilities dropped before the product with v, as GPT-2's ``attn_dropout``.

    Scaling and masking are in place, so at most two T×T tensors (scores, probabilities) are
    live in the forward.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # eager attention has to repeat K/V for grouped-query attention
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # contiguous (B, heads, T, hd) copies: the matmuls would copy the transposed views anyway
    # whenever B > 1; copying always makes what is saved the same for every batch size
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    scores = q @ k.transpose(-2, -1)  # (B, heads, T, T)
    scores.mul_(1.0 / math.sqrt(q.shape[-1])).masked_fill_(mask, float("-inf"))
    # softmax in the scores' dtype on every device (CUDA autocast would otherwise upcast it to fp32)
    probs = scores.softmax(dim=-1, dtype=scores.dtype)
    del scores
    if dropout > 0:
        probs = F.dropout(probs, dropout, training=True)
    return probs @ v  # (B, heads, T, hd)


def causal_mask(T: int, device) -> torch.Tensor:
    """(T, T) bool, True above the diagonal (the future)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).triu_(1)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.swiglu = spec.mlp == "swiglu"
        # SwiGLU: gate and up in one matmul (H) -> (2F); GELU: (H) -> (F)
        self.up = nn.Linear(spec.hidden, (2 if self.swiglu else 1) * spec.ffn, bias=spec.bias)
        self.down = nn.Linear(spec.ffn, spec.hidden, bias=spec.bias)
        self.resid_dropout = _dropout(spec.resid_dropout)  # after the down projection (GPT-2's resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.resid_dropout(self.down(h))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, attention: str):
        super().__init__()
        self.parallel = spec.parallel_residual
        self.norm1, self.attn = make_norm(spec), Attention(spec, attention)
        self.norm2, self.mlp = make_norm(spec), MLP(spec)

    def forward(self, x: torch.Tensor, rope=None, mask=None) -> torch.Tensor:
        if self.parallel:  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x))
            return x + self.attn(self.norm1(x), rope, mask) + self.mlp(self.norm2(x))
        x = x + self.attn(self.norm1(x), rope, mask)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Decoder-only language model. ``forward(idx)`` returns logits (B, T, vocab)."""

    def __init__(self, spec: ModelSpec, attention: str = "sdpa"):
        super().__init__()
        self.spec, self.attention = spec, attention
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.pos = nn.Embedding(spec.max_positions, spec.hidden) if spec.pos == "learned" else None
        self.embed_dropout = _dropout(spec.embd_dropout)  # after the embedding sum (GPT-2's embd_pdrop)
        self.blocks = nn.ModuleList(Block(spec, attention) for _ in range(spec.layers))
        self.norm = make_norm(spec)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied:
            self.head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), output projections scaled by 1/√(2·layers)."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
            elif name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.spec.layers))
            else:
                nn.init.normal_(p, 0.0, std)

    def rope(self, T: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin tables for T positions, kept as non-persistent buffers (grown on demand) by an eager forward.

        Under torch.compile they are computed in the graph and not kept, whatever buffers an eager forward left:
        registering one inside a compiled forward changes the module, so dynamo's guard on it (``not hasattr(self,
        'rope_cos')``) fails at the next call and the whole graph is compiled again. The graph computes them with
        the same ops as the eager path (and as the first compiled step did when it registered them), once per
        forward: (T, rotary_dim/2) cos and sin, negligible beside a block."""
        if self.spec.pos != "rope":
            return None
        spec = self.spec
        if torch.compiler.is_compiling():
            return rotary_tables(spec.rotary_dim, T, spec.rope_theta, device, spec.rope_scaling, spec.max_positions)
        # a dynamic scaling's tables depend on the sequence's length once it is beyond max_positions
        length = T if spec.rope_type == "dynamic" and T > spec.max_positions else None
        cos = getattr(self, "rope_cos", None)
        if (cos is None or cos.shape[0] < T or cos.device != torch.device(device)
                or getattr(self, "rope_length", None) != length):
            cos, sin = rotary_tables(spec.rotary_dim, T, spec.rope_theta, device, spec.rope_scaling,
                                     spec.max_positions)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
            self.rope_length = length
        return self.rope_cos[:T], self.rope_sin[:T]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.embed(idx)  # (B, T, H)
        if self.pos is not None:
            x = x + self.pos(torch.arange(T, device=idx.device))
        x = self.embed_dropout(x)
        rope = self.rope(T, idx.device)
        if rope is not None:  # the dtype q and k will have: the autocast dtype, else the weights'
            dtype = torch.get_autocast_dtype(idx.device.type) if torch.is_autocast_enabled(idx.device.type) \
                else self.embed.weight.dtype
            rope = (rope[0].to(dtype), rope[1].to(dtype))
        mask = causal_mask(T, idx.device) if self.attention == "eager" else None  # shared by all blocks
        for block in self.blocks:
            x = block(x, rope, mask)
        return self.head(self.norm(x))  # (B, T, vocab)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1), ignore_index=ignore_index)


# ---- activation checkpointing --------------------------------------------------------------

# Ops whose outputs selective checkpointing keeps: the linear layers' matmuls, the fused
# attention kernels and, for eager attention, the softmax probabilities (what its backward
# needs; the T×T scores before them are recomputed). Norms, rotary and pointwise ops are
# recomputed in backward.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._softmax.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    """Wraps a block in ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, block: nn.Module, mode: str):
        super().__init__()
        self.block, self.mode = block, mode

    def forward(self, x, rope=None, mask=None):
        if not torch.is_grad_enabled():
            return self.block(x, rope, mask)
        if self.mode == "full":
            return checkpoint(self.block, x, rope, mask, use_reentrant=False)
        return checkpoint(self.block, x, rope, mask, use_reentrant=False,
                          context_fn=partial(create_selective_checkpoint_contexts, _selective_policy))


def apply_checkpointing(model: Transformer, mode: str) -> Transformer:
    """Wrap each block for ``full`` or ``selective`` checkpointing; ``none`` leaves the model as is."""
    if mode != "none":
        model.blocks = nn.ModuleList(Checkpointed(b, mode) for b in model.blocks)
    return model


def build_model(spec: ModelSpec, attention: str = "sdpa", checkpointing: str = "none",
                dtype: torch.dtype = torch.float32, device="cpu") -> Transformer:
    """The reference model for a spec, with checkpointing applied and weights in ``dtype``.

    Parameters are created directly in ``dtype`` on ``device`` (no fp32 copy to convert), which
    also works on fake tensors.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Transformer(spec, attention)
    finally:
        torch.set_default_dtype(previous)
    return apply_checkpointing(model, checkpointing)

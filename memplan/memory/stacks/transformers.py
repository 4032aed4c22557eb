"""The ``transformers`` stack: Hugging Face transformers' model and ``Trainer`` step, with peft's LoRA (torch-free).

The step ``memplan trace --stack transformers`` traces (``trainer/stacks/transformers.py``), for the llama,
gpt2 and gpt_neox families, and for phi, gemma, stablelm and qwen3, which memplan's own trainer does not
build (``memplan.model.STACK_ARCHS``: ``--stack memplan`` refuses them). Each hook below is a small pure
function whose docstring names the tensor it adds (or removes) beyond memplan's own step and the line of
transformers (or peft) that makes it; ``TransformersStack`` calls them at the walk's fixed points.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import ClassVar

from memplan.errors import InputError
from memplan.memory.stacks.base import FP32, HALF, MASK, Stack, _a, _n, _r
from memplan.memory.terms import (lora_adapter_shapes, lora_input_casts_bytes, lora_params, lora_tensors,
                                  model_code_resident_bytes, norm_output_bytes, norm_stat_bytes,
                                  trainer_datasets_resident_bytes)
from memplan.setup import LORA_TARGET_NAMES, QKV_PARTS

TRANSFORMERS_ARCHS = ("llama", "gpt2", "gpt_neox", "phi", "gemma", "stablelm", "qwen3")  # the families the hooks walk
FUSED_QKV_ARCHS = ("gpt2", "gpt_neox")  # one c_attn / query_key_value matrix; the others have q_proj, k_proj, v_proj


def hf_norm_saved_bytes(spec, setup) -> int:
    """What one of transformers' ``LlamaRMSNorm`` (``GemmaRMSNorm``) saves beyond memplan's fused norm
    (input and rstd).

    ``hidden_states = hidden_states.to(torch.float32)`` (modeling_llama.py, LlamaRMSNorm.forward;
    gemma: ``self._norm(x.float())``): under pure bf16 a new fp32 copy of the input, n·H·4, saved by
    ``pow`` and by the multiply with ``rsqrt`` in place of the bf16 input itself, n·H·2, which
    memplan's norm saves (under fp32 and autocast the residual is fp32 already: ``.to`` returns it,
    the same tensor). llama: ``self.weight * hidden_states.to(input_dtype)`` saves the normalised
    input, n·H·r; gemma: ``output * (1.0 + self.weight.float())`` saves it in fp32, n·H·4 (modeling_gemma.py,
    GemmaRMSNorm.forward: ``(x * w).to(float16)``, the cast after), both for the weight's gradient
    (not when the weight is frozen, under LoRA). LayerNorm (gpt2, gpt_neox, phi, stablelm) is
    ``F.layer_norm``, memplan's own: 0."""
    if spec.norm != "rmsnorm":
        return 0
    return _n(setup) * spec.hidden * (FP32 - _r(setup)) + hf_norm_weight_input_bytes(spec, setup)


def hf_norm_weight_input_bytes(spec, setup) -> int:
    """Of ``hf_norm_saved_bytes``, the normalised input the weight's multiply saves for the weight's gradient:
    llama's ``self.weight * hidden_states.to(input_dtype)``, n·H·r; gemma's ``output * (1.0 + self.weight.float())``,
    n·H·4. 0 when the weight is frozen (LoRA) or the norm is LayerNorm."""
    if spec.norm != "rmsnorm" or setup.lora_rank:
        return 0
    return _n(setup) * spec.hidden * (FP32 if spec.arch == "gemma" else _r(setup))


def hf_attention_saved_bytes(spec, setup) -> int:
    """What transformers' attention saves beyond (or short of) memplan's, per block.

    eager: ``softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)`` (llama's and
    gpt_neox's ``eager_attention_forward``; gpt2's ``softmax`` under autocast is fp32 too, then
    ``attn_weights.type(value.dtype)``): softmax saves its fp32 output, B·heads·T²·4, besides the
    low-precision copy the matmul with V saves (memplan counts that one); 0 in fp32, and for
    gpt2 under pure bf16 (its softmax stays bf16). With attention dropout (``attn_weights =
    module.attn_dropout(attn_weights)`` after the cast, ``eager_attention_forward``) the matmul saves
    the dropped probabilities instead (``memory.attn_dropout_saved_bytes``), and the low-precision
    copy is saved by nothing (the dropout keeps its mask only): B·heads·T²·a less, beside the fp32
    softmax output. (memplan's softmax runs in the compute dtype and saves that copy itself.)

    sdpa with rotary positions and separate q_proj, k_proj, v_proj (llama, phi, gemma, stablelm,
    qwen3): ``q_embed = (q * cos) + (rotate_half(q) * sin)`` (``apply_rotary_pos_emb``) saves only
    cos and sin (shared by the blocks); a partial rotary (phi, stablelm: ``torch.cat((query_rot,
    query_pass), dim=-1)``) saves no more; SDPA saves q_embed, k_embed and v, v_proj's own output.
    memplan's rotary saves the fused qkv output as well: n·(q_dim + kv)·a less. (gpt_neox's v is a
    view of its fused query_key_value output, which SDPA keeps whole, as memplan's.)"""
    n, a = _n(setup), _a(setup)
    scores = setup.micro_batch * spec.heads * setup.ctx * setup.ctx
    if setup.attention == "eager":
        fp32_softmax = a != FP32 and (spec.arch != "gpt2" or setup.mixed)
        return scores * (FP32 - (a if spec.attn_dropout else 0)) if fp32_softmax else 0
    if spec.pos == "rope" and spec.arch not in FUSED_QKV_ARCHS:
        return -n * (spec.q_dim + spec.kv_dim) * a
    return 0


def hf_softmax_backward_bytes(spec, setup) -> int:
    """What the backward of transformers' fp32 softmax holds at once beyond the walk's softmax backward
    (the probabilities' gradient and the scores' gradient at a, the saved probabilities at a, and the fp32
    softmax output ``hf_attention_saved_bytes`` counts).

    ``attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)``
    (modeling_llama.py, eager_attention_forward; qwen3, gemma, phi, stablelm and gpt_neox alike): the
    ``.to``'s backward casts the probabilities' gradient to fp32 (B·heads·T²·4), and
    ``_softmax_backward_data`` makes the fp32 gradient of the scores (B·heads·T²·4) while it and the saved
    fp32 output (B·heads·T²·4) are alive; the low-precision probabilities ``torch.matmul(attn_weights,
    value_states)`` saved are gone by then (that matmul's backward released them). HF holds 12 where the
    walk holds 4 + 3·a per score: (8 − 3·a)·B·heads·T² where a is 16-bit. 0 under fp32, under SDPA, and
    where the softmax is not fp32 (``hf_attention_saved_bytes``: gpt2 under pure bf16)."""
    a = _a(setup)
    if setup.attention != "eager" or a == FP32 or (spec.arch == "gpt2" and not setup.mixed):
        return 0
    return max(0, (2 * FP32 - 3 * a) * setup.micro_batch * spec.heads * setup.ctx * setup.ctx)


CAT_ROTARY_ARCHS = ("gpt_neox", "phi", "stablelm")  # partial rotary: torch.cat((query_rot, query_pass), dim=-1)


def hf_sdpa_output_copy_bytes(spec, setup, dropout: float = 0.0) -> int:
    """The contiguous copy of SDPA's output the out-projection saves where q comes from ``torch.cat``.

    gpt_neox, phi and stablelm rotate part of each head and put it back with ``query_states =
    torch.cat((query_rot, query_pass), dim=-1)`` (modeling_phi.py, PhiAttention.forward): the result
    is contiguous in (B, heads, T, hd), SDPA's output comes back in that layout, and
    ``attn_output.transpose(1, 2).contiguous()`` (integrations/sdpa_attention.py,
    sdpa_attention_forward) copies it, n·q_dim·a, which ``dense`` / ``o_proj`` saves beside the
    output SDPA saves itself. (llama's rotary is elementwise on the (B, T, heads, hd) projection:
    the transpose back is a view, as in memplan's model.) 0 under eager attention, whose
    transposed copy memplan counts (``memory.attention_output_copy_bytes``). Under LoRA the frozen
    out-projection saves nothing; peft's ``lora_A`` saves the copy itself only where it takes it
    as it is: in fp32, without dropout (else it saves its cast or its dropout's output, which
    ``hf_lora_saved_bytes`` counts)."""
    if setup.attention != "sdpa" or spec.arch not in CAT_ROTARY_ARCHS or spec.pos != "rope":
        return 0
    if setup.lora_rank and ("proj" not in setup.lora or dropout > 0 or setup.precision != "fp32"):
        return 0
    return _n(setup) * spec.q_dim * _a(setup)


def hf_autocast_input_casts_bytes(spec, setup) -> int:
    """The bf16 copies of a norm's output that transformers' separate projections each make and save
    under autocast, beyond memplan's one per norm.

    Autocast caches the cast of a leaf weight only (``cached_cast``: ``arg.is_leaf() &&
    arg.requires_grad()``); an activation is cast anew by every op that takes it. llama's
    ``self.q_proj(hidden_states)``, ``self.k_proj(...)``, ``self.v_proj(...)`` (modeling_llama.py,
    LlamaAttention.forward; phi, gemma, stablelm, qwen3 alike) each cast the fp32 norm output to
    bf16 and save their copy, n·H·2; ``gate_proj(x)`` and ``up_proj(x)`` (LlamaMLP) two more. memplan
    fuses each group in one matmul and casts once. Extra copies: (readers − 1) per norm, readers =
    3 (q, k, v) or 1 (gpt2's c_attn, gpt_neox's query_key_value) for attention, 2 (gate, up) or 1
    (fc1) for the MLP, all of them reading one norm where it is shared (phi; memplan's second norm
    output is taken out by ``hf_shared_norm_saved_bytes``). 0 without autocast, and under LoRA (a
    frozen projection saves no input; peft's casts are ``hf_lora_saved_bytes``)."""
    if not setup.mixed or setup.lora_rank:
        return 0
    attention = 1 if spec.arch in FUSED_QKV_ARCHS else 3
    mlp = 2 if spec.mlp == "swiglu" and spec.arch in TRANSFORMERS_ARCHS and spec.arch not in FUSED_QKV_ARCHS else 1
    extra = attention + mlp - 1 if spec.shared_norm else (attention - 1) + (mlp - 1)
    return extra * _n(setup) * spec.hidden * HALF


def hf_shared_norm_saved_bytes(spec, setup, dropout: float = 0.0) -> int:
    """What a block with one shared norm saves less than memplan's parallel block with two (gpt_neox's).

    phi: ``hidden_states = self.input_layernorm(hidden_states)`` feeds both ``self.self_attn`` and
    ``self.mlp(hidden_states)`` (modeling_phi.py, PhiDecoderLayer.forward); stablelm with
    ``use_parallel_residual`` likewise (``post_attention_layernorm = None``). One LayerNorm's
    statistics (n·2·r) are saved, not two, and its output (n·H·a, as the first matmuls save it)
    once where memplan counts one per norm whose matmul trains ([qkv adapted] + [up adapted] under
    LoRA, 2 without): −stats − (count − 1)·n·H·a; 0 for two norms.

    Under LoRA the output is shared only where the adapters save the norm's output itself (fp32 or pure
    bf16, dropout 0: ``lora_A(x)``). Under autocast each adapter's ``lora_A`` casts the fp32 output anew
    and saves its own bf16 copy, and with dropout each saves its own dropout output (peft's
    ``lora_A(dropout(x))``, per module): q, k, v and fc1 save four tensors of n·H·a. ``hf_lora_saved_bytes``
    counts them as memplan's one norm output per adapted group plus the group's other readers, so both of
    memplan's norm outputs stand (count 0). (Phi-2, 32 layers, ctx 2048, bf16-mixed, LoRA rank 8 on q, k,
    v, dense, fc1, fc2: the walk was 0.82% under its trace, n·H·2 short per layer.)"""
    if not spec.shared_norm:
        return 0
    if setup.lora_rank:
        kept = ("qkv" in setup.lora) + ("up" in setup.lora)
        own_copies = setup.mixed or dropout > 0
        counted = 0 if own_copies else kept - (1 if kept else 0)
    else:
        counted = 1
    return -norm_stat_bytes(spec, setup) - counted * norm_output_bytes(spec, setup)


def hf_gelu_new_saved_bytes(spec, setup, cpu: bool = False) -> int:
    """What transformers' ``NewGELUActivation`` (phi's ``hidden_act="gelu_new"``) saves beyond
    memplan's fused GELU (which saves only its input, fc1's output).

    ``0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 *
    torch.pow(input, 3.0))))`` (transformers/activations.py, NewGELUActivation.forward), in Python
    ops: ``tanh`` saves its output, and the last multiply saves both factors, ``0.5 * input`` and
    ``1.0 + tanh(...)``: 3·n·F·a (``pow`` saves fc1's output, memplan's own). Under autocast on
    CUDA ``pow`` is on autocast's fp32 list: it saves an fp32 copy of its input, and ``tanh`` and
    ``1.0 + tanh`` follow in fp32: n·F·(4 + 4 + 4 + 2). 0 for any other activation."""
    if spec.act != "gelu_new":
        return 0
    n, f, a = _n(setup), spec.ffn, _a(setup)
    if setup.mixed and not cpu:
        return n * f * (3 * FP32 + HALF)
    return 3 * n * f * a


def hf_gelu_new_backward_bytes(spec, setup) -> int:
    """The gradients ``NewGELUActivation``'s backward holds at once beyond memplan's one GELU input
    gradient (n·F·a): autograd runs the Python ops of ``0.5 * input * (1.0 + torch.tanh(...))``
    (transformers/activations.py) backward one by one; the last product's backward makes the
    gradients of both factors, ``0.5 * input`` and ``1.0 + tanh(...)`` (n·F·a each), and the
    second is taken through ``tanh``, the scaling and ``pow`` (each step's gradient replacing the
    one before) while the first waits to be summed into the input's gradient: n·F·a more at once.
    0 for any other activation."""
    if spec.act != "gelu_new":
        return 0
    return _n(setup) * spec.ffn * _a(setup)


HF_RMSNORM_BACKWARD_FP32_BUFFERS = 5  # the n·H fp32 gradients LlamaRMSNorm's backward holds at once (below)


def hf_rmsnorm_backward_bytes(spec, setup, held: int, saved_held: bool = True) -> int:
    """What transformers' ``LlamaRMSNorm`` (``GemmaRMSNorm``, ``Qwen3RMSNorm``) backward holds at once beyond the
    ``held`` bytes memplan's fused norm backward holds at its peak (its two fp32 buffers, the fp32 copy of a
    16-bit gradient, the incoming gradient) and, where the walk still holds the norm's own saved tensors
    (``saved_held``), beyond the normalised input the weight's multiply saved (``hf_norm_weight_input_bytes``).

    LlamaRMSNorm.forward (modeling_llama.py) is Python ops on ``hidden_states.to(torch.float32)``:
    ``variance = hidden_states.pow(2).mean(-1, keepdim=True)``, ``hidden_states * torch.rsqrt(variance +
    eps)``, then the weight's multiply (gemma: ``x.float()``, ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
    + eps)``, ``output * (1.0 + self.weight.float())``). Autograd runs their backward one by one: the multiply
    by ``rsqrt`` gives the fp32 input's first gradient (n·H·4), which waits in autograd's input buffer to be
    summed with the second; ``mean``'s backward expands and divides (n·H·4); ``pow``'s backward is
    ``grad * (2 * x.pow(1))`` (``pow_backward``), three n·H·4 tensors alive together at its last multiply.
    Five fp32 n·H buffers at once; the incoming gradient and the weight's saved input are gone by then (the
    weight's multiply, whose backward ran first, consumed the one and released the other): 5·n·H·4 − held −
    the saved input, where that is more. LayerNorm (gpt2, gpt_neox, phi, stablelm) is ``F.layer_norm``,
    memplan's own: 0."""
    if spec.norm != "rmsnorm":
        return 0
    released = hf_norm_weight_input_bytes(spec, setup) if saved_held else 0
    return max(0, HF_RMSNORM_BACKWARD_FP32_BUFFERS * _n(setup) * spec.hidden * FP32 - held - released)


def hf_qk_norm_saved_bytes(spec, setup) -> int:
    """What qwen3's per-head RMSNorms on q and k save (memplan's model has none).

    ``self.q_norm(self.q_proj(hidden_states).view(hidden_shape))`` (modeling_qwen3.py,
    Qwen3Attention.forward; Qwen3RMSNorm is LlamaRMSNorm): ``hidden_states.to(torch.float32)``,
    saved by ``pow`` and the multiply with ``rsqrt`` (n·q_dim·4: q_proj's own output in fp32, else an
    fp32 copy), ``rsqrt``'s output (n·heads·4), and the normalised q in q's dtype, saved by
    ``self.weight * ...`` (n·q_dim·a; not when the weight is frozen, under LoRA). Likewise for k
    (kv, kv_heads). 0 without qk norms."""
    if not spec.qk_norm:
        return 0
    n, a = _n(setup), _a(setup)
    width = spec.q_dim + spec.kv_dim
    out = n * width * FP32 + n * (spec.heads + spec.kv_heads) * FP32
    if not setup.lora_rank:
        out += n * width * a
    return out


def hf_qk_rotary_held_bytes(spec, setup) -> int:
    """qwen3's rotary outputs in fp32 under autocast, held by Qwen3Attention.forward's locals through attention
    and o_proj (memplan's rotary output is bf16, the cast SDPA or eager attention's matmul saves).

    ``return self.weight * hidden_states.to(input_dtype)`` (modeling_qwen3.py, Qwen3RMSNorm.forward): the
    fp32 weight times the bf16 normalised input is fp32 (elementwise ops are not autocast ops), so
    ``q_embed = (q * cos) + (rotate_half(q) * sin)`` (apply_rotary_pos_emb) is fp32 too, and
    ``query_states, key_states = apply_rotary_pos_emb(...)`` keeps both, n·(q_dim + kv)·4, until the
    attention's forward returns; SDPA (``sdpa_attention_forward``) and eager's ``torch.matmul`` save their
    own bf16 casts (the walk's rotated q and k). 0 without qk norms or autocast (the rotary output is
    then in the compute dtype: the walk's own)."""
    if not spec.qk_norm or not setup.mixed:
        return 0
    return _n(setup) * (spec.q_dim + spec.kv_dim) * FP32


def hf_qk_rotary_transient_bytes(spec, setup) -> int:
    """What qwen3's qk norms and rotary hold at once beyond the walk's tensors, while k is rotated.

    ``query_states = self.q_norm(...)``, ``key_states = self.k_norm(...)`` (modeling_qwen3.py,
    Qwen3Attention.forward), then ``k_embed = (k * cos) + (rotate_half(k) * sin)`` (apply_rotary_pos_emb):
    at its second multiply the norms' outputs q and k (n·(q_dim + kv)·o, o = 4 under fp32 and autocast, 2
    under pure bf16: the dtype of ``self.weight * hidden_states.to(input_dtype)``), q_embed (n·q_dim·o),
    ``k * cos``, ``rotate_half(k)`` and their product (3·n·kv·o) are alive; q_proj's and k_proj's own
    outputs are not (``hidden_states.to(torch.float32)`` copies them; fp32: the copy is the output, which
    ``hf_qk_norm_saved_bytes`` counts). The walk holds at that point its fused qkv output's q and k
    (n·(q_dim + kv)·a), its rotated q and k (n·(q_dim + kv)·a) and, under autocast, the fp32 rotary
    outputs (``hf_qk_rotary_held_bytes``): o·n·(2·q_dim + 4·kv) − 2·a·n·(q_dim + kv) − held. 0 without
    qk norms."""
    if not spec.qk_norm:
        return 0
    n, a, o = _n(setup), _a(setup), _r(setup)
    q, kv = spec.q_dim, spec.kv_dim
    return max(0, o * n * (2 * q + 4 * kv) - 2 * a * n * (q + kv) - hf_qk_rotary_held_bytes(spec, setup))


def hf_qk_norm_backward_bytes(spec, setup) -> int:
    """What qwen3's qk norms' backward holds at once beyond the walk's attention gradients (dq, dk, dv at a).

    Qwen3RMSNorm is LlamaRMSNorm's Python ops (``hf_rmsnorm_backward_bytes``): five fp32 buffers of the
    normalised width at once. k_norm's backward runs first (its nodes are the later ones): beside its five
    n·kv·4 buffers, dq (q_norm's output gradient, n·q_dim·o, o the norm output's dtype) and dv (n·kv·a) wait;
    the walk holds dq, dk, dv at a, and k_norm's bf16 normalised input (n·kv·a, saved by the weight's
    multiply where it trains), which its backward has released by then. q_norm's follows, with dk (k_proj's
    output gradient, n·kv·a) and dv waiting, beside its five n·q_dim·4 buffers; by then k_norm's saved fp32
    copy and normalised input are gone too, and q_norm's normalised input. The larger of the two. 0 without
    qk norms."""
    if not spec.qk_norm:
        return 0
    n, a, o = _n(setup), _a(setup), _r(setup)
    q, kv = spec.q_dim, spec.kv_dim
    normed = 0 if setup.lora_rank else a  # the weight's multiply saves its input where the weight trains
    walk = n * (q + 2 * kv) * a
    k_first = n * q * o + n * kv * a + HF_RMSNORM_BACKWARD_FP32_BUFFERS * n * kv * FP32 - walk - n * kv * normed
    q_next = (2 * n * kv * a + HF_RMSNORM_BACKWARD_FP32_BUFFERS * n * q * FP32 - walk
              - n * q * normed - n * kv * (FP32 + normed))
    return max(0, k_first, q_next)


def hf_lora_modules(spec, matrix: str, setup=None) -> list[tuple[int, int]]:
    """(in, out) of each peft-adapted module standing for memplan's fused ``matrix``: llama's
    q_proj, k_proj, v_proj (``qkv``; with ``setup`` those of q, k, v adapted alone only) and gate_proj,
    up_proj (``up``) are separate ``nn.Linear``, each with its own adapter (peft
    ``LoraLayer.update_layer``); gpt2's c_attn and gpt_neox's query_key_value are fused, as memplan's;
    ``head``: ``lm_head`` (H → V)."""
    h, q, kv, f = spec.hidden, spec.q_dim, spec.kv_dim, spec.ffn
    qkv = [(h, q), (h, kv), (h, kv)] if spec.arch not in FUSED_QKV_ARCHS else [(h, q + 2 * kv)]
    if setup is not None and spec.arch not in FUSED_QKV_ARCHS and "qkv" not in setup.lora_adapters:
        qkv = [m for m, part in zip(qkv, QKV_PARTS) if part in setup.lora_adapters]
    up = [(h, f), (h, f)] if spec.mlp == "swiglu" else [(h, f)]  # gate_proj and up_proj; fc1 (phi)
    return {"qkv": qkv, "proj": [(q, h)], "up": up, "down": [(f, h)], "head": [(h, spec.vocab)]}[matrix]


PEFT_ADAPTER_BYTES = FP32  # peft keeps adapters fp32: get_peft_model(autocast_adapter_dtype=True) upcasts bf16 ones


def hf_lora_params(spec, setup) -> int:
    """Adapter parameters peft makes: r·(in + out) per adapted module (``hf_lora_modules``), over the layers,
    and lm_head's r·(H + V)."""
    if not setup.lora_rank:
        return 0
    head = setup.lora_rank * (spec.hidden + spec.vocab) if setup.lora_head else 0  # lm_head's
    return spec.layers * sum(setup.lora_rank * (i + o) for m in setup.lora for i, o in hf_lora_modules(spec, m, setup)) + head


def hf_lora_tensors(spec, setup) -> int:
    """Adapter parameter tensors peft makes: A and B per adapted module, over the layers, and lm_head's two."""
    if not setup.lora_rank:
        return 0
    return 2 * spec.layers * sum(len(hf_lora_modules(spec, m, setup)) for m in setup.lora) + 2 * setup.lora_head


def hf_lora_bytes_delta(spec, setup) -> int:
    """Bytes of peft's adapters beyond memplan's (their weights; their gradients alike): peft's
    parameters (``hf_lora_params``) in fp32, ``get_peft_model(..., autocast_adapter_dtype=True)``
    upcasting bf16 adapters (peft ``tuners_utils._cast_adapter_dtype``), less memplan's
    (``memory.lora_params`` · p)."""
    if not setup.lora_rank:
        return 0
    return hf_lora_params(spec, setup) * PEFT_ADAPTER_BYTES - lora_params(spec, setup) * setup.param_bytes


def hf_lora_saved_bytes(spec, setup, dropout: float, cpu: bool = False) -> int:
    """What peft's adapters save beyond memplan's, per block.

    peft ``lora.Linear.forward``: ``x = self._cast_input_dtype(x, lora_A.weight.dtype)`` (fp32:
    ``PEFT_ADAPTER_BYTES``), then ``result = result + lora_B(lora_A(dropout(x))) * scaling``, the
    cast, the dropout and the adapter per module. ``lora_A`` saves its input: under autocast the
    bf16 copy it casts (n·in·2), else the fp32 input (n·in·4). With ``lora_dropout`` 0
    (``nn.Identity``) an fp32 input is shared by the modules (one copy, as memplan's); any cast is
    per module. With ``lora_dropout`` > 0, ``lora_A``'s input is the dropout's output, per module,
    and ``nn.Dropout`` saves its mask: n·in·1 (bool) where ATen's fused ``native_dropout`` runs
    (CUDA), n·in·4 on the CPU (ATen's ``_dropout_impl``: ``noise = empty_like(input).bernoulli_(1 -
    p)``, in the fp32 input's dtype). memplan's adapter saves its input once, n·in·a. Each module's
    x·Aᵀ (n·r, 2 bytes under autocast, else 4) for memplan's one n·r·a per fused matrix. Inputs:
    the norm output for qkv and up (r bytes), the attention output and the MLP product for proj
    and down (a bytes)."""
    if not setup.lora_rank:
        return 0
    return sum(hf_lora_matrix_saved_bytes(spec, setup, m, dropout, cpu) for m in setup.lora)


def hf_lora_matrix_saved_bytes(spec, setup, matrix: str, dropout: float, cpu: bool = False) -> int:
    """Of ``hf_lora_saved_bytes``, what the adapters on ``matrix`` save beyond memplan's: their input's cast,
    mask and dropout output (``hf_lora_input_saved_bytes``) for memplan's saved input, each module's x·Aᵀ
    (n·r·kept) for memplan's one n·r·a. Made where the adapter runs (``Stack.adapter_saved_bytes``); 0 for a
    matrix without an adapter."""
    if not setup.lora_rank or matrix not in setup.lora:
        return 0
    n, a, rank = _n(setup), _a(setup), setup.lora_rank
    kept = HALF if setup.mixed else PEFT_ADAPTER_BYTES  # what lora_A saves per module, per element
    out = hf_lora_input_saved_bytes(spec, setup, matrix, dropout, cpu) - memplan_lora_input_bytes(spec, setup, matrix, dropout)
    modules, adapters = hf_lora_modules(spec, matrix, setup), lora_adapter_shapes(spec, setup, matrix)
    return out + len(modules) * n * rank * kept - len(adapters) * n * rank * a


def hf_lora_adapter_made_bytes(spec, setup, matrix: str, dropout: float, cpu: bool = False) -> int:
    """Of ``hf_lora_matrix_saved_bytes``, what changes where the adapters on ``matrix`` run: the tensors peft
    saves (its cast, mask and dropout output, each module's x·Aᵀ), and for qkv and proj the input memplan's
    adapter would save, which nothing saves here and which dies with attention (the decoder layer reassigns
    ``hidden_states = self.self_attn(...)``; ``attn_output = self.o_proj(attn_output)``, modeling_llama.py).
    up's and down's inputs, the MLP's input and the product, stay alive until the MLP's forward returns
    (``down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))``, LlamaMLP.forward):
    the walk releases them with the block's other tensors, after the MLP."""
    made = hf_lora_matrix_saved_bytes(spec, setup, matrix, dropout, cpu)
    if matrix in ("up", "down"):
        made += memplan_lora_input_bytes(spec, setup, matrix, dropout)
    return made


def hf_recompute_gradient_bytes(spec, setup) -> int:
    """The gradients autograd makes in a checkpointed block's backward before its recomputation starts
    (transformers' layers under ``gradient_checkpointing_enable()``, down_proj adapted by peft).

    torch.utils.checkpoint (non-reentrant) recomputes when the first node of the block unpacks a saved
    tensor. The nodes run before it save nothing: the residual add, ``result.to(torch_result_dtype)`` and
    ``result + lora_B(...) * scaling`` (peft ``lora.Linear.forward``). Their backward leaves the gradient of
    the base matmul's output in its dtype, n·H·a, a tensor of its own where a is 16-bit (under autocast the
    residual add casts the fp32 gradient; under pure bf16 ``.to``'s backward upcasts it to the fp32 of
    peft's ``result`` and the add casts it back for the bf16 base output; in fp32 it is the incoming
    gradient itself), and ``* scaling``'s backward the gradient of lora_B's output, n·H·e (e = 2 under
    autocast, else 4: peft's fp32 adapter). Both live through the recomputation, which lora_B's backward,
    the next node, starts. 0 without a down adapter or checkpointing."""
    if not setup.lora_rank or "down" not in setup.lora or setup.checkpointing != "full":
        return 0
    n, h, a = _n(setup), spec.hidden, _a(setup)
    e = HALF if setup.mixed else PEFT_ADAPTER_BYTES
    return (n * h * a if a != FP32 else 0) + n * h * e


def hf_recompute_locals_bytes(spec, setup, dropout: float) -> int:
    """The MLP's input and down's input, alive as Python locals when a recomputation stops inside down_proj's
    adapter (``hf_recompute_down_adapter_bytes``), where the walk holds neither.

    ``down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))`` (modeling_llama.py,
    LlamaMLP.forward; gpt2's and gpt_neox's MLPs alike): ``x``, the MLP norm's output (n·H·r: fp32 under
    autocast), is alive until the MLP's forward returns, and down's input (the product, or the activation's
    output, n·F·a) is peft's ``x`` in ``lora.Linear.forward``. Neither is saved when peft's lora_A saves a
    tensor of its own (a cast, a dropout output), so the walk counts their places as peft's
    (``memplan_lora_input_bytes``); in fp32 without dropout lora_A saves them themselves, and the walk holds
    them: 0."""
    if not setup.lora_rank or "down" not in setup.lora or setup.checkpointing != "full":
        return 0
    if setup.precision == "fp32" and dropout == 0:
        return 0
    n = _n(setup)
    mlp_in = n * spec.hidden * _r(setup) if "up" in setup.lora else 0
    return mlp_in + n * spec.ffn * _a(setup)


def hf_recompute_down_adapter_bytes(spec, setup, dropout: float) -> int:
    """What down_proj's peft adapter holds, unsaved, when the recomputation of a checkpointed block stops.

    torch.utils.checkpoint's non-reentrant recomputation (``_checkpoint_hook``, ``early_stop``) stops once
    the last tensor the block's backward needs has been saved again: lora_B's input, lora_A's output, in
    down_proj's ``result = result + lora_B(lora_A(dropout(x))) * scaling`` (peft ``lora.Linear.forward``). By
    then ``result = self.base_layer(x)`` exists (n·H·a), and, beside what lora_A saves
    (``hf_lora_input_saved_bytes``), ``x = self._cast_input_dtype(x, lora_A.weight.dtype)``, n·F·4, where x
    is not fp32 and the cast is not lora_A's input (under autocast, whose mm casts it again; with dropout),
    and the dropout's output, n·F·4, under autocast (lora_A saves its bf16 cast instead). 0 without a down
    adapter or checkpointing."""
    if not setup.lora_rank or "down" not in setup.lora or setup.checkpointing != "full":
        return 0
    n, f, a = _n(setup), spec.ffn, _a(setup)
    cast = n * f * PEFT_ADAPTER_BYTES if a != PEFT_ADAPTER_BYTES and (setup.mixed or dropout > 0) else 0
    dropped = n * f * PEFT_ADAPTER_BYTES if setup.mixed and dropout > 0 else 0
    return n * spec.hidden * a + cast + dropped


def hf_lora_input_saved_bytes(spec, setup, matrix: str, dropout: float, cpu: bool = False) -> int:
    """What peft's adapters on ``matrix`` save of their input (``hf_lora_saved_bytes``'s cast, mask and
    dropout output, per module; one shared fp32 input without dropout): the tensors ``lora_A`` (and
    ``nn.Dropout``) release in their own backward, before the frozen base matmul's input gradient
    is made. 0 for a matrix without an adapter."""
    if not setup.lora_rank or matrix not in (*setup.lora, *("head",) * setup.lora_head):
        return 0
    n, a = _n(setup), _a(setup)
    kept = HALF if setup.mixed else PEFT_ADAPTER_BYTES
    modules = hf_lora_modules(spec, matrix, setup)
    k, width = len(modules), modules[0][0]
    x = _r(setup) if matrix in ("qkv", "up", "head") else a  # a norm's output, in the residual's dtype
    if dropout > 0:
        return k * n * width * ((PEFT_ADAPTER_BYTES if cpu else MASK) + kept)
    if not setup.mixed and x == PEFT_ADAPTER_BYTES:
        return n * width * x
    return k * n * width * kept


def memplan_lora_input_bytes(spec, setup, matrix: str, dropout: float) -> int:
    """What memplan's walk counts as the saved input of ``matrix``'s adapter, which peft's saved input
    (``hf_lora_input_saved_bytes``) replaces: n·in·a (a norm output, the MLP product, eager
    attention's transposed output), but 0 for proj under SDPA where peft saves a new tensor (its
    cast, or its dropout's output): memplan's proj reads SDPA's output, which SDPA saves itself
    (``memory.layer_activation_terms``' attention), and that stays saved beside peft's copy. (In
    fp32 without dropout peft's lora_A takes SDPA's output as it is: nothing new.) Plus, for q, k, v
    adapted alone under autocast, memplan's later adapters' own casts of the input
    (``terms.lora_input_casts_bytes``)."""
    if not setup.lora_rank or matrix not in setup.lora:
        return 0
    fresh = dropout > 0 or setup.precision != "fp32"
    if matrix == "proj" and setup.attention == "sdpa" and fresh:
        return 0
    return _n(setup) * hf_lora_modules(spec, matrix, setup)[0][0] * _a(setup) + lora_input_casts_bytes(spec, setup, matrix)


def hf_lora_head_saved_bytes(spec, setup, dropout: float, cpu: bool = False, frozen_input: bool = False) -> int:
    """What peft's adapter on ``lm_head`` (``--lora-targets head``) saves beyond memplan's head adapter: its
    input as ``lora_A`` keeps it (``hf_lora_input_saved_bytes``: the fp32 final norm output itself; its
    autocast copy; under pure bf16 its fp32 cast by ``_cast_input_dtype``, n·H·4; with ``lora_dropout``
    > 0 the dropout's output and mask), for memplan's n·H·a (the walk's ``head_in``), and x·Aᵀ in the
    adapter's dtype (n·r·4 for fp32 adapters on a cast input, 2 under autocast) for memplan's n·r·a.
    Where the head's input needs no gradient (``frozen_input``: no block trains) the dropout keeps no mask
    (``lib_lora_head_saved_bytes``). 0 without a head adapter."""
    if not setup.lora_head:
        return 0
    n, a = _n(setup), _a(setup)
    kept = HALF if setup.mixed else PEFT_ADAPTER_BYTES
    mask = n * spec.hidden * (PEFT_ADAPTER_BYTES if cpu else MASK) if dropout > 0 and frozen_input else 0
    return (hf_lora_input_saved_bytes(spec, setup, "head", dropout, cpu) - n * spec.hidden * a
            + n * setup.lora_rank * (kept - a) - mask)


def hf_lora_head_input_held_bytes(spec, setup, dropout: float) -> int:
    """The final norm's output, n·H·4, held by ``LlamaForCausalLM.forward`` (``hidden_states =
    outputs.last_hidden_state``, then ``logits = self.lm_head(hidden_states[...])`` and the loss, in the same
    frame) until the forward returns, where peft's lm_head adapter saves another tensor in its place: in
    fp32 with ``lora_dropout`` > 0 the dropout's output (without dropout lora_A saves that very tensor;
    under autocast and pure bf16 the walk's final norm already leaves its output alive). 0 otherwise."""
    if not setup.lora_head or dropout <= 0 or setup.precision not in ("fp32", "tf32"):
        return 0
    return _n(setup) * spec.hidden * FP32


def hf_lora_input_grad_bytes(spec, setup, matrix: str) -> int:
    """The input gradient one of peft's ``lora_A`` makes in its backward, before it is cast back:
    n·in·e in the adapter's dtype (e = 4: fp32 adapters on an input cast by ``_cast_input_dtype``;
    2 under autocast), the backward of ``x.to(lora_A.weight.dtype)`` then casting it to the
    input's dtype (n·in·a). 0 for a matrix without an adapter."""
    if not setup.lora_rank or matrix not in setup.lora:
        return 0
    e = HALF if setup.mixed else PEFT_ADAPTER_BYTES
    return _n(setup) * hf_lora_modules(spec, matrix, setup)[0][0] * e



def hf_first_block_unsaved_bytes(spec, setup, dropout: float = 0.0, cpu: bool = False) -> int:
    """What transformers' first block does not save of this stack's own tensors (``Stack.block_saved_bytes``)
    under LoRA without checkpointing: nothing below it trains (embedding and norms frozen, and no
    ``enable_input_require_grads()`` without checkpointing), so an op saves nothing until an
    adapter's output has joined its input. The first ``LlamaRMSNorm`` never saves its fp32 copy
    (``hf_norm_saved_bytes``); without a qkv adapter neither attention's own tensors
    (``hf_attention_saved_bytes``, ``hf_qk_norm_saved_bytes``) nor, unless proj trains (or the
    block is parallel: its MLP norm reads the frozen input), the second norm's; with the MLP's
    input frozen and no up adapter, neither ``NewGELUActivation``'s (``hf_gelu_new_saved_bytes``).
    With ``lora_dropout`` > 0, an adapter whose input is frozen keeps no dropout mask: ``input *
    noise`` (ATen ``_dropout_impl``; CUDA's ``native_dropout`` alike) records nothing for an input
    that needs no gradient, so the mask dies with the op, n·in·(4 on the CPU, 1 on CUDA) per module
    (the dropout's output, lora_A's input, stays). With a proj adapter but no qkv one, SDPA's output
    needs no gradient and SDPA saves nothing (n·q·a, ``sdpa_output_bytes``, which memplan keeps as
    its proj adapter's input) where peft's lora_A saves a new tensor (its cast or dropout output;
    ``memplan_lora_input_bytes``). memplan's own tensors the block does not save are
    ``memory.first_block_unsaved_bytes``'s."""
    if not setup.lora_rank or setup.checkpointing != "none":
        return 0
    n, a = _n(setup), _a(setup)
    mask = (PEFT_ADAPTER_BYTES if cpu else MASK) if dropout > 0 else 0
    frozen_mlp = spec.parallel_residual or not {"qkv", "proj"} & set(setup.lora)  # the MLP's input is frozen
    frozen_input = {"qkv": True, "proj": "qkv" not in setup.lora, "up": frozen_mlp,
                    "down": frozen_mlp and "up" not in setup.lora}
    out = hf_norm_saved_bytes(spec, setup)
    for m in setup.lora:
        if frozen_input[m]:
            out += sum(n * i * mask for i, _ in hf_lora_modules(spec, m, setup))
    if "qkv" not in setup.lora:
        out += hf_attention_saved_bytes(spec, setup) + hf_qk_norm_saved_bytes(spec, setup)
        if "proj" in setup.lora and setup.attention == "sdpa" and not memplan_lora_input_bytes(spec, setup, "proj", dropout):
            out += n * spec.q_dim * a
    if frozen_mlp:
        out += hf_norm_saved_bytes(spec, setup) if spec.norms_per_layer > 1 else 0
        if "up" not in setup.lora:
            out += hf_gelu_new_saved_bytes(spec, setup, cpu)
    return out


def hf_lora_forward_transient_bytes(spec, setup, matrix: str) -> int:
    """The transient of peft's adapter forward beyond memplan's one n·out·a adapter output, for one
    adapted ``matrix``.

    peft ``lora.Linear.forward``: ``result = result + lora_B(lora_A(dropout(x))) * scaling``:
    ``lora_B``'s output and its scaled copy are alive together (the product is freed only after
    the multiply), each n·out·e, e = 4 for peft's fp32 adapters on a cast input (fp32 and pure
    bf16: ``x = self._cast_input_dtype(x, lora_A.weight.dtype)``), 2 under autocast (the mm runs in
    bf16); the sum with the base output (fp32 where the base is bf16 and the adapter fp32) and its
    cast back (``result.to(torch_result_dtype)``) hold no more than the two. Per module: the widest
    of the modules standing for ``matrix`` (``hf_lora_modules``: gate_proj's and up_proj's run one
    after the other), against memplan's fused adapter output n·out·a. For up_proj also
    ``act_fn(gate_proj(x))``, n·F·a: ``self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))``
    (modeling_llama.py, LlamaMLP.forward) applies the activation before up_proj runs; memplan's fused
    up matmul comes before its silu."""
    if not lora_adapter_shapes(spec, setup, matrix):  # (the head's: lm_head's adapter, H → V)
        return 0

    n, a = _n(setup), _a(setup)
    e = HALF if setup.mixed else PEFT_ADAPTER_BYTES
    modules = hf_lora_modules(spec, matrix, setup)
    widest = max(o for _, o in modules)
    silu_first = n * spec.ffn * a if matrix == "up" and len(modules) > 1 else 0
    return 2 * n * widest * e + silu_first - n * max(o for _, o in lora_adapter_shapes(spec, setup, matrix)) * a


def hf_lora_input_cast_transient_bytes(spec, setup, matrix: str, dropout: float) -> int:
    """What peft's adapter on ``matrix`` holds of its input, unsaved, during its forward, beyond
    ``hf_lora_forward_transient_bytes``.

    peft ``lora.Linear.forward`` (tuners/lora/layer.py): ``x = self._cast_input_dtype(x, lora_A.weight.dtype)``
    is an fp32 copy of a 16-bit input, n·in·4, a local alive until the forward returns; it is lora_A's saved
    input only under pure bf16 without dropout (``hf_lora_saved_bytes``), so it is unsaved under autocast
    (the mm saves its own bf16 cast) and with dropout (the dropout's output is saved). Under autocast with
    dropout, ``lora_A(dropout(x))``'s dropout output is fp32 too (n·in·4), alive during lora_A while its
    bf16 cast is made, and freed before lora_B runs: it counts where it is more than lora_B's transient.
    0 in fp32, without an adapter on ``matrix``, and for the head (its own hooks)."""
    if not setup.lora_rank or matrix not in setup.lora or matrix == "head" \
            or not lora_adapter_shapes(spec, setup, matrix):
        return 0
    n, a = _n(setup), _a(setup)
    if a == FP32 or not (setup.mixed or dropout > 0):
        return 0
    modules = hf_lora_modules(spec, matrix, setup)
    fan_in = max(i for i, _ in modules)
    cast = n * fan_in * FP32
    dropped = n * fan_in * FP32 if setup.mixed and dropout > 0 else 0
    e = HALF if setup.mixed else PEFT_ADAPTER_BYTES
    lora_b = 2 * n * max(o for _, o in modules) * e + (n * spec.ffn * a if matrix == "up" and len(modules) > 1 else 0)
    # for qkv and proj, the walk has let memplan's adapter input go where peft's saved tensors are made
    # (``hf_lora_adapter_made_bytes``); it is the caller's local until the projection returns: the norm's
    # output (decoder layer's ``hidden_states``), eager attention's transposed output (``attn_output``)
    caller = memplan_lora_input_bytes(spec, setup, matrix, dropout) if matrix in ("qkv", "proj") else 0
    return cast + max(0, dropped - lora_b) + caller



@functools.lru_cache(maxsize=None)
def datasets_installed() -> bool:
    """Whether the ``datasets`` package is installed where the plan is made (found, not imported), which
    ``transformers.trainer`` then imports (``trainer_datasets_resident_bytes``)."""
    return importlib.util.find_spec("datasets") is not None


class TransformersStack(Stack):
    """transformers' model and ``Trainer`` step, peft's adapters: the hooks above at the walk's fixed points."""

    name: ClassVar[str] = "transformers"
    library: ClassVar[str | None] = "transformers"
    walks_sdpa_gqa_repeat: ClassVar[bool] = False
    has_lora_dropout: ClassVar[bool] = True
    archs: ClassVar[tuple[str, ...]] = TRANSFORMERS_ARCHS
    checkpointings: ClassVar[tuple[str, ...]] = ("none", "full")  # gradient_checkpointing_enable(): whole layers
    shardings: ClassVar[tuple[str, ...]] = ("none", "ddp")
    adapts_tied_head: ClassVar[bool] = True
    lora_with_selective: ClassVar[bool] = True
    sums_input_gradient_in_place: ClassVar[bool] = False  # peft's adapters keep the out-of-place sum
    compiles: ClassVar[bool] = False
    searched_optimizers: ClassVar[tuple[str, ...]] = ("adamw-fused", "adamw", "adamw8bit")  # optim="adamw_bnb_8bit"
    trains_hf_model: ClassVar[bool] = True  # a plan of this stack trains transformers' model class
    step_words: ClassVar[str] = ", transformers' step"
    dropout_words: ClassVar[str] = "peft dropout"

    def check_builds(self, spec, accepted: tuple[str, ...]) -> None:
        """The walk covers ``TRANSFORMERS_ARCHS`` only."""
        if spec.arch not in self.archs:
            raise InputError(f"--stack transformers: the walk covers the {', '.join(self.archs)} families, "
                             f"not {spec.arch!r}")

    def check_walked(self, setup) -> None:
        """transformers checkpoints whole layers; FSDP is walked for memplan's own step only."""
        if setup.checkpointing == "selective":
            raise InputError("--stack transformers: checkpointing 'selective' is memplan's own; transformers "
                             "checkpoints whole layers (accepted: none, full)")
        if setup.sharding == "fsdp":
            raise InputError("--stack transformers: --sharding fsdp is walked for memplan's own step only "
                             "(accepted: none, ddp)")

    def model_code_bytes(self, setup, transformers_bytes: int | None = None, peft_bytes: int | None = None) -> int:
        """transformers' model code, and peft's with LoRA (``model_code_resident_bytes``); and where the plan is for
        transformers' own ``Trainer`` rather than memplan's loop training its model class (``own_loop``), what the
        Trainer imports besides (``trainer_datasets_resident_bytes``: ``datasets``, with pandas and pyarrow, where it
        is installed)."""
        code = model_code_resident_bytes(setup.lora_rank > 0, transformers_bytes, peft_bytes)
        return code if self.own_loop else code + trainer_datasets_resident_bytes(datasets_installed())

    def _check_qkv_parts(self, spec, setup) -> None:
        """q, k or v alone on a model whose attention is one fused matrix (gpt2's c_attn, gpt_neox's
        query_key_value): peft adapts a module whole."""
        alone = [t for t in setup.lora_adapters if t in QKV_PARTS]
        whole = [t for t in LORA_TARGET_NAMES if t not in QKV_PARTS]
        if alone and spec.arch in FUSED_QKV_ARCHS:
            raise InputError(f"--lora-targets {setup.lora_targets}: {spec.arch}'s attention is one fused matrix, "
                             f"which peft adapts whole (accepted for {spec.arch}: {', '.join(whole)})")

    def block_saved_bytes(self, spec, setup) -> int:
        return (spec.norms_per_layer * hf_norm_saved_bytes(spec, setup) + hf_attention_saved_bytes(spec, setup)
                + hf_lora_saved_bytes(spec, setup, self.lora_dropout, self.cpu)
                + hf_shared_norm_saved_bytes(spec, setup, self.lora_dropout)
                + hf_gelu_new_saved_bytes(spec, setup, self.cpu)
                + hf_qk_norm_saved_bytes(spec, setup) + hf_sdpa_output_copy_bytes(spec, setup, self.lora_dropout)
                + hf_autocast_input_casts_bytes(spec, setup))

    def first_block_unsaved_bytes(self, spec, setup) -> int:
        return hf_first_block_unsaved_bytes(spec, setup, self.lora_dropout, self.cpu)

    def adapter_saved_bytes(self, spec, setup, matrix: str) -> int:
        return hf_lora_adapter_made_bytes(spec, setup, matrix, self.lora_dropout, self.cpu)

    def norm_saved_bytes(self, spec, setup) -> int:
        return hf_norm_saved_bytes(spec, setup)

    def attention_saved_bytes(self, spec, setup) -> int:
        return hf_attention_saved_bytes(spec, setup)

    def qk_norm_saved_bytes(self, spec, setup) -> int:
        return hf_qk_norm_saved_bytes(spec, setup)

    def rotary_held_bytes(self, spec, setup) -> int:
        return hf_qk_rotary_held_bytes(spec, setup)

    def rotary_transient_bytes(self, spec, setup) -> int:
        return hf_qk_rotary_transient_bytes(spec, setup)

    def softmax_backward_bytes(self, spec, setup) -> int:
        return hf_softmax_backward_bytes(spec, setup)

    def qk_norm_backward_bytes(self, spec, setup) -> int:
        return hf_qk_norm_backward_bytes(spec, setup)

    def recompute_gradient_bytes(self, spec, setup) -> int:
        return hf_recompute_gradient_bytes(spec, setup)

    def recompute_reaches_down_adapter(self, setup) -> bool:
        """peft's down adapter: the recomputation runs on up to lora_A's output (``hf_recompute_down_adapter_bytes``)."""
        return bool(setup.lora_rank) and "down" in setup.lora and setup.checkpointing == "full"

    def recompute_stop_bytes(self, spec, setup) -> int:
        return hf_recompute_down_adapter_bytes(spec, setup, self.lora_dropout) + \
            hf_recompute_locals_bytes(spec, setup, self.lora_dropout)

    def lora_forward_transient_bytes(self, spec, setup, matrix: str) -> int:
        return hf_lora_forward_transient_bytes(spec, setup, matrix) + \
            hf_lora_input_cast_transient_bytes(spec, setup, matrix, self.lora_dropout)

    def lora_input_release(self, spec, setup, matrix: str) -> tuple[int, int] | None:
        if matrix not in setup.lora:
            return None
        saved = (hf_lora_input_saved_bytes(spec, setup, matrix, self.lora_dropout, self.cpu)
                 - memplan_lora_input_bytes(spec, setup, matrix, self.lora_dropout))
        return saved, hf_lora_input_grad_bytes(spec, setup, matrix)

    def lora_head_saved_bytes(self, spec, setup, frozen_input: bool = False) -> int:
        return hf_lora_head_saved_bytes(spec, setup, self.lora_dropout, self.cpu, frozen_input)

    def lora_head_input_held_bytes(self, spec, setup) -> int:
        return hf_lora_head_input_held_bytes(spec, setup, self.lora_dropout)

    def mlp_backward_scratch_bytes(self, spec, setup) -> int:
        return hf_gelu_new_backward_bytes(spec, setup)

    def norm_backward_bytes(self, spec, setup, held: int, saved_held: bool = True) -> int:
        return hf_rmsnorm_backward_bytes(spec, setup, held, saved_held)

    def final_norm_saved_bytes(self, spec, setup) -> int:
        return hf_norm_saved_bytes(spec, setup)

    def lora_bytes_delta(self, spec, setup) -> int:
        return hf_lora_bytes_delta(spec, setup)

    def lora_tensors_delta(self, spec, setup) -> int:
        if not setup.lora_rank:
            return 0
        return hf_lora_tensors(spec, setup) - lora_tensors(spec, setup)

    @property
    def checkpointed_input_needs_grad(self) -> bool:
        """transformers' ``gradient_checkpointing_enable()`` calls ``enable_input_require_grads()`` on a model
        whose input embeddings are frozen (``modeling_utils.py``), so the checkpointed blocks run their
        backward under a head-only LoRA too."""
        return True

    @property
    def ddp_gradient_as_bucket_view(self) -> bool:
        """transformers' Trainer keeps PyTorch's default, False, so the buckets are a second gradient-sized
        buffer (``memory.ddp_separate_bucket_bytes``)."""
        return False

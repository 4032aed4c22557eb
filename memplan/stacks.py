"""Whose training code the memory walk follows (``memplan estimate --stack``): torch-free.

``memplan/memory/`` walks one training step op by op, exactly as memplan's own model and step
(``trainer/model.py``, ``trainer/step.py``) run it. Other code saves other tensors for the same
model. A ``Stack`` is the walk's hooks: each a small pure function below whose docstring names the
tensor it adds (or removes) and the line of the library that makes it. The walk calls them at
fixed points of the one walk (``memplan.memory.walk``: ``_Step``, ``_BlockForward``, ``_block_backward``);
``memplan``'s hooks add nothing, so ``--stack memplan`` is the walk as it always was.

Stacks:

- ``memplan``: memplan's own model and step;
- ``transformers``: Hugging Face transformers' model and ``Trainer`` step, with peft's LoRA: the
  step ``memplan trace --stack transformers`` traces (``trainer/stacks/hf.py``), for the llama,
  gpt2 and gpt_neox families, and for phi, gemma, stablelm and qwen3, which memplan's own trainer
  does not build (``memplan.model.STACK_ARCHS``: ``--stack memplan`` refuses them).

``loss_dtype`` (``--loss-dtype``): ``fp32`` takes cross-entropy over an fp32 copy of the logits
(transformers' ``ForCausalLMLoss`` and memplan's step: ``logits.float()``); ``logits`` over the
logits in their own dtype, as a plain PyTorch loop calling ``F.cross_entropy(logits, targets)``
under autocast does.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.errors import InputError
from memplan.setup import LORA_TARGET_NAMES, QKV_PARTS
from memplan.units import possessive

STACKS = ("memplan", "transformers", "litgpt", "torchtune")
LOSS_DTYPES = ("fp32", "logits")
TRANSFORMERS_ARCHS = ("llama", "gpt2", "gpt_neox", "phi", "gemma", "stablelm", "qwen3")  # the families the hooks walk
FUSED_QKV_ARCHS = ("gpt2", "gpt_neox")  # one c_attn / query_key_value matrix; the others have q_proj, k_proj, v_proj
FP32, HALF, MASK = 4, 2, 1


def check_stack(stack: str, accepted: tuple[str, ...] = STACKS) -> str:
    """``stack`` if it is one of ``accepted`` (the walk's stacks by default; ``trace`` takes more), else the
    one-line InputError naming them."""
    if stack not in accepted:
        raise InputError(f"--stack: unknown {stack!r} (accepted: {', '.join(accepted)})")
    return stack


def check_stack_builds(stack: str, spec, accepted: tuple[str, ...] = STACKS) -> str:
    """``stack`` if its code builds ``spec``'s family, else the one-line InputError naming the stacks
    that do: memplan's own trainer builds llama, gpt2 and gpt_neox only (``ModelSpec.memplan_builds``);
    phi, gemma, stablelm and qwen3 are walked as transformers runs them."""
    check_stack(stack, accepted)
    if stack == "memplan" and not spec.memplan_builds:
        others = [s for s in accepted if s != "memplan"]
        raise InputError(f"--stack memplan: memplan's own trainer does not build the {spec.arch} family "
                         f"(accepted for {spec.arch}: --stack {', '.join(others)})")
    if stack == "transformers" and spec.arch not in TRANSFORMERS_ARCHS:
        raise InputError(f"--stack transformers: the walk covers the {', '.join(TRANSFORMERS_ARCHS)} families, "
                         f"not {spec.arch!r}")
    return stack


LIB_SETUPS = {  # what litgpt's and torchtune's single-device scripts take (trainer/stacks/litgpt.py, torchtune.py)
    "litgpt": {"precision": ("fp32", "tf32", "bf16-mixed", "bf16"), "attention": ("sdpa",),
               "checkpointing": ("none",), "sharding": ("none",), "archs": ("llama", "gpt_neox")},
    "torchtune": {"precision": ("fp32", "tf32", "bf16"), "attention": ("sdpa",),
                  "checkpointing": ("none", "full"), "sharding": ("none",), "archs": ("llama",)},
}


def check_stack_setup(stack: str, spec, setup) -> str:
    """``stack`` if its code runs ``setup``'s step for ``spec``, else the one-line InputError naming what
    it takes: litgpt's scripts and torchtune's recipes on one device (the settings of ``LIB_SETUPS``;
    their LoRA adapts the MLP whole, up and down together; torchtune's ``lora_llama3`` needs an attention
    module among ``lora_attn_modules``), and ``check_lora_targets``'s."""
    check_lora_targets(stack, spec, setup)
    allowed = LIB_SETUPS.get(stack)
    if allowed is None:
        return stack
    if spec.arch not in allowed["archs"] or spec.pos != "rope":
        raise InputError(f"--stack {stack}: the walk covers {possessive(stack)} {', '.join(allowed['archs'])} models "
                         f"(rotary positions), not {spec.arch!r}")
    for field in ("precision", "attention", "checkpointing", "sharding"):
        value = getattr(setup, field)
        if value not in allowed[field]:
            raise InputError(f"--stack {stack}: --{field} {value} is not one that {possessive(stack)} code takes "
                             f"(accepted: {', '.join(allowed[field])})")
    if setup.lora_rank and ("up" in setup.lora) != ("down" in setup.lora):
        raise InputError(f"--stack {stack}: --lora-targets {setup.lora_targets}: {stack} adapts the MLP whole "
                         "(accepted: qkv, q, k, v, proj, and up with down, head)")
    if setup.lora_rank and stack == "torchtune" and not {"qkv", "proj"} & set(setup.lora):
        raise InputError(f"--lora-targets {setup.lora_targets}: torchtune's lora_llama3 needs an attention module "
                         "among lora_attn_modules (accepted: at least one of qkv, q, k, v, proj)")
    return stack


def check_lora_targets(stack: str, spec, setup) -> None:
    """The one-line InputError where ``stack``'s code cannot put adapters where ``--lora-targets`` says:
    q, k or v alone on a model whose attention is one fused matrix in transformers (gpt2's c_attn,
    gpt_neox's query_key_value: peft adapts a module whole); the head of a tied model in memplan's
    trainer (the adapter could not be folded into the matrix the embedding shares) and in torchtune's
    (``lora_llama3_2`` raises on ``apply_lora_to_output``); memplan's selective checkpointing with any
    adapter: its policy keeps the base matmul's output (``trainer/model.py`` ``_SAVE_OPS``), which
    ``LoRALinear.forward`` adds into in place, so gpt2's and gpt_neox's recomputation fails ("Tensor cached
    during selective activation checkpoint has been mutated", their biased projections' addmm) and llama's
    walk was 16.5% over its trace (4 layers, hidden 256, ctx 128, micro-batch 2, rank 4)."""
    if not setup.lora_rank:
        return
    alone = [t for t in setup.lora_adapters if t in QKV_PARTS]
    whole = [t for t in LORA_TARGET_NAMES if t not in QKV_PARTS]
    if alone and stack == "transformers" and spec.arch in FUSED_QKV_ARCHS:
        raise InputError(f"--lora-targets {setup.lora_targets}: {spec.arch}'s attention is one fused matrix, which "
                         f"peft adapts whole (accepted for {spec.arch}: {', '.join(whole)})")
    if stack == "memplan" and setup.checkpointing == "selective":
        raise InputError("--checkpointing selective with --lora-rank: memplan's selective checkpointing keeps each "
                         "base matmul's output, which the adapter adds into in place (accepted with LoRA: none, "
                         "full)")
    if setup.lora_head and stack in ("memplan", "torchtune") and spec.tied:
        raise InputError(f"--lora-targets head: this model ties its LM head to the token embedding, and {possessive(stack)} "
                         "code does not adapt the one shared matrix (accepted for a tied model: "
                         f"{', '.join(t for t in LORA_TARGET_NAMES if t != 'head')})")


def check_loss_dtype(loss_dtype: str) -> str:
    if loss_dtype not in LOSS_DTYPES:
        raise InputError(f"--loss-dtype: unknown {loss_dtype!r} (accepted: {', '.join(LOSS_DTYPES)})")
    return loss_dtype


def _n(setup) -> int:
    return setup.micro_batch * setup.ctx


def _a(setup) -> int:
    return setup.compute_bytes


def _r(setup) -> int:
    return HALF if setup.precision == "bf16" else FP32


# ---- the hooks of the transformers stack -------------------------------------------------------

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


def hf_shared_norm_saved_bytes(spec, setup) -> int:
    """What a block with one shared norm saves less than memplan's parallel block with two (gpt_neox's).

    phi: ``hidden_states = self.input_layernorm(hidden_states)`` feeds both ``self.self_attn`` and
    ``self.mlp(hidden_states)`` (modeling_phi.py, PhiDecoderLayer.forward); stablelm with
    ``use_parallel_residual`` likewise (``post_attention_layernorm = None``). One LayerNorm's
    statistics (n·2·r) are saved, not two, and its output (n·H·a, as the first matmuls save it)
    once where memplan counts one per norm whose matmul trains ([qkv adapted] + [up adapted] under
    LoRA, 2 without): −stats − (count − 1)·n·H·a; 0 for two norms."""
    if not spec.shared_norm:
        return 0
    from memplan.memory.terms import norm_output_bytes, norm_stat_bytes

    if setup.lora_rank:
        kept = ("qkv" in setup.lora) + ("up" in setup.lora)
        counted = kept - (1 if kept else 0)
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
    from memplan.memory.terms import lora_params

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
    from memplan.memory.terms import lora_adapter_shapes

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
    from memplan.memory.terms import lora_input_casts_bytes

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
    from memplan.memory.terms import lora_adapter_shapes

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
    from memplan.memory.terms import lora_adapter_shapes

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


# ---- the hooks of the litgpt stack (litgpt 0.5: litgpt/model.py, litgpt/lora.py, litgpt/utils.py) ----------

def lit_norm_saved_bytes(spec, setup) -> int:
    """What one of litgpt's ``RMSNorm`` saves beyond memplan's fused norm (input and rstd).

    ``x = x.float()``, ``x_normed = x * torch.rsqrt(norm_x + self.eps)``, ``return (x_normed *
    weight.float()).to(dtype=dtype)`` (litgpt/model.py, RMSNorm.forward): ``x * x`` and ``x * rsqrt``
    save the fp32 input, n·H·4, in place of the input memplan's norm saves, n·H·r (the same tensor
    under fp32 and autocast, a new copy under pure bf16, where nothing else keeps the bf16 residual);
    ``x_normed * weight.float()`` saves ``x_normed`` in fp32, n·H·4, for the weight's gradient (not
    when the weight is frozen, under LoRA). LayerNorm (gpt_neox shapes) is ``F.layer_norm``: 0."""
    if spec.norm != "rmsnorm":
        return 0
    n, h = _n(setup), spec.hidden
    out = n * h * (FP32 - _r(setup))
    if not setup.lora_rank:
        out += n * h * FP32
    return out


def lit_attention_saved_bytes(spec, setup, dropout: float = 0.0) -> int:
    """What litgpt's ``CausalSelfAttention`` saves beyond memplan's attention (fused qkv output, q and k
    rotated), per block.

    ``q = torch.cat((q_roped, q[..., rope_n_elem:]), dim=-1)`` and likewise k (litgpt/model.py,
    CausalSelfAttention.forward): q, n·q_dim·a, saved by SDPA. Grouped heads: ``k =
    k.repeat_interleave(q_per_kv, dim=1)`` and v alike, each n·q_dim·a, saved by SDPA; the fused qkv
    output is saved by nothing (``apply_rope``'s ``x * cos`` saves only cos). Ungrouped: k, n·kv·a,
    and v, a view of the qkv output, which SDPA keeps whole, n·(q_dim + 2·kv)·a. Then ``y =
    y.reshape(B, T, head_size * n_head)`` of SDPA's output transposed back (``.transpose(1, 2)``) is a
    copy, n·q_dim·a, which ``self.proj`` saves beside the output SDPA saves (under LoRA a frozen
    proj without an adapter saves none of it, nor does one whose adapter takes its dropout's output)."""
    n, a, q, kv = _n(setup), _a(setup), spec.q_dim, spec.kv_dim
    grouped = spec.kv_heads != spec.heads
    kept = q + (2 * q if grouped else kv + q + 2 * kv)
    if not setup.lora_rank or ("proj" in setup.lora and dropout == 0):
        kept += q
    return n * a * kept - n * a * ((q + 2 * kv) + q + kv)


def lit_autocast_mlp_cast_bytes(spec, setup) -> int:
    """The second bf16 copy of the MLP norm's output that litgpt's ``LLaMAMLP`` makes and saves under
    autocast: ``x_fc_1 = self.fc_1(x)``, ``x_fc_2 = self.fc_2(x)`` (litgpt/model.py, LLaMAMLP.forward)
    each cast the fp32 input (autocast caches only leaf weights' casts), n·H·2, where memplan's fused
    up matmul casts once. 0 without autocast, for a one-matrix MLP (GptNeoxMLP), and under LoRA (a
    frozen fc saves no input)."""
    if not setup.mixed or setup.lora_rank or spec.mlp != "swiglu":
        return 0
    return _n(setup) * spec.hidden * HALF


def lit_held_logits_bytes(spec, setup) -> int:
    """The logits litgpt's scripts keep through the backward and the optimizer step, n·V·4.

    ``logits = model(input_ids)``, ``loss = chunked_cross_entropy(logits, targets)``,
    ``fabric.backward(loss / ...)`` (litgpt/pretrain.py, fit; finetune/lora.py likewise): the local
    ``logits``, fp32 after Fabric's ``convert_output`` (``_FabricModule.forward``) under every
    precision, lives until the next forward returns; memplan's step ``del``s them once the loss has
    saved its log-probabilities."""
    return _n(setup) * spec.vocab * FP32


LIT_LOSS_CHUNK = 128  # chunked_cross_entropy(chunk_size=128); finetune/lora.py's lm_head_chunk_size=128


def lit_chunked_loss_backward_bytes(spec, setup) -> int:
    """The log-probabilities litgpt's chunked loss has freed by the time it holds its gradients (≤ 0).

    ``logit_chunks = logits.split(chunk_size)``, ``[F.cross_entropy(logit_chunk, ...) for ...]``,
    ``torch.cat(loss_chunks)`` (litgpt/utils.py, chunked_cross_entropy, chunks of 128 rows of the n):
    each chunk's backward frees its saved log-probabilities as it makes its gradients, and ``split``'s
    backward ``cat``s the chunks' gradients into the logits' gradient, n·V·4, when no log-probability is
    left: with two chunks or more, one n·V·4 fewer than memplan's walk (log-probs, their gradient, the
    logits' gradient) holds at the loss's backward; one chunk holds all three. With LoRA, finetune/lora.py
    gives the loss the head's k = ⌈T/128⌉ chunks (``lm_head_chunk_size=128``), whose gradients go each to
    its own head matmul: at the first chunk's backward the log-probabilities and that chunk's two
    gradients, −2·n·V·4·(1 − 1/k)."""
    full = _n(setup) * spec.vocab * FP32
    if setup.lora_rank:
        k = -(-setup.ctx // LIT_LOSS_CHUNK)
        return -2 * full * (k - 1) // k
    return -full if _n(setup) > LIT_LOSS_CHUNK else 0


def lit_rope_cache_bytes(spec, setup) -> int:
    """litgpt's cos and sin beyond memplan's.

    ``cos, sin = self.rope_cache()`` (litgpt/model.py, GPT.max_seq_length's setter: ``build_rope_cache(
    seq_len=self.max_seq_length, n_elem=self.config.rope_n_elem, ...)``, then ``torch.cat([cos, cos],
    dim=-1)`` alike): two buffers of ctx × rotary_dim, where memplan's cover ctx × rotary_dim/2; fp32,
    bf16 once Fabric's bf16-true converts the module."""
    from memplan.memory.terms import rope_buffer_bytes

    if spec.pos != "rope":
        return 0
    dtype = HALF if setup.precision == "bf16" else FP32
    return 2 * setup.ctx * spec.rotary_dim * dtype - rope_buffer_bytes(spec, setup)


def lit_walked_setup(setup, cpu: bool):
    """litgpt's AdamW: ``instantiate_torch_optimizer("AdamW", model.parameters(), **extra_kwargs)`` with
    ``extra_kwargs = {"fused": fabric.device.type == "cuda"}`` (litgpt/pretrain.py; finetune/lora.py
    passes nothing): fused on CUDA without LoRA; otherwise torch's default, which is foreach on an
    accelerator and, on the CPU (``_default_to_fused_or_foreach``: CUDA tensors only), the for-loop
    ``_single_tensor_adamw``, whose scratch ``lit_optimizer_scratch_bytes`` puts in place of foreach's."""
    if setup.optimizer == "adamw" and not setup.lora_rank and not cpu:
        return setup.replace(optimizer="adamw-fused")
    return setup


def lit_optimizer_scratch_bytes(spec, setup, cpu: bool) -> int:
    """The scratch of torch's for-loop AdamW, litgpt's on the CPU (``lit_walked_setup``), less the foreach
    scratch memplan's walk counts for ``--optimizer adamw`` (may be negative): one parameter at a time,
    ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`` (torch/optim/adamw.py,
    ``_single_tensor_adam``) makes two tensors of the parameter's size, beside the update's own
    temporary: 3 × the largest trained tensor (the V·H head, or an adapter under LoRA), in the
    parameters' dtype."""
    if not cpu or setup.optimizer != "adamw":
        return 0
    from memplan.memory.terms import optimizer_temporary_bytes

    foreach = optimizer_temporary_bytes(spec, setup)
    foreach += lit_lora_bytes_delta(spec, setup) if foreach else 0
    if setup.lora_rank:
        largest = max([setup.lora_rank * max(i, o) for m in setup.lora for i, o in
                       [(spec.hidden, spec.q_dim + 2 * spec.kv_dim), (spec.q_dim, spec.hidden),
                        (spec.hidden, spec.ffn), (spec.ffn, spec.hidden)]]
                      + [setup.lora_rank * spec.vocab] * setup.lora_head)  # lora_head's B, V × r
    else:
        largest = max(spec.vocab * spec.hidden, spec.hidden * (spec.q_dim + 2 * spec.kv_dim), spec.hidden * spec.ffn)
    return 3 * largest * setup.param_bytes - foreach


def lit_walked_spec(spec):
    """litgpt's ``GPT`` has a separate ``lm_head`` always (``GPT.__init__``: ``self.lm_head =
    nn.Linear(config.n_embd, config.padded_vocab_size, ...)``, no weight tying; its tied models load
    the embedding into it): a tied shape is walked untied, V·H more weights, gradients and state."""
    return spec.replace(tied=False) if spec.tied else spec


def _qkv_enabled(setup) -> int:
    """How many of q, k, v carry an adapter: 3 for qkv, else those adapted alone (0 without LoRA)."""
    if setup is None or "qkv" in setup.lora_adapters:
        return 3
    return sum(p in setup.lora_adapters for p in QKV_PARTS)


def lit_lora_modules(spec, matrix: str, setup=None) -> list[tuple[int, int]]:
    """(in, rank multiple) of each litgpt LoRA module standing for memplan's fused ``matrix``
    (litgpt/lora.py): ``LoRAQKVLinear`` is one module for q, k and v, whose ``lora_A`` has r rows per
    enabled projection (``r * sum(enable_lora)``: 3r for qkv, 2r for q and v alone); the ``LLaMAMLP``'s
    ``fc_1`` and ``fc_2`` are separate ``LoRALinear`` (``GptNeoxMLP``: one ``fc``); ``lm_head`` one."""
    h, q, f = spec.hidden, spec.q_dim, spec.ffn
    up = [(h, 1), (h, 1)] if spec.mlp == "swiglu" else [(h, 1)]
    return {"qkv": [(h, _qkv_enabled(setup))], "proj": [(q, 1)], "up": up, "down": [(f, 1)], "head": [(h, 1)]}[matrix]


def lit_lora_bytes_delta(spec, setup) -> int:
    """Bytes of litgpt's adapters beyond memplan's (their gradients alike), in the model's dtype.

    ``self.lora_A = nn.Parameter(torch.empty((r * sum(enable_lora), in_features)))`` (LoRAQKVLinear:
    3·r·H where memplan's fused qkv adapter has r·H: 2·r·H more; for q, k, v adapted alone one r·H per
    enabled projection, as memplan's one A per slice: nothing more; its ``lora_B`` is as tall as the
    enabled slices, as memplan's Bs together), and ``fc_1``, ``fc_2`` each with its own A (r·H) and B
    (F·r) where memplan's fused gate-and-up adapter has one A (r·H): r·H more. torchtune's q_proj,
    k_proj, v_proj, w1, w3 likewise (``tt_lora_bytes_delta``)."""
    if not setup.lora_rank:
        return 0
    from memplan.memory.terms import lora_adapter_shapes

    extra = 0
    if "qkv" in setup.lora:
        extra += (_qkv_enabled(setup) - len(lora_adapter_shapes(spec, setup, "qkv"))) * setup.lora_rank * spec.hidden
    if "up" in setup.lora and spec.mlp == "swiglu":
        extra += setup.lora_rank * spec.hidden
    return spec.layers * extra * setup.param_bytes


def lit_lora_tensors_delta(spec, setup) -> int:
    """Adapter tensors beyond memplan's: ``fc_1`` and ``fc_2`` with an A and a B each, for memplan's one
    fused gate-and-up adapter (two tensors more per layer); one ``LoRAQKVLinear`` (an A and a B) for
    memplan's k adapters on q, k, v adapted alone (2·(k − 1) fewer)."""
    if not setup.lora_rank:
        return 0
    from memplan.memory.terms import lora_adapter_shapes

    extra = 2 if "up" in setup.lora and spec.mlp == "swiglu" else 0
    extra -= 2 * (len(lora_adapter_shapes(spec, setup, "qkv")) - 1) if "qkv" in setup.lora else 0
    return spec.layers * extra


def lit_lora_saved_bytes(spec, setup, dropout: float, cpu: bool = False) -> int:
    """What litgpt's LoRA modules save beyond memplan's adapters, per block.

    ``(self.lora_dropout(x) @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)) *
    self.scaling`` (litgpt/lora.py, LoRALinear.forward; LoRAQKVLinear: ``F.linear(self.lora_dropout(x),
    self.lora_A)``, then ``conv1d``): ``x·Aᵀ`` is n·r·a per module, n·3r·a for the fused qkv (one r per
    enabled projection), where memplan's adapter has n·r·a per matrix.

    ``lora_dropout`` 0 (``nn.Identity``): ``lora_A`` saves its input, as memplan's adapter does; under
    autocast each module casts the fp32 norm output anew (autocast caches leaf weights' casts only), so
    ``fc_1`` and ``fc_2`` save two bf16 copies, n·H·2, for memplan's one. ``lora_dropout`` > 0: each
    module's ``nn.Dropout`` output, saved by ``lora_A`` in the compute dtype (n·in·a), and its mask
    (ATen's ``_dropout_impl``: ``noise = empty_like(input).bernoulli_(1 - p)``, the input's dtype on the
    CPU; the fused ``native_dropout``'s bool mask, 1 byte, on CUDA), in place of the input memplan's
    adapter saves (qkv, up: the norm output, n·H·a; down: the MLP product, n·F·a; proj: none, SDPA's
    output is kept either way, and litgpt's reshaped copy of it is then saved by nothing).
    (Blocks where nothing below trains save no mask for an input that needs no gradient: the first
    block's qkv; not modelled.)"""
    return _lib_lora_saved_bytes(spec, setup, dropout, cpu, lit_lora_modules)


def _lib_lora_saved_bytes(spec, setup, dropout: float, cpu: bool, modules_of) -> int:
    """litgpt's and torchtune's adapters beyond memplan's (``lit_lora_saved_bytes``, ``tt_lora_saved_bytes``):
    per module n·r·a (x·Aᵀ) times its rank multiple; with dropout, its output (n·in·a) and mask (n·in·x
    on the CPU, x the input's bytes; 1 on CUDA) for memplan's saved input; under autocast (litgpt) a
    cast of the norm output per module reading it."""
    if not setup.lora_rank:
        return 0
    from memplan.memory.terms import lora_adapter_shapes, lora_input_casts_bytes

    n, a, rank, r = _n(setup), _a(setup), setup.lora_rank, _r(setup)
    out = 0
    for m in setup.lora:
        modules = modules_of(spec, m, setup)
        k, width = len(modules), modules[0][0]
        out += n * rank * a * (sum(mult for _, mult in modules) - len(lora_adapter_shapes(spec, setup, m)))
        x = r if m in ("qkv", "up") else a  # the input's dtype: the norm's output, or an activation
        mine = (n * width * a if m != "proj" else 0) + lora_input_casts_bytes(spec, setup, m)
        if dropout > 0:
            mask = x if cpu else MASK
            out += k * n * width * (mask + a) - mine
        elif setup.mixed and m in ("qkv", "up"):
            out += (k - 1) * n * width * HALF - lora_input_casts_bytes(spec, setup, m)
    return out


def _lib_first_block_saved_bytes(spec, setup, dropout: float, cpu: bool, modules_of) -> int:
    """What the first block of litgpt's or torchtune's LoRA model saves short of the others (≤ 0).

    Under LoRA the embedding and norms are frozen: the first block's input needs no gradient, and
    neither does anything computed from it alone. Autograd then saves nothing for that input's sake:
    no dropout mask (``input * noise`` keeps ``noise`` only for the input's gradient) where an
    adapter's input needs no gradient (qkv's always; proj's without qkv adapters; up's without
    attention adapters; down's without any adapter below it in the block), n·in·mask per module; and
    no fp32 copy of the first norm's input (``x.float()`` kept by ``x * x`` / ``rms_norm`` for the
    input's gradient), n·H·(4 − r). Without checkpointing (a checkpointed block keeps only its
    input; not modelled there); 0 for one layer, as memplan's own first-block terms."""
    if not setup.lora_rank or spec.layers < 2 or setup.checkpointing != "none":
        return 0
    n, r = _n(setup), _r(setup)
    out = -n * spec.hidden * (FP32 - r) if spec.norm == "rmsnorm" else 0
    if dropout <= 0:
        return out
    attn = "qkv" in setup.lora or "proj" in setup.lora
    needs_grad = {"qkv": False, "proj": "qkv" in setup.lora, "up": attn, "down": attn or "up" in setup.lora}
    for m in setup.lora:
        if needs_grad[m]:
            continue
        modules = modules_of(spec, m, setup)
        x = r if m in ("qkv", "up") else _a(setup)
        out -= len(modules) * n * modules[0][0] * (x if cpu else MASK)
    return out


def lit_qkv_zero_pad_saved_bytes(spec, setup) -> int:
    """What litgpt's ``LoRAQKVLinear`` saves for q, k, v adapted alone (not all three): ``lora =
    self.zero_pad(after_B) * self.scaling``, whose ``result.index_copy_(dim=-1, index=self.lora_ind,
    source=x)`` (litgpt/lora.py, LoRAQKVLinear.zero_pad) keeps ``source``, the adapter's output after_B,
    n·w·a for the enabled slices' width w (autograd's formula for index_copy's source,
    ``grad.index_select(dim, index).expand_as(source)``, reads it), and the index (``lora_ind.clone()``,
    w int64). 0 for qkv (``zero_pad`` returns its input) and without LoRA on the attention."""
    from memplan.memory.terms import lora_adapter_shapes

    if "qkv" not in setup.lora or _qkv_enabled(setup) == 3:
        return 0
    width = sum(o for _, o in lora_adapter_shapes(spec, setup, "qkv"))
    return _n(setup) * width * _a(setup) + width * 8


def lib_lora_head_saved_bytes(spec, setup, dropout: float, cpu: bool, frozen_input: bool = False) -> int:
    """What litgpt's and torchtune's head adapter saves beyond memplan's: with ``lora_dropout`` > 0 the
    dropout's mask on the final norm's output, n·H·x on the CPU (ATen's ``_dropout_impl``, the input's
    dtype: the residual's), n·H·1 on CUDA (``native_dropout``'s bool mask) (litgpt/lora.py,
    LoRALinear.forward: ``self.lora_dropout(x) @ self.lora_A.transpose(0, 1)``; torchtune
    modules/peft/lora.py: ``self.lora_a(self.dropout(x))``); the dropout's output stands in for memplan's
    saved input (``head_in``). 0 without dropout or a head adapter, and where the head's input needs no
    gradient (``frozen_input``: no block trains; ``input * noise`` keeps ``noise`` only for the input's)."""
    if not setup.lora_head or dropout <= 0 or frozen_input:
        return 0
    return _n(setup) * spec.hidden * (_r(setup) if cpu else MASK)


def lit_block_saved_bytes(spec, setup, dropout: float, cpu: bool) -> int:
    """Bytes one of litgpt's ``Block`` saves beyond memplan's block: its norms, its attention's
    layout, autocast's second cast for the MLP, its LoRA (q, k, v alone: ``lit_qkv_zero_pad_saved_bytes``)."""
    return (spec.norms_per_layer * lit_norm_saved_bytes(spec, setup) + lit_attention_saved_bytes(spec, setup, dropout)
            + lit_autocast_mlp_cast_bytes(spec, setup) + lit_lora_saved_bytes(spec, setup, dropout, cpu)
            + lit_qkv_zero_pad_saved_bytes(spec, setup))


# ---- the hooks of the torchtune stack (torchtune 0.6: torchtune/modules/*, modules/peft/lora.py) -------

def tt_norm_saved_bytes(spec, setup) -> int:
    """What one of torchtune's ``RMSNorm`` saves beyond memplan's fused norm (input and rstd).

    ``F.rms_norm(x.float(), normalized_shape=..., weight=self.scale, eps=self.eps).to(x.dtype)``
    (torchtune/modules/rms_norm.py, RMSNorm.forward): torch's ``rms_norm`` saves its fp32 input, n·H·4,
    in place of memplan's saved input, n·H·r (a new copy under bf16, the same tensor under fp32), and
    its normalised output before the weight, n·H·4, for the scale's gradient (not when the scale is
    frozen, under LoRA): the terms of litgpt's norm (``lit_norm_saved_bytes``)."""
    return lit_norm_saved_bytes(spec, setup)


def tt_attention_saved_bytes(spec, setup) -> int:
    """What torchtune's ``MultiHeadAttention`` saves beyond memplan's attention (fused qkv output, q and k
    rotated), per block.

    ``q = self.pos_embeddings(q, ...)`` and k likewise (``RotaryPositionalEmbeddings``: ``x_out.type_as(x)``),
    n·q_dim·a and n·kv·a; ``v = self.v_proj(y)``, n·kv·a; no fused output is kept. Grouped heads:
    ``k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)`` and v alike (torchtune/modules/attention.py,
    MultiHeadAttention.forward) are copies, n·q_dim·a each, which SDPA saves in place of k and v.
    (``output.transpose(1, 2).contiguous()`` copies nothing: q is rotated in (b, s, n_h, h_d), so SDPA's
    output comes back in that layout, and ``output_proj`` saves it as SDPA does, as in memplan's model.)"""
    n, a, q, kv = _n(setup), _a(setup), spec.q_dim, spec.kv_dim
    kept = q + (2 * q if spec.kv_heads != spec.heads else 2 * kv)
    return n * a * kept - n * a * ((q + 2 * kv) + q + kv)


def tt_lora_modules(spec, matrix: str, setup=None) -> list[tuple[int, int]]:
    """(in, rank multiple) of torchtune's ``LoRALinear`` modules for memplan's fused ``matrix``
    (``lora_llama3``: ``lora_attn_modules`` q_proj, k_proj, v_proj (those adapted alone), output_proj,
    each its own module; ``apply_lora_to_mlp``: w1, w3 (gate, up) and w2 (down); ``apply_lora_to_output``:
    the output projection)."""
    h, q, f = spec.hidden, spec.q_dim, spec.ffn
    return {"qkv": [(h, 1)] * _qkv_enabled(setup), "proj": [(q, 1)], "up": [(h, 1)] * 2, "down": [(f, 1)],
            "head": [(h, 1)]}[matrix]


def tt_lora_bytes_delta(spec, setup) -> int:
    """Bytes of torchtune's adapters beyond memplan's (gradients alike), in the model's dtype
    (``training.set_default_dtype``): ``self.lora_a = nn.Linear(in_features=in_dim, out_features=rank)``
    per module (torchtune/modules/peft/lora.py, LoRALinear.__init__): q_proj, k_proj and v_proj each an
    A of r·H where memplan's fused qkv has one (2·r·H more), w1 and w3 likewise (r·H more)."""
    return lit_lora_bytes_delta(spec, setup)


def tt_lora_tensors_delta(spec, setup) -> int:
    """Adapter tensors beyond memplan's: A and B for each of q_proj, k_proj, v_proj (4 more than memplan's
    fused qkv adapter; as many as memplan's adapters on q, k, v alone) and of w1, w3 (2 more), per layer."""
    if not setup.lora_rank:
        return 0
    from memplan.memory.terms import lora_adapter_shapes

    qkv = 2 * (_qkv_enabled(setup) - len(lora_adapter_shapes(spec, setup, "qkv"))) if "qkv" in setup.lora else 0
    return spec.layers * (qkv + (2 if "up" in setup.lora else 0))


def tt_lora_saved_bytes(spec, setup, dropout: float, cpu: bool = False) -> int:
    """What torchtune's adapters save beyond memplan's, per block: ``lora_out =
    self.lora_a(self.dropout(x))``, ``self.lora_b(lora_out)`` (torchtune/modules/peft/lora.py,
    LoRALinear.forward) per module (``tt_lora_modules``): x·Aᵀ, n·r·a each (q, k, v: 3 for memplan's 1;
    w1, w3: 2 for 1); with ``lora_dropout`` > 0 each module's ``nn.Dropout`` output and mask, for
    memplan's one saved input (``_lib_lora_saved_bytes``). Without dropout (the configs' 0.0,
    ``nn.Identity``) the modules share their input, as memplan's fused adapter saves it once."""
    return _lib_lora_saved_bytes(spec, setup, dropout, cpu, tt_lora_modules)


def tt_chunked_loss_backward_bytes(spec, setup, chunks: int = 8) -> int:
    """What torchtune's chunked loss holds at its backward short of memplan's walk (≤ 0).

    ``CEWithChunkedOutputLoss``: ``F.cross_entropy(logits.float(), labels, ..., reduction="sum")`` per
    chunk of ``num_output_chunks = 8`` (torchtune/modules/loss/ce_chunked_output_loss.py), over the
    chunks ``model.output(chunk)`` made (TransformerDecoder.chunked_output). Backward takes the chunks
    one at a time: at the first, all the saved log-probabilities (n·V·4) and that chunk's two
    gradients (2·n·V·4/8), where memplan's walk holds the log-probabilities and two whole gradients:
    −2·n·V·4·(1 − 1/8)."""
    return -2 * _n(setup) * spec.vocab * FP32 * (chunks - 1) // chunks


def tt_chunked_upcast_bytes(spec, setup, chunks: int = 8) -> int:
    """The fp32 copy of the logits torchtune's loss never holds whole (≤ 0).

    ``F.cross_entropy(logits.float(), ...)`` per chunk (CEWithChunkedOutputLoss.compute_cross_entropy):
    under bf16 each chunk's fp32 copy, n·V·4/8, lives until that chunk's log-probabilities are made,
    where memplan's ``logits.float()`` copies the whole logits: −n·V·4·(1 − 1/8). 0 under fp32
    (``.float()`` returns the logits themselves)."""
    if _a(setup) == FP32:
        return 0
    return -_n(setup) * spec.vocab * FP32 * (chunks - 1) // chunks


def tt_rope_cache_bytes(spec, setup) -> int:
    """torchtune's rotary table beyond memplan's cos and sin for the context.

    ``RotaryPositionalEmbeddings.build_rope_cache(max_seq_len)``: ``cache = torch.stack([torch.cos(idx_theta),
    torch.sin(idx_theta)], dim=-1)`` (torchtune/modules/position_embeddings.py), a buffer of max_seq_len ×
    head_dim/2 × 2, fp32 under every dtype (``idx_theta = torch.einsum(...).float()``), shared by the layers,
    except in ``lora_llama3``, whose ``lora_llama3_self_attention`` builds one per layer
    (torchtune/models/llama3/_component_builders.py; ``lora_llama3_2``, the tied shapes', shares one);
    ``max_seq_len`` is the model's, max(ctx, the shape's max positions), where memplan's tables cover
    the context."""
    from memplan.memory.terms import rope_buffer_bytes

    seq = max(setup.ctx, spec.max_positions)
    copies = spec.layers if setup.lora_rank and not spec.tied else 1
    return copies * 2 * seq * (spec.rotary_dim // 2) * FP32 - rope_buffer_bytes(spec, setup)


def tt_chunked_head_grad_bytes(spec, setup) -> int:
    """The head's weight gradient summed over torchtune's output chunks: 2·V·H·p at the head's backward.

    ``[self.output(chunk) for chunk in last_hidden_state.chunk(self.num_output_chunks, dim=1)]``
    (torchtune/modules/transformer.py, TransformerDecoder.chunked_output): one weight used 8 times,
    so autograd sums 8 weight gradients: at each sum the running total, the chunk's gradient and
    their sum (``aten.add``) are live, 3·V·H·p where memplan's one matmul makes one. 0 under LoRA
    (the head is frozen)."""
    return 0 if setup.lora_rank else 2 * spec.vocab * spec.hidden * setup.param_bytes


def tt_walked_setup(setup):
    """torchtune's recipes' AdamW is fused: ``optimizer: {_component_: torch.optim.AdamW, fused: True}``
    (the configs of lora_finetune_single_device and full_finetune_single_device): no foreach scratch,
    whatever ``--optimizer adamw`` says."""
    return setup.replace(optimizer="adamw-fused") if setup.optimizer == "adamw" else setup


def tt_block_saved_bytes(spec, setup, dropout: float, cpu: bool) -> int:
    """Bytes one of torchtune's ``TransformerSelfAttentionLayer`` saves beyond memplan's block: its norms,
    its attention's layout, its LoRA."""
    return (spec.norms_per_layer * tt_norm_saved_bytes(spec, setup) + tt_attention_saved_bytes(spec, setup)
            + tt_lora_saved_bytes(spec, setup, dropout, cpu))


@dataclass(frozen=True)
class Stack:
    """The walk's hooks for one stack's code. ``memplan`` (the default) adds nothing."""

    name: str = "memplan"
    loss_dtype: str = "fp32"  # LOSS_DTYPES
    lora_dropout: float = 0.0  # peft's LoraConfig.lora_dropout (transformers)
    cpu: bool = False  # the step runs on the CPU (dropout's mask in the input's dtype)

    def block_saved_bytes(self, spec, setup) -> int:
        """Bytes one block saves for backward beyond memplan's own block (may be negative)."""
        if self.name == "litgpt":
            return lit_block_saved_bytes(spec, setup, self.lora_dropout, self.cpu)
        if self.name == "torchtune":
            return tt_block_saved_bytes(spec, setup, self.lora_dropout, self.cpu)
        if self.name != "transformers":
            return 0
        return (spec.norms_per_layer * hf_norm_saved_bytes(spec, setup) + hf_attention_saved_bytes(spec, setup)
                + hf_lora_saved_bytes(spec, setup, self.lora_dropout, self.cpu)
                + hf_shared_norm_saved_bytes(spec, setup) + hf_gelu_new_saved_bytes(spec, setup, self.cpu)
                + hf_qk_norm_saved_bytes(spec, setup) + hf_sdpa_output_copy_bytes(spec, setup, self.lora_dropout)
                + hf_autocast_input_casts_bytes(spec, setup))

    def first_block_unsaved_bytes(self, spec, setup) -> int:
        """Of ``block_saved_bytes``, what the first block does not save under LoRA (its input is frozen)."""
        if self.name == "transformers":
            return hf_first_block_unsaved_bytes(spec, setup, self.lora_dropout, self.cpu)
        return -self.first_block_saved_bytes(spec, setup)  # litgpt's, torchtune's (0 for memplan)

    def adapter_saved_bytes(self, spec, setup, matrix: str) -> int:
        """Of ``block_saved_bytes``, what the adapters on ``matrix`` save, made where they run (peft's)."""
        return hf_lora_adapter_made_bytes(spec, setup, matrix, self.lora_dropout, self.cpu) \
            if self.name == "transformers" else 0

    def norm_saved_bytes(self, spec, setup) -> int:
        """Of ``block_saved_bytes``, what each of the stack's block norms saves beyond memplan's, made where the
        norm runs (transformers' RMSNorm: its fp32 copy of the input)."""
        return hf_norm_saved_bytes(spec, setup) if self.name == "transformers" else 0

    def attention_saved_bytes(self, spec, setup) -> int:
        """Of ``block_saved_bytes``, what the stack's attention saves beyond memplan's, made where attention
        runs (transformers' fp32 softmax under eager attention; the fused qkv output its rotary does not keep)."""
        return hf_attention_saved_bytes(spec, setup) if self.name == "transformers" else 0

    def qk_norm_saved_bytes(self, spec, setup) -> int:
        """Of ``block_saved_bytes``, what the stack's per-head q/k norms save, made where attention runs (qwen3's)."""
        return hf_qk_norm_saved_bytes(spec, setup) if self.name == "transformers" else 0

    def rotary_held_bytes(self, spec, setup) -> int:
        """Rotary outputs the stack's attention holds beyond the walk's from the rotary to the out-projection."""
        return hf_qk_rotary_held_bytes(spec, setup) if self.name == "transformers" else 0

    def rotary_transient_bytes(self, spec, setup) -> int:
        """What the stack's qk norms and rotary hold at once beyond the walk's tensors (made and freed there)."""
        return hf_qk_rotary_transient_bytes(spec, setup) if self.name == "transformers" else 0

    def softmax_backward_bytes(self, spec, setup) -> int:
        """Temporaries the stack's eager softmax backward holds at once beyond the walk's (transformers' fp32 one)."""
        return hf_softmax_backward_bytes(spec, setup) if self.name == "transformers" else 0

    def qk_norm_backward_bytes(self, spec, setup) -> int:
        """Temporaries the stack's qk norms' backward holds at once beyond the walk's attention gradients."""
        return hf_qk_norm_backward_bytes(spec, setup) if self.name == "transformers" else 0

    def recompute_gradient_bytes(self, spec, setup) -> int:
        """Gradients alive through a checkpointed block's recomputation, made before it (peft's)."""
        return hf_recompute_gradient_bytes(spec, setup) if self.name == "transformers" else 0

    def recompute_reaches_down_adapter(self, setup) -> bool:
        """Whether a checkpointed block's recomputation runs on into down's adapter, up to lora_A's output
        (``hf_recompute_down_adapter_bytes``); memplan's walk stops before down."""
        return self.name == "transformers" and bool(setup.lora_rank) and "down" in setup.lora \
            and setup.checkpointing == "full"

    def recompute_stop_bytes(self, spec, setup) -> int:
        """What is alive, unsaved, where a checkpointed block's recomputation stops, beyond what the walk holds."""
        if self.name != "transformers":
            return 0
        return hf_recompute_down_adapter_bytes(spec, setup, self.lora_dropout) + \
            hf_recompute_locals_bytes(spec, setup, self.lora_dropout)

    def lora_forward_transient_bytes(self, spec, setup, matrix: str) -> int:
        """The adapter forward's transient beyond memplan's n·out·a, for ``matrix`` (may be negative)."""
        if self.name != "transformers":
            return 0
        return hf_lora_forward_transient_bytes(spec, setup, matrix) + \
            hf_lora_input_cast_transient_bytes(spec, setup, matrix, self.lora_dropout)

    def lora_input_release(self, spec, setup, matrix: str) -> tuple[int, int] | None:
        """Where a stack's adapter releases its saved input in its own backward (peft's ``lora_A``):
        (bytes saved beyond memplan's adapter input, the adapter's input-gradient bytes before the
        cast back); None where the walk's own order holds (memplan's)."""
        if self.name != "transformers" or matrix not in setup.lora:
            return None
        saved = (hf_lora_input_saved_bytes(spec, setup, matrix, self.lora_dropout, self.cpu)
                 - memplan_lora_input_bytes(spec, setup, matrix, self.lora_dropout))
        return saved, hf_lora_input_grad_bytes(spec, setup, matrix)

    def lora_head_saved_bytes(self, spec, setup, frozen_input: bool = False) -> int:
        """What the stack's head adapter saves beyond memplan's (its input, x·Aᵀ) (may be negative);
        ``frozen_input``: the head's input needs no gradient (no block trains)."""
        if self.name in ("litgpt", "torchtune"):
            return lib_lora_head_saved_bytes(spec, setup, self.lora_dropout, self.cpu, frozen_input)
        if self.name != "transformers":
            return 0
        return hf_lora_head_saved_bytes(spec, setup, self.lora_dropout, self.cpu, frozen_input)

    def lora_head_input_held_bytes(self, spec, setup) -> int:
        """The head's input the stack's model holds to the end of its forward beside the head adapter's saved
        input (``hf_lora_head_input_held_bytes``)."""
        return hf_lora_head_input_held_bytes(spec, setup, self.lora_dropout) if self.name == "transformers" else 0

    def mlp_backward_scratch_bytes(self, spec, setup) -> int:
        """Temporaries a non-gated MLP's activation backward holds beyond memplan's one input gradient."""
        return hf_gelu_new_backward_bytes(spec, setup) if self.name == "transformers" else 0

    def norm_backward_bytes(self, spec, setup, held: int, saved_held: bool = True) -> int:
        """Temporaries a norm's backward holds at once beyond the ``held`` bytes of memplan's fused norm's peak
        (and the norm's saved tensors, where the walk still holds them: ``saved_held``)."""
        return hf_rmsnorm_backward_bytes(spec, setup, held, saved_held) if self.name == "transformers" else 0

    def final_norm_saved_bytes(self, spec, setup) -> int:
        """Bytes the final norm saves beyond memplan's."""
        if self.name == "litgpt":
            return lit_norm_saved_bytes(spec, setup)
        if self.name == "torchtune":
            return tt_norm_saved_bytes(spec, setup)
        return hf_norm_saved_bytes(spec, setup) if self.name == "transformers" else 0

    def held_logits_bytes(self, spec, setup) -> int:
        """Logits the stack's loop keeps alive from the LM head's backward to the end of the step."""
        return lit_held_logits_bytes(spec, setup) if self.name == "litgpt" else 0

    def chunked_loss_backward_bytes(self, spec, setup) -> int:
        """Loss bytes (≤ 0) a chunked loss has freed by the moment its gradient is whole."""
        if self.name == "torchtune":
            return tt_chunked_loss_backward_bytes(spec, setup)
        return lit_chunked_loss_backward_bytes(spec, setup) if self.name == "litgpt" else 0

    def chunked_upcast_bytes(self, spec, setup) -> int:
        """Bytes (≤ 0) of the logits' fp32 copy a loss upcasting chunk by chunk never holds."""
        return tt_chunked_upcast_bytes(spec, setup) if self.name == "torchtune" else 0

    def buffer_bytes_delta(self, spec, setup) -> int:
        """Buffers (rotary tables) the stack's model keeps beyond memplan's."""
        if self.name == "torchtune":
            return tt_rope_cache_bytes(spec, setup)
        return lit_rope_cache_bytes(spec, setup) if self.name == "litgpt" else 0

    def first_block_saved_bytes(self, spec, setup) -> int:
        """Bytes (≤ 0) the first block saves short of the others (LoRA: its input needs no gradient)."""
        modules = {"litgpt": lit_lora_modules, "torchtune": tt_lora_modules}.get(self.name)
        if modules is None:
            return 0
        return _lib_first_block_saved_bytes(spec, setup, self.lora_dropout, self.cpu, modules)

    def chunked_head_grad_bytes(self, spec, setup) -> int:
        """Temporaries of a head run in chunks, summing its weight's gradients, at the head's backward."""
        return tt_chunked_head_grad_bytes(spec, setup) if self.name == "torchtune" else 0

    def optimizer_scratch_bytes(self, spec, setup) -> int:
        """Scratch of a stack's own optimizer loop at the optimizer step (beyond the walked optimizer's)."""
        return lit_optimizer_scratch_bytes(spec, setup, self.cpu) if self.name == "litgpt" else 0

    def walked_setup(self, setup):
        """The step the stack's code takes for ``setup``: its own optimizer (``lit_walked_setup``,
        ``tt_walked_setup``)."""
        if self.name == "litgpt":
            return lit_walked_setup(setup, self.cpu)
        return tt_walked_setup(setup) if self.name == "torchtune" else setup

    def walked_spec(self, spec):
        """The model the stack's code builds for ``spec``: litgpt's ``GPT`` has no tied head."""
        return lit_walked_spec(spec) if self.name == "litgpt" else spec

    def lora_bytes_delta(self, spec, setup) -> int:
        """Bytes of adapter weights beyond memplan's (their gradients alike; optimizer state follows)."""
        if self.name == "litgpt":
            return lit_lora_bytes_delta(spec, setup)
        if self.name == "torchtune":
            return tt_lora_bytes_delta(spec, setup)
        return hf_lora_bytes_delta(spec, setup) if self.name == "transformers" else 0

    def lora_tensors_delta(self, spec, setup) -> int:
        """Adapter parameter tensors beyond memplan's (AdamW keeps a ``step`` per tensor)."""
        if self.name == "litgpt":
            return lit_lora_tensors_delta(spec, setup)
        if self.name == "torchtune":
            return tt_lora_tensors_delta(spec, setup)
        if self.name != "transformers" or not setup.lora_rank:
            return 0
        from memplan.memory.terms import lora_tensors

        return hf_lora_tensors(spec, setup) - lora_tensors(spec, setup)

    @property
    def checkpointed_input_needs_grad(self) -> bool:
        """Whether checkpointing makes the blocks' input require a gradient even where nothing below them
        trains: transformers' ``gradient_checkpointing_enable()`` calls ``enable_input_require_grads()`` on
        a model whose input embeddings are frozen (``modeling_utils.py``), so the checkpointed blocks run
        their backward under a head-only LoRA too."""
        return self.name == "transformers"

    @property
    def ddp_gradient_as_bucket_view(self) -> bool:
        """Whether DDP's ``.grad`` are views into its buckets: memplan's trainer sets
        ``gradient_as_bucket_view=True`` (``trainer/distributed.py``); transformers' Trainer keeps
        PyTorch's default, False, so the buckets are a second gradient-sized buffer
        (``memory.ddp_separate_bucket_bytes``)."""
        return self.name != "transformers"

    @property
    def checkpointings(self) -> tuple[str, ...]:
        """The checkpointing modes this stack's code has: transformers checkpoints whole layers
        (``gradient_checkpointing_enable()``), no selective policy."""
        return {"transformers": ("none", "full"), "torchtune": ("none", "full"),
                "litgpt": ("none",)}.get(self.name, ("none", "selective", "full"))

    @property
    def shardings(self) -> tuple[str, ...]:
        """The shardings the walk follows for this stack: FSDP is walked for memplan's own step only."""
        return {"transformers": ("none", "ddp"), "litgpt": ("none",), "torchtune": ("none",)}.get(
            self.name, ("none", "ddp", "fsdp"))

    @property
    def attentions(self) -> tuple[str, ...]:
        """The attention implementations the stack's code has: litgpt's and torchtune's are SDPA only."""
        return LIB_SETUPS[self.name]["attention"] if self.name in LIB_SETUPS else ("sdpa", "eager")

    @property
    def precisions(self) -> tuple[str, ...]:
        """The precisions the stack's code trains in (torchtune: one dtype, no autocast; litgpt: no fp16)."""
        if self.name in LIB_SETUPS:
            return LIB_SETUPS[self.name]["precision"]
        from memplan.setup import PRECISIONS

        return PRECISIONS

    @property
    def fp32_loss(self) -> bool:
        """Whether the loss upcasts the logits (``logits.float()``)."""
        return self.loss_dtype == "fp32"

    def on_cpu(self, cpu: bool) -> "Stack":
        """The same hooks for a step on the CPU (True) or an accelerator."""
        return Stack(self.name, self.loss_dtype, self.lora_dropout, cpu)


MEMPLAN = Stack()


LORA_DEFAULT_DROPOUT = {"litgpt": 0.05}  # finetune/lora.py's lora_dropout; peft's and torchtune's configs: 0.0


def stack_of(name: str = "memplan", loss_dtype: str | None = None, lora_dropout: float | None = None,
             cpu: bool = False) -> Stack:
    """The hooks of stack ``name``; ``loss_dtype`` None: what the stack's own loss does (fp32 for all);
    ``lora_dropout`` None: the stack's own default (``LORA_DEFAULT_DROPOUT``, else 0)."""
    check_stack(name)
    if lora_dropout is None:
        lora_dropout = LORA_DEFAULT_DROPOUT.get(name, 0.0)
    if not 0.0 <= lora_dropout < 1.0:
        raise InputError(f"--lora-dropout: {lora_dropout} must be in [0, 1)")
    return Stack(name=name, loss_dtype=check_loss_dtype(loss_dtype or "fp32"), lora_dropout=lora_dropout, cpu=cpu)

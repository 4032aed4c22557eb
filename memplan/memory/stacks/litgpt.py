"""The ``litgpt`` stack: litgpt 0.5's single-device scripts (litgpt/model.py, litgpt/lora.py, litgpt/utils.py),
torch-free.

The step ``memplan trace --stack litgpt`` traces (``trainer/stacks/litgpt.py``). Each hook below is a small
pure function whose docstring names the tensor it adds (or removes) beyond memplan's own step and the line
of litgpt that makes it; ``LitgptStack`` calls them at the walk's fixed points. The adapters' helpers shared
with torchtune's (``lib_lora_saved_bytes``, ``lib_first_block_saved_bytes``, ``lib_lora_head_saved_bytes``,
``check_lib_setup``) live here too.
"""

from __future__ import annotations

from typing import ClassVar

from memplan.errors import InputError
from memplan.memory.stacks.base import FP32, HALF, MASK, Stack, _a, _n, _r
from memplan.memory.terms import (lora_adapter_shapes, lora_input_casts_bytes, optimizer_temporary_bytes,
                                  rope_buffer_bytes)
from memplan.setup import QKV_PARTS
from memplan.units import possessive


def check_lib_setup(stack: Stack, spec, setup) -> None:
    """The one-line InputError where litgpt's scripts or torchtune's recipes on one device do not run
    ``setup``'s step for ``spec``: the stack's ``archs`` with rotary positions, its ``precisions``,
    ``attentions``, ``checkpointings`` and ``shardings``; their LoRA adapts the MLP whole, up and down
    together."""
    if spec.arch not in stack.archs or spec.pos != "rope":
        raise InputError(f"--stack {stack.name}: the walk covers {possessive(stack.name)} {', '.join(stack.archs)} "
                         f"models (rotary positions), not {spec.arch!r}")
    for field in ("precision", "attention", "checkpointing", "sharding"):
        value, allowed = getattr(setup, field), getattr(stack, field + "s")
        if value not in allowed:
            raise InputError(f"--stack {stack.name}: --{field} {value} is not one that {possessive(stack.name)} "
                             f"code takes (accepted: {', '.join(allowed)})")
    if setup.lora_rank and ("up" in setup.lora) != ("down" in setup.lora):
        raise InputError(f"--stack {stack.name}: --lora-targets {setup.lora_targets}: {stack.name} adapts the MLP "
                         "whole (accepted: qkv, q, k, v, proj, and up with down, head)")


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
    saved its log-probabilities. Under bf16 that fp32 copy is made inside the forward and the model's own
    bf16 logits are freed when it returns, before the loss runs (``upcasts_output``): at the loss's forward
    the fp32 logits and the log-probabilities are alive (8 bytes a logit), not the bf16 logits beside them."""
    return _n(setup) * spec.vocab * FP32


LIT_LOSS_CHUNK = 128  # chunked_cross_entropy(chunk_size=128); finetune/lora.py's lm_head_chunk_size=128


def lit_head_chunks(setup) -> int:
    """How many pieces finetune/lora.py's head runs in: ``x.split(lm_head_chunk_size, dim=1)`` with
    ``lm_head_chunk_size=128``, k = ⌈T/128⌉ (1 without LoRA: pretrain.py runs the head whole).

    The logits' gradient comes in those pieces too: ``torch.cat(loss_chunks)``'s backward gives each
    chunk's ``cross_entropy`` its share, whose gradient (B·128·V·4) the chunk's ``.to(float32)``
    (Fabric's ``convert_output``) casts back to bf16 (B·128·V·2) and the chunk's ``lm_head`` backward
    consumes: the whole fp32 gradient of the logits and its whole bf16 cast are never alive at once
    (``Stack.logits_grad_chunks``)."""
    return -(-setup.ctx // LIT_LOSS_CHUNK) if setup.lora_rank else 1


def lit_head_weight_casts_bytes(spec, setup) -> int:
    """The bf16 copies of the LM head's weight that litgpt's chunked head makes under autocast beyond the
    walk's one: (k − 1)·V·H·2, k = ``lit_head_chunks``.

    ``[clamp_head(self.lm_head(x_i)) for x_i in x.split(lm_head_chunk_size, dim=1)]`` (litgpt/model.py,
    GPT.forward, with LoRA's ``lm_head_chunk_size=128``): each chunk's ``F.linear`` casts the fp32 weight to
    bf16 anew (autocast caches the cast of a leaf that requires a gradient only, ``cached_cast``; under LoRA
    the head is frozen), and saves its copy for the chunk's input gradient until that chunk's backward, V·H·2
    each. 0 without autocast, without LoRA (one head matmul, its weight's cast cached) and for T ≤ 128."""
    if not setup.mixed:
        return 0
    return (lit_head_chunks(setup) - 1) * spec.vocab * spec.hidden * HALF


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
        k = lit_head_chunks(setup)
        return -2 * full * (k - 1) // k
    return -full if _n(setup) > LIT_LOSS_CHUNK else 0


def lit_finetune_full_shifted_loss_bytes(spec, setup) -> int:
    """What finetune/full.py's loss holds short of the walk's at its backward (≤ 0): ``loss =
    chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])`` drops each sequence's last position, so its
    log-probabilities and their gradient cover B·(T−1) rows where the walk's cover B·T: −B·V·4. finetune_full is
    the one litgpt step with ``--checkpointing full`` (its FSDPStrategy's ``activation_checkpointing_policy=
    {Block}``; one device has none: ``lit_check_sharding``); 0 for pretrain.py's and finetune/lora.py's steps."""
    if setup.checkpointing != "full" or setup.lora_rank:
        return 0
    return -setup.micro_batch * spec.vocab * FP32


def lit_rope_cache_bytes(spec, setup) -> int:
    """litgpt's cos and sin beyond memplan's.

    ``cos, sin = self.rope_cache()`` (litgpt/model.py, GPT.max_seq_length's setter: ``build_rope_cache(
    seq_len=self.max_seq_length, n_elem=self.config.rope_n_elem, ...)``, then ``torch.cat([cos, cos],
    dim=-1)`` alike): two buffers of ctx × rotary_dim, where memplan's cover ctx × rotary_dim/2; fp32,
    bf16 once Fabric's bf16-true converts the module."""
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


def qkv_enabled(setup) -> int:
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
    return {"qkv": [(h, qkv_enabled(setup))], "proj": [(q, 1)], "up": up, "down": [(f, 1)], "head": [(h, 1)]}[matrix]


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
    extra = 0
    if "qkv" in setup.lora:
        extra += (qkv_enabled(setup) - len(lora_adapter_shapes(spec, setup, "qkv"))) * setup.lora_rank * spec.hidden
    if "up" in setup.lora and spec.mlp == "swiglu":
        extra += setup.lora_rank * spec.hidden
    return spec.layers * extra * setup.param_bytes


def lit_lora_tensors_delta(spec, setup) -> int:
    """Adapter tensors beyond memplan's: ``fc_1`` and ``fc_2`` with an A and a B each, for memplan's one
    fused gate-and-up adapter (two tensors more per layer); one ``LoRAQKVLinear`` (an A and a B) for
    memplan's k adapters on q, k, v adapted alone (2·(k − 1) fewer)."""
    if not setup.lora_rank:
        return 0
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
    return lib_lora_saved_bytes(spec, setup, dropout, cpu, lit_lora_modules)


def lib_lora_saved_bytes(spec, setup, dropout: float, cpu: bool, modules_of) -> int:
    """litgpt's and torchtune's adapters beyond memplan's (``lit_lora_saved_bytes``, ``tt_lora_saved_bytes``):
    per module n·r·a (x·Aᵀ) times its rank multiple; with dropout, its output (n·in·a) and mask (n·in·x
    on the CPU, x the input's bytes; 1 on CUDA) for memplan's saved input; under autocast (litgpt) a
    cast of the norm output per module reading it."""
    if not setup.lora_rank:
        return 0
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


def lib_first_block_saved_bytes(spec, setup, dropout: float, cpu: bool, modules_of) -> int:
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
    if "qkv" not in setup.lora or qkv_enabled(setup) == 3:
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


def lit_recompute_reaches_down_adapter(setup) -> bool:
    """Whether a checkpointed block's recomputation runs on into litgpt's down adapter (finetune_lora's
    ``checkpoint_wrapper`` around every ``Block``, several devices): ``pretrained = self.linear(x)``, then
    ``(self.lora_dropout(x) @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)) * self.scaling``
    (litgpt/lora.py, LoRALinear.forward): the last tensor the block's backward needs is x·Aᵀ, saved by the
    matmul with Bᵀ, so torch.utils.checkpoint's non-reentrant recomputation stops there, past memplan's stop
    before down. True under LoRA on down (``lora_mlp``) with checkpointing."""
    return bool(setup.lora_rank) and "down" in setup.lora and setup.checkpointing == "full"


def lit_recompute_stop_bytes(spec, setup, dropout: float) -> int:
    """What is alive and unsaved where litgpt's recomputation stops in the down adapter
    (``lit_recompute_reaches_down_adapter``), beyond what the walk holds there; made and freed with the
    interrupted forward:

    - ``pretrained = self.linear(x)`` (litgpt/lora.py, LoRALinear.forward), the frozen base matmul's output,
      n·H·a, made before the adapter's branch (``lit_recompute_base_output_bytes``);
    - the locals of ``Block.forward`` and ``LLaMAMLP.forward`` (litgpt/model.py) still referenced
      (``lit_recompute_locals_bytes``)."""
    if not lit_recompute_reaches_down_adapter(setup):
        return 0
    return lit_recompute_base_output_bytes(spec, setup) + lit_recompute_locals_bytes(spec, setup, dropout)


def lit_recompute_base_output_bytes(spec, setup) -> int:
    """down's ``pretrained = self.linear(x)``, n·H·a, alive when the recomputation stops at x·Aᵀ."""
    return _n(setup) * spec.hidden * _a(setup)


def lit_recompute_locals_bytes(spec, setup, dropout: float) -> int:
    """The tensors ``Block.forward`` and ``LLaMAMLP.forward`` (litgpt/model.py) hold as Python locals (or call
    arguments) when a recomputation stops inside the down adapter, where the walk holds none of them:

    - ``attention_output = self.attn(x_normed, ...)``, n·H·a, kept by ``Block.forward`` until it returns (the
      walk frees the out-projection's output once the residual is added);
    - ``x_normed = self.norm_2(x)``, the MLP's input, n·H·r (the residual's dtype: fp32 under autocast), unless
      the walk holds it already (up adapted without dropout: memplan's adapter saves it); ``x_normed =
      self.norm_1(x)`` is released when that name is rebound (saved by the qkv adapter where the walk counts it);
    - with ``lora_dropout`` > 0, LLaMAMLP's ``x = F.silu(x_fc_1) * x_fc_2``, the argument of ``self.proj(x)``,
      n·F·a, which down's ``lora_A`` does not save (it saves its dropout's output, counted in
      ``lit_lora_saved_bytes`` in its place);
    - under bf16 (``bf16-true``), ``x = x.float()`` of each ``RMSNorm`` is a new fp32 tensor beside its bf16
      input, which here the checkpoint (norm_1's: the block input) or ``Block.forward``'s ``x`` (norm_2's: the
      residual) keeps: norms·n·H·2 (``lit_norm_saved_bytes`` counts the copy in place of the input), and
      ``weight.float()``, norms·H·4."""
    n, a, h = _n(setup), _a(setup), spec.hidden
    out = n * h * a  # attention_output
    if "up" not in setup.lora or dropout > 0:
        out += n * h * _r(setup)  # the MLP's input: RMSNorm's ``.to(dtype=dtype)``, the residual's dtype
    if dropout > 0:
        out += n * spec.ffn * a  # down's input
    if setup.precision == "bf16" and spec.norm == "rmsnorm":
        out += spec.norms_per_layer * (n * h * HALF + h * FP32)
    return out


def lit_recompute_gradient_bytes(spec, setup) -> int:
    """The gradients autograd makes in a checkpointed block's backward before its recomputation starts: the
    nodes before the first that unpacks a saved tensor save nothing, the residual add and down's
    ``pretrained + lora`` and ``lora * self.scaling`` (litgpt/lora.py, LoRALinear.forward), whose backward makes
    the gradient of ``lora``, n·H·a, alive through the recomputation that x·Aᵀ's matmul starts; under autocast
    the residual add's backward first casts the fp32 gradient to the 16-bit dtype of down's output, n·H·a more.
    0 without a down adapter or checkpointing (``lit_recompute_reaches_down_adapter``)."""
    if not lit_recompute_reaches_down_adapter(setup):
        return 0
    return _n(setup) * spec.hidden * _a(setup) * (2 if setup.mixed else 1)


def lit_check_sharding(setup) -> None:
    """The one-line InputError where the walk does not follow litgpt's layout over several devices.

    Walked: Fabric's DDPStrategy; with ``--sharding fsdp`` and LoRA, finetune/lora.py's
    ``ModelParallelStrategy(parallelize_fn=parallelize_fn)``, FSDP2 over every ``Block`` and its
    ``checkpoint_wrapper`` (each block checkpointed), then the root (``memory.stacks.litgpt_sharding.LitFullyShard``);
    without LoRA, the FSDP1 ``FSDPStrategy`` of pretrain.py (``--checkpointing none``) and finetune/full.py
    (``--checkpointing full``: its ``activation_checkpointing_policy={Block}``), one micro-batch
    (``memory.fsdp1.FlatShard``). Not walked: FSDP1's ``no_sync`` accumulation (unsharded gradients kept across
    micro-batches). The checkpointing each script runs is ``lit_check_checkpointing``'s."""
    if setup.sharding == "fsdp" and not setup.lora_rank and setup.grad_accum > 1:
        raise InputError(f"--stack litgpt: --sharding fsdp --grad-accum {setup.grad_accum}: FSDP1's no_sync "
                         "accumulation (unsharded gradients kept across micro-batches) is not walked (accepted: "
                         "--grad-accum 1; or --lora-rank, finetune_lora's FSDP2)")


def lit_fsdp_lora(setup) -> bool:
    """Whether ``setup`` is finetune_lora over several devices: FSDP2 (``--sharding fsdp``) with LoRA."""
    return setup.sharding == "fsdp" and bool(setup.lora_rank)


def lit_checkpointings(setup) -> tuple[str, ...]:
    """The checkpointing litgpt's script for ``setup`` runs: finetune_lora's ``parallelize_fn`` checkpoints every
    ``Block`` (several devices: ``checkpoint_wrapper`` around each, ``activation_checkpointing=True`` being its
    default and ``ModelParallelStrategy`` passing nothing else); under FSDP1 pretrain.py checkpoints none and
    finetune/full.py every Block (``activation_checkpointing_policy={Block}``); one device or DDP, none."""
    if lit_fsdp_lora(setup):
        return ("full",)
    return ("none", "full") if setup.sharding == "fsdp" else ("none",)


def lit_check_checkpointing(setup) -> None:
    """The one-line InputError where ``--checkpointing`` is not one litgpt's script for ``setup`` runs
    (``lit_checkpointings``)."""
    accepted = lit_checkpointings(setup)
    if setup.checkpointing in accepted:
        return
    if lit_fsdp_lora(setup):
        raise InputError(f"--stack litgpt: --checkpointing {setup.checkpointing} with --sharding fsdp: finetune_lora's "
                         "parallelize_fn checkpoints every Block (accepted: full)")
    if setup.sharding == "fsdp":
        raise InputError(f"--stack litgpt: --sharding fsdp --checkpointing {setup.checkpointing}: litgpt's FSDP "
                         "checkpoints whole blocks (finetune_full) or none (pretrain) (accepted: none, full)")
    raise InputError(f"--stack litgpt: --checkpointing {setup.checkpointing}: litgpt checkpoints blocks only under "
                     "FSDP with several devices (finetune_full; finetune_lora's FSDP2); one device or DDP has none "
                     "(accepted: none; full with --sharding fsdp)")


def lit_ddp_gradient_as_bucket_view() -> bool:
    """Fabric's ``DDPStrategy.setup_module``: ``DistributedDataParallel(module=module, device_ids=device_ids,
    **self._ddp_kwargs)`` (lightning/fabric/strategies/ddp.py), no kwargs unless the user passes them, so
    PyTorch's default ``gradient_as_bucket_view=False``: the buckets are a second gradient-sized buffer
    beside ``.grad`` (``memory.sharding.ddp_separate_bucket_bytes``), as under transformers' Trainer."""
    return False


class LitgptStack(Stack):
    """litgpt's ``GPT`` and its scripts' step: the hooks above at the walk's fixed points."""

    name: ClassVar[str] = "litgpt"
    library: ClassVar[str | None] = "litgpt"
    walks_sdpa_gqa_repeat: ClassVar[bool] = False
    has_lora_dropout: ClassVar[bool] = True
    # what litgpt's single-device scripts take
    archs: ClassVar[tuple[str, ...]] = ("llama", "gpt_neox")
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "tf32", "bf16-mixed", "bf16")
    attentions: ClassVar[tuple[str, ...]] = ("sdpa",)
    # on one device (what autotune searches); under FSDP, lit_checkpointings: finetune_full's and finetune_lora's full
    checkpointings: ClassVar[tuple[str, ...]] = ("none",)
    # Fabric's DDPStrategy; FSDP1 (pretrain, finetune_full) and finetune_lora's FSDP2 (lit_check_sharding)
    shardings: ClassVar[tuple[str, ...]] = ("none", "ddp", "fsdp")
    lora_default_dropout: ClassVar[float] = 0.05  # finetune/lora.py's lora_dropout
    upcasts_output: ClassVar[bool] = True  # Fabric's convert_output: the fp32 logits, the bf16 ones freed
    adapts_tied_head: ClassVar[bool] = True  # litgpt's GPT has its own lm_head (lit_walked_spec)
    lora_with_selective: ClassVar[bool] = True
    # autograd's input buffer adds the base's input gradient into the adapter's in place (as memplan's LoRALinear): its
    # dropout's (or, without dropout, lora_A's) input gradient is the only reference to its storage; seen on the
    # checkpointed block's down backward (tests/walk/test_walk_libs_sharding.py)
    sums_input_gradient_in_place: ClassVar[bool] = True
    compiles: ClassVar[bool] = False
    # its scripts' optimizer: torch's AdamW, foreach or fused (no bitsandbytes states; memplan.emit writes these)
    optimizers: ClassVar[tuple[str, ...]] = ("adamw", "adamw-fused")
    step_words: ClassVar[str] = ", litgpt's step"

    def check_builds(self, spec, accepted: tuple[str, ...]) -> None:
        """litgpt's families are checked with the rest of its setup (``check_setup``)."""

    def check_walked(self, setup) -> None:
        lit_check_sharding(setup)

    def check_setup(self, spec, setup) -> None:
        """``lit_check_checkpointing``, then ``check_lib_setup``'s (the checkpointing litgpt's FSDP scripts run, full,
        is not one to choose: ``checkpointings`` lists the one-device scripts' own)."""
        lit_check_checkpointing(setup)
        check_lib_setup(self, spec, setup.replace(checkpointing="none") if setup.sharding == "fsdp" else setup)

    @property
    def ddp_gradient_as_bucket_view(self) -> bool:
        return lit_ddp_gradient_as_bucket_view()

    def block_saved_bytes(self, spec, setup) -> int:
        return lit_block_saved_bytes(spec, setup, self.lora_dropout, self.cpu)

    def lora_head_saved_bytes(self, spec, setup, frozen_input: bool = False) -> int:
        return lib_lora_head_saved_bytes(spec, setup, self.lora_dropout, self.cpu, frozen_input)

    def final_norm_saved_bytes(self, spec, setup) -> int:
        return lit_norm_saved_bytes(spec, setup)

    def held_logits_bytes(self, spec, setup) -> int:
        return lit_held_logits_bytes(spec, setup)

    def head_weight_casts_bytes(self, spec, setup) -> int:
        return lit_head_weight_casts_bytes(spec, setup)

    def logits_grad_chunks(self, spec, setup) -> int:
        return lit_head_chunks(setup)

    def chunked_loss_backward_bytes(self, spec, setup) -> int:
        return lit_chunked_loss_backward_bytes(spec, setup) + lit_finetune_full_shifted_loss_bytes(spec, setup)

    def buffer_bytes_delta(self, spec, setup) -> int:
        return lit_rope_cache_bytes(spec, setup)

    def first_block_saved_bytes(self, spec, setup) -> int:
        return lib_first_block_saved_bytes(spec, setup, self.lora_dropout, self.cpu, lit_lora_modules)

    def optimizer_scratch_bytes(self, spec, setup) -> int:
        return lit_optimizer_scratch_bytes(spec, setup, self.cpu)

    def walked_setup(self, setup):
        return lit_walked_setup(setup, self.cpu)

    def walked_spec(self, spec):
        return lit_walked_spec(spec)

    def lora_bytes_delta(self, spec, setup) -> int:
        return lit_lora_bytes_delta(spec, setup)

    def fsdp_hook(self, spec, setup, rank: int, collectives: str):
        """finetune_lora's FSDP2 with LoRA (``memory.stacks.litgpt_sharding.LitFullyShard``), else Fabric's
        FSDPStrategy, FSDP1's flat parameters (``memory.fsdp1.FlatShard``)."""
        if lit_fsdp_lora(setup):
            from memplan.memory.stacks.litgpt_sharding import LitFullyShard

            return LitFullyShard(spec, setup, rank, collectives, self)
        from memplan.memory.fsdp1 import FlatShard

        return FlatShard(spec, setup, rank, collectives, self)

    def recompute_reaches_down_adapter(self, setup) -> bool:
        return lit_recompute_reaches_down_adapter(setup)

    def recompute_stop_bytes(self, spec, setup) -> int:
        return lit_recompute_stop_bytes(spec, setup, self.lora_dropout)

    def recompute_gradient_bytes(self, spec, setup) -> int:
        return lit_recompute_gradient_bytes(spec, setup)

    def lora_tensors_delta(self, spec, setup) -> int:
        return lit_lora_tensors_delta(spec, setup)

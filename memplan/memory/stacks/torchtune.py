"""The ``torchtune`` stack: torchtune 0.6's single-device recipes (torchtune/modules/*, modules/peft/lora.py),
torch-free.

The step ``memplan trace --stack torchtune`` traces (``trainer/stacks/torchtune.py``). Each hook below is a
small pure function whose docstring names the tensor it adds (or removes) beyond memplan's own step and the
line of torchtune that makes it (several are litgpt's: ``memplan.memory.stacks.litgpt``);
``TorchtuneStack`` calls them at the walk's fixed points.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memplan.errors import InputError
from memplan.memory.stacks.base import FP32, Stack, _a, _n
from memplan.memory.stacks.litgpt import (check_lib_setup, lib_first_block_saved_bytes, lib_lora_head_saved_bytes,
                                          lib_lora_saved_bytes, lit_lora_bytes_delta, lit_norm_saved_bytes,
                                          qkv_enabled)
from memplan.memory.stacks.torchtune_fsdp import (tt_check_custom_sharded_layers, tt_custom_sharded_layers,
                                                  tt_fsdp_sharding)
from memplan.memory.terms import lora_adapter_shapes, rope_buffer_bytes


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
    return {"qkv": [(h, 1)] * qkv_enabled(setup), "proj": [(q, 1)], "up": [(h, 1)] * 2, "down": [(f, 1)],
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
    qkv = 2 * (qkv_enabled(setup) - len(lora_adapter_shapes(spec, setup, "qkv"))) if "qkv" in setup.lora else 0
    return spec.layers * (qkv + (2 if "up" in setup.lora else 0))


def tt_lora_saved_bytes(spec, setup, dropout: float, cpu: bool = False) -> int:
    """What torchtune's adapters save beyond memplan's, per block: ``lora_out =
    self.lora_a(self.dropout(x))``, ``self.lora_b(lora_out)`` (torchtune/modules/peft/lora.py,
    LoRALinear.forward) per module (``tt_lora_modules``): x·Aᵀ, n·r·a each (q, k, v: 3 for memplan's 1;
    w1, w3: 2 for 1); with ``lora_dropout`` > 0 each module's ``nn.Dropout`` output and mask, for
    memplan's one saved input (``lib_lora_saved_bytes``). Without dropout (the configs' 0.0,
    ``nn.Identity``) the modules share their input, as memplan's fused adapter saves it once."""
    return lib_lora_saved_bytes(spec, setup, dropout, cpu, tt_lora_modules)


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



def tt_check_sharding(setup) -> None:
    """The one-line InputError for ``--sharding ddp``: torchtune's distributed recipes (full_finetune_distributed,
    lora_finetune_distributed) have no DDP; they shard with FSDP2 (``tt_fsdp_root_reshards_after_forward``)."""
    if setup.sharding == "ddp":
        raise InputError("--stack torchtune: --sharding ddp: torchtune's distributed recipes have no DDP, they "
                         "shard with FSDP2 (accepted: none, fsdp)")


def tt_fsdp_root_reshards_after_forward() -> bool:
    """torchtune's FSDP2 layout, walked by memplan's FSDP2 hook (``memory.sharding.FullyShard``) but for its root.

    The recipes call ``training.shard_model(model, shard_conditions=[get_shard_conditions], cpu_offload=False,
    reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True))`` (torchtune/training/_distributed.py):
    ``fully_shard(m, reshard_after_forward=True)`` on every ``layers.i`` (a ``TransformerSelfAttentionLayer``, or
    its checkpoint wrapper), under LoRA the frozen base and the adapters alike (``set_trainable_params`` first),
    then on the root (embedding, final norm, untied head), no ``MixedPrecisionPolicy`` (the recipe's one dtype;
    ``custom_sharded_layers`` unset, as the small models' configs leave it), as memplan's own layout. But the
    root is given ``reshard_after_forward=True`` explicitly, where memplan's trainer leaves fully_shard's
    default (None), under which FSDP2 keeps the root unsharded from forward to backward
    (``FSDPState._lazy_init``: only ``_auto_reshard_after_forward`` clears the root's ``post_forward_mesh_info``):
    torchtune's root frees its unsharded parameters, W·pad(root)·p, when its forward ends, and its pre-backward
    all-gathers them again."""
    return True


@dataclass(frozen=True)
class TorchtuneStack(Stack):
    """torchtune's ``TransformerDecoder`` and its recipes' step: the hooks above at the walk's fixed points."""

    name: ClassVar[str] = "torchtune"
    library: ClassVar[str | None] = "torchtune"
    walks_sdpa_gqa_repeat: ClassVar[bool] = False
    has_lora_dropout: ClassVar[bool] = True
    # what torchtune's single-device recipes take
    archs: ClassVar[tuple[str, ...]] = ("llama",)
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "tf32", "bf16")  # one dtype, no autocast
    attentions: ClassVar[tuple[str, ...]] = ("sdpa",)
    checkpointings: ClassVar[tuple[str, ...]] = ("none", "full")
    shardings: ClassVar[tuple[str, ...]] = ("none", "fsdp")  # FSDP2 through training.shard_model
    fsdp_root_reshards_after_forward: ClassVar[bool] = tt_fsdp_root_reshards_after_forward()
    lora_with_selective: ClassVar[bool] = True
    sums_input_gradient_in_place: ClassVar[bool] = False
    compiles: ClassVar[bool] = False
    # its single-device full-finetune configs take bitsandbytes' 8-bit AdamW (optimizer._component_: PagedAdamW8bit)
    searched_optimizers: ClassVar[tuple[str, ...]] = ("adamw-fused", "adamw", "adamw8bit")
    step_words: ClassVar[str] = ", torchtune's step"

    # the distributed recipes' ``custom_sharded_layers`` (``--custom-sharded-layers``: auto, the published configs'
    # choice for the model, ``memory.stacks.torchtune_fsdp.tt_custom_sharded_layers``)
    custom_sharded_layers: str = "auto"
    fsdp_reshard_after_forward: bool = True  # the recipes' default (``--no-fsdp-reshard-after-forward``: False)

    def fsdp_hook(self, spec, setup, rank: int, collectives: str):
        return tt_fsdp_sharding(spec, setup, rank, collectives, self)

    def fsdp_words(self, spec, setup) -> str:
        """The layout walked under FSDP: custom_sharded_layers (what auto chose) and fsdp_reshard_after_forward."""
        if setup.sharding != "fsdp":
            return ""
        layers = tt_custom_sharded_layers(spec, setup, self.custom_sharded_layers)
        return (f", custom_sharded_layers {','.join(layers) if layers else 'unset'}"
                + ("" if self.fsdp_reshard_after_forward else ", fsdp_reshard_after_forward false"))

    def check_builds(self, spec, accepted: tuple[str, ...]) -> None:
        """torchtune's families are checked with the rest of its setup (``check_setup``)."""

    def check_walked(self, setup) -> None:
        tt_check_sharding(setup)

    def check_setup(self, spec, setup) -> None:
        """``check_lib_setup``'s, and torchtune's ``lora_llama3`` needs an attention module among
        ``lora_attn_modules``."""
        check_lib_setup(self, spec, setup)
        tt_check_custom_sharded_layers(spec, self.custom_sharded_layers)
        if setup.lora_rank and not {"qkv", "proj"} & set(setup.lora):
            raise InputError(f"--lora-targets {setup.lora_targets}: torchtune's lora_llama3 needs an attention "
                             "module among lora_attn_modules (accepted: at least one of qkv, q, k, v, proj)")

    def block_saved_bytes(self, spec, setup) -> int:
        return tt_block_saved_bytes(spec, setup, self.lora_dropout, self.cpu)

    def lora_head_saved_bytes(self, spec, setup, frozen_input: bool = False) -> int:
        return lib_lora_head_saved_bytes(spec, setup, self.lora_dropout, self.cpu, frozen_input)

    def final_norm_saved_bytes(self, spec, setup) -> int:
        return tt_norm_saved_bytes(spec, setup)

    def chunked_loss_backward_bytes(self, spec, setup) -> int:
        return tt_chunked_loss_backward_bytes(spec, setup)

    def chunked_upcast_bytes(self, spec, setup) -> int:
        return tt_chunked_upcast_bytes(spec, setup)

    def buffer_bytes_delta(self, spec, setup) -> int:
        return tt_rope_cache_bytes(spec, setup)

    def first_block_saved_bytes(self, spec, setup) -> int:
        return lib_first_block_saved_bytes(spec, setup, self.lora_dropout, self.cpu, tt_lora_modules)

    def chunked_head_grad_bytes(self, spec, setup) -> int:
        return tt_chunked_head_grad_bytes(spec, setup)

    def walked_setup(self, setup):
        return tt_walked_setup(setup)

    def lora_bytes_delta(self, spec, setup) -> int:
        return tt_lora_bytes_delta(spec, setup)

    def lora_tensors_delta(self, spec, setup) -> int:
        return tt_lora_tensors_delta(spec, setup)

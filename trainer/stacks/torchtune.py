"""The torchtune stack: torchtune's Llama builders and the step of its single-device recipes.

- the model: the component builder ``torchtune.models.llama3.llama3`` (an untied head) or
  ``torchtune.models.llama3_2.llama3_2`` (``tie_word_embeddings=True``, a tied shape), with
  vocab_size, num_layers, num_heads, num_kv_heads, embed_dim, max_seq_len, intermediate_dim,
  norm_eps and rope_base from memplan's shape, built as the recipes build it: ``with
  training.set_default_dtype(dtype), device:``. torchtune trains in one dtype (the recipes'
  ``dtype: bf16 | fp32``, no autocast), so bf16 and fp32 (tf32: fp32 with TF32 matmuls) are
  taken and the mixed precisions refused. Its attention is ``F.scaled_dot_product_attention``
  with ``is_causal``, K and V expanded to every query head when the heads are grouped;
- LoRA: ``lora_llama3`` / ``lora_llama3_2`` with ``lora_attn_modules`` (q_proj, k_proj, v_proj,
  output_proj from memplan's qkv and proj), ``apply_lora_to_mlp`` (up and down together),
  ``lora_rank``, ``lora_alpha = 2 * rank`` (the configs' "usually alpha=2*rank") and
  ``lora_dropout`` (the configs' default 0.0), then ``set_trainable_params(model,
  get_adapter_params(model))`` as ``lora_finetune_single_device`` does;
- checkpointing ``full``: ``training.set_activation_checkpointing(model,
  auto_wrap_policy={modules.TransformerSelfAttentionLayer})``, the recipes'
  ``enable_activation_checkpointing: True``;
- the loss: ``CEWithChunkedOutputLoss`` (8 chunks, each upcast to fp32) with
  ``model.set_num_output_chunks(loss_fn.num_output_chunks)``; ``_loss_step`` shifts the labels
  by appending ``ignore_labels_cache`` (not by slicing the logits) and frees the logits before
  the backward;
- the loop: each micro-batch's loss times its token count (``current_num_tokens``) is added to
  ``running_loss`` and backpropagated; at the step ``training.scale_grads(model, 1 / num_tokens)``,
  no clipping (``clip_grad_norm: null``), ``torch.optim.AdamW(model.parameters(), fused=True)``
  as the recipes' configs set it, ``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

import contextlib

import torch

from memplan.errors import InputError
from memplan.memory.stacks.torchtune import TorchtuneStack
from memplan.setup import TrainSetup
from trainer.stacks import EXTRAS, StackModel, converting_fake_parameters, require

STACK = "torchtune"
LIBRARY = "torchtune"
EXTRA = EXTRAS[STACK]
PRECISIONS = TorchtuneStack.precisions  # the planner twin's: fp32, tf32, bf16
LORA_DEFAULT_DROPOUT = TorchtuneStack.lora_default_dropout  # the recipes' configs: lora_dropout: 0.0
IGNORE_INDEX = -100  # CEWithChunkedOutputLoss's ignore_index


@contextlib.contextmanager
def quiet_import():
    """torchao (which torchtune imports) logs a warning on import when its C++ kernels were built
    for another torch; it then runs its Python paths, which are all the trace takes."""
    import logging

    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def check(model: StackModel, setup: TrainSetup) -> None:
    spec = model.spec
    if spec is None or spec.arch != "llama" or spec.norm != "rmsnorm" or spec.mlp != "swiglu" or spec.pos != "rope" \
            or spec.bias or spec.qkv_bias or spec.parallel_residual or spec.rotary_pct != 1.0:
        family = "a config.json" if spec is None else f"--arch {spec.arch}"
        raise InputError(f"--stack torchtune: {family} is not taken; torchtune's Llama builders take llama shapes "
                         "(accepted: --arch llama, a llama preset or size)")
    if setup.precision not in PRECISIONS:
        raise InputError(f"--stack torchtune: --precision {setup.precision}: torchtune's recipes train in one dtype "
                         f"(dtype: bf16 | fp32, no autocast); accepted: {', '.join(PRECISIONS)}")
    if setup.attention != "sdpa":
        raise InputError("--stack torchtune: torchtune's attention is torch's scaled_dot_product_attention "
                         "(accepted: --attention sdpa)")
    if setup.checkpointing == "selective":
        raise InputError("--stack torchtune: checkpointing 'selective' is memplan's own; torchtune's recipes "
                         "checkpoint whole layers (accepted: none, full)")
    if setup.optimizer not in ("adamw", "adamw-fused"):
        raise InputError(f"--stack torchtune: --optimizer {setup.optimizer}: the recipes' configs train with "
                         "torch.optim.AdamW (accepted: adamw, adamw-fused)")


def lora_modules(targets: str) -> tuple[list[str], bool, bool]:
    """``lora_attn_modules``, ``apply_lora_to_mlp`` and ``apply_lora_to_output`` for memplan's ``--lora-targets``
    (q, k, v alone: q_proj, k_proj, v_proj each its own module)."""
    chosen = set(targets.split(","))
    if ("up" in chosen) != ("down" in chosen):
        raise InputError(f"--lora-targets {targets}: torchtune's apply_lora_to_mlp adapts every MLP matrix; give "
                         "both up and down or neither (accepted: qkv, q, k, v, proj, up+down, head)")
    qkv = "qkv" in chosen
    attn = [f"{p}_proj" for p in ("q", "k", "v") if qkv or p in chosen] + (["output_proj"] if "proj" in chosen else [])
    if not attn:  # lora_llama3 raises its own ValueError: the one line instead
        raise InputError(f"--lora-targets {targets}: torchtune's lora_llama3 needs an attention module among "
                         "lora_attn_modules (accepted: at least one of qkv, q, k, v, proj)")
    return attn, "up" in chosen, "head" in chosen


def build_model(model: StackModel, setup: TrainSetup, lora_dropout: float | None = None) -> torch.nn.Module:
    """torchtune's model for ``model`` as its single-device recipes set it up."""
    with quiet_import():
        require("torchtune", STACK, EXTRA)
    check(model, setup)
    from torchtune import modules, training
    from torchtune.models.llama3 import llama3, lora_llama3
    from torchtune.models.llama3_2 import llama3_2, lora_llama3_2
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    spec = model.spec
    shape = dict(vocab_size=spec.vocab, num_layers=spec.layers, num_heads=spec.heads, num_kv_heads=spec.kv_heads,
                 embed_dim=spec.hidden, max_seq_len=max(setup.ctx, spec.max_positions), intermediate_dim=spec.ffn,
                 norm_eps=spec.norm_eps, rope_base=int(spec.rope_theta))
    dtype = torch.bfloat16 if setup.precision == "bf16" else torch.float32
    with converting_fake_parameters(), training.set_default_dtype(dtype):
        if setup.lora_rank:
            attn, mlp, head = lora_modules(setup.lora_targets)
            if head and spec.tied:  # lora_llama3_2 raises its own ValueError: the one line instead
                raise InputError(f"--stack torchtune: --lora-targets {setup.lora_targets}: torchtune does not adapt "
                                 "a head tied to the embeddings (apply_lora_to_output); accepted for a tied model: "
                                 "qkv, q, k, v, proj, up+down")
            lora = dict(lora_attn_modules=attn, apply_lora_to_mlp=mlp, apply_lora_to_output=head, lora_rank=setup.lora_rank,
                        lora_alpha=2.0 * setup.lora_rank,
                        lora_dropout=LORA_DEFAULT_DROPOUT if lora_dropout is None else lora_dropout)
            net = lora_llama3_2(**shape, **lora, tie_word_embeddings=True) if spec.tied else lora_llama3(**shape,
                                                                                                          **lora)
            set_trainable_params(net, get_adapter_params(net))
        else:
            net = llama3_2(**shape, tie_word_embeddings=True) if spec.tied else llama3(**shape)
    if setup.checkpointing == "full":
        training.set_activation_checkpointing(net, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    net._memplan_loss = CEWithChunkedOutputLoss()
    net.set_num_output_chunks(net._memplan_loss.num_output_chunks)
    net.train()
    return net


def make_optimizer(net: torch.nn.Module, setup: TrainSetup) -> torch.optim.Optimizer:
    """The configs' ``optimizer: {_component_: torch.optim.AdamW, fused: True}`` over
    ``model.parameters()`` (frozen ones get no state)."""
    return torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.01, fused=True)


def _loss_step(model, tokens, labels, ignore_labels_cache):
    """The recipes' ``_loss_step``."""
    logits = model(tokens=tokens)
    labels = torch.hstack((labels[..., 1:], ignore_labels_cache[: labels.shape[0]]))
    if not isinstance(logits, list):
        labels = labels.reshape(-1)
        logits = logits.reshape(-1, logits.size(-1))
    loss = model._memplan_loss(logits, labels)
    del logits  # "free logits otherwise it peaks backward memory"
    return loss


def train_step(model, optimizer, micro_batches, setup: TrainSetup, device_type: str, before_forward=None,
               after_forward=None) -> None:
    """One optimizer step of the recipes' ``train`` loop; ``micro_batches`` are (tokens, labels) pairs."""
    from torchtune import training

    cache = getattr(model, "_memplan_ignore_labels", None)
    if cache is None:  # the recipe's ignore_labels_cache, made once
        cache = torch.full((setup.micro_batch, 1), IGNORE_INDEX, device=next(model.parameters()).device)
        model._memplan_ignore_labels = cache
    running_loss, num_tokens = 0, 0
    for i, (tokens, labels) in enumerate(micro_batches):
        if before_forward is not None:
            before_forward(i)
        current_num_tokens = (labels != IGNORE_INDEX).sum()
        num_tokens += current_num_tokens
        current_loss = _loss_step(model, tokens, labels, cache) * current_num_tokens
        running_loss += current_loss
        if after_forward is not None:
            after_forward(i)
        current_loss.backward()
    world = _world_size()
    if world > 1:  # the distributed recipes: the tokens and loss of every rank, FSDP2's mean over ranks undone
        import torch.distributed as dist

        dist.all_reduce(num_tokens)
        dist.all_reduce(running_loss)
    training.scale_grads(model, world / num_tokens)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _world_size() -> int:
    """The ranks of the process group the step runs in (1 outside one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def wrap_ranks(net: torch.nn.Module, setup: TrainSetup, custom_sharded_layers: list[str] | None = None,
               reshard_after_forward: bool = True, mesh=None) -> torch.nn.Module:
    """The model as torchtune's distributed recipes (full_finetune_distributed, lora_finetune_distributed) shard it:
    ``training.shard_model(model, shard_conditions=[partial(training.get_shard_conditions,
    names_to_match=custom_sharded_layers)], cpu_offload=False, reshard_after_forward=reshard_after_forward)``
    with the configs' keys ``custom_sharded_layers`` (None: unset; ``['tok_embeddings', 'output']``: the 8B and
    70B full-finetune configs', each of those modules an FSDP2 group of its own) and
    ``fsdp_reshard_after_forward`` (default True), ``fsdp_cpu_offload: False``: ``fully_shard`` of every
    ``layers.i`` (its checkpoint wrapper under activation checkpointing) and of each named module, then of the
    root, no ``MixedPrecisionPolicy`` (the recipe's one dtype). torchtune has no DDP. ``mesh``: ``shard_model``'s
    ``dp_mesh`` (None: ``fully_shard``'s default, one dimension over the process group's ranks; a trace makes
    ``rank_mesh``'s outside fake mode)."""
    import functools

    from torchtune import training

    if setup.sharding != "fsdp":
        raise InputError(f"--stack torchtune: --sharding {setup.sharding}: torchtune's distributed recipes shard "
                         "with FSDP2 (accepted: fsdp)")
    with quiet_import():
        training.shard_model(net, [functools.partial(training.get_shard_conditions,
                                                     names_to_match=custom_sharded_layers)],
                             cpu_offload=False, reshard_after_forward=reshard_after_forward, dp_mesh=mesh)
    return net


def rank_mesh(device: str):
    """The mesh ``fully_shard`` makes by default (``_init_default_mesh``): one dimension over the process group's
    ranks on ``device``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (dist.get_world_size(),))


def rank_wrap_options(spec, setup: TrainSetup, choice: str = "auto") -> dict:
    """``wrap_ranks``' keywords for the walk's ``--custom-sharded-layers`` ``choice`` (auto: the published configs'
    choice for the model, ``tt_custom_sharded_layers``): ``custom_sharded_layers`` as the recipe's config names it."""
    from memplan.memory.stacks.torchtune_fsdp import tt_custom_sharded_layers

    return {"custom_sharded_layers": list(tt_custom_sharded_layers(spec, setup, choice)) or None}


@contextlib.contextmanager
def as_on_real_tensors():
    """Within a trace, torchtune's Llama 3.2 RoPE builds its cache as it does on real tensors.

    ``Llama3ScaledRoPE.apply_scaling`` (``torchtune/models/llama3_1/_position_embeddings.py``)
    reads each frequency's value in Python to pick its scale, which a fake tensor does not have
    (``DataDependentOutputException``). What it returns is ``torch.tensor(new_freqs)``: a new
    tensor of the frequencies' shape, dtype and device. On a fake tensor it returns that tensor
    here (the values bear on no size); on a real one it runs as written."""
    import warnings

    from torch._subclasses.fake_tensor import is_fake
    from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE

    original = Llama3ScaledRoPE.apply_scaling

    def apply_scaling(self, freqs, *args, **kwargs):
        if is_fake(freqs):
            return torch.empty(freqs.shape, dtype=freqs.dtype, device=freqs.device)
        return original(self, freqs, *args, **kwargs)

    Llama3ScaledRoPE.apply_scaling = apply_scaling
    try:
        with warnings.catch_warnings():  # torchtune's RMSNorm upcasts its input (x.float()) but not its weight
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            yield
    finally:
        Llama3ScaledRoPE.apply_scaling = original

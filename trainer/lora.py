"""LoRA (Hu et al. 2021) for the reference model: low-rank adapters on its linear layers, base weights frozen.

``apply_lora(model, rank, alpha, targets)`` replaces each targeted ``nn.Linear`` of every block
(``qkv``, ``proj``, ``up``, ``down``: the names in ``trainer/model.py``), and with ``head`` the LM
head, with a ``LoRALinear`` and freezes every other parameter (embeddings, norms, the base
matrices). ``q``, ``k``, ``v`` alone put an adapter on their slice of the fused qkv matrix: its own
A (rank × H) and a B as tall as the slice (heads·head_dim for q, kv_heads·head_dim for k and v),
whose output is added to those columns of the fused output only (``_AddToSlice``). Only the
adapters train: they alone get gradients and optimizer state, which is what memplan's LoRA terms
(``memplan.memory.lora_*``) count.

``LoRALinear.forward``: y = x·Wᵀ (+ b), then y += (x·Aᵀ)·Bᵀ · alpha/rank, in place on the base
output (which nothing saves), so the adapter adds one (n × rank) tensor saved for backward and
one (n × out) temporary. A is initialised like ``nn.Linear`` (Kaiming uniform), B with zeros, so
a freshly adapted model computes exactly what the base model does. No dropout on the adapter
input (it would save an n × in mask per adapter).

``merge_lora`` folds the adapters into the base weights (W += alpha/rank · B·A) and puts plain
``nn.Linear`` modules back: the result is the base architecture, for generate, eval and export.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from memplan.errors import InputError
from memplan.setup import LORA_TARGET_NAMES, LORA_TARGETS, QKV_PARTS, canonical_lora_targets

DEFAULT_ALPHA = 16.0


class _AddToSlice(torch.autograd.Function):
    """``y[..., start:start + width] += delta · scale`` in place, as ``y.add_(delta, alpha=scale)`` on the
    whole output is for a full adapter: backward passes y's gradient on as it is and gives delta
    that gradient's slice times scale (one n × width tensor, as add_'s ``grad · alpha`` is n × out)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, delta: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        ctx.start, ctx.width, ctx.scale = start, delta.shape[-1], scale
        y.narrow(-1, start, delta.shape[-1]).add_(delta, alpha=scale)
        ctx.mark_dirty(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.narrow(-1, ctx.start, ctx.width) * ctx.scale, None, None


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update B·A scaled by alpha / rank: over its whole
    output (``lora_a``, ``lora_b``), or with ``parts`` ({name: (first output column, width)}) one
    adapter per part (``lora_a_<name>``, ``lora_b_<name>``), each adding to its columns only."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, parts: dict[str, tuple[int, int]] | None = None):
        super().__init__()
        self.base = base
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        base.weight.requires_grad_(False)
        if base.bias is not None:
            base.bias.requires_grad_(False)
        self.parts = dict(parts) if parts else None
        for suffix, width in ([(f"_{name}", width) for name, (_, width) in parts.items()] if parts
                              else [("", base.out_features)]):
            w = base.weight
            a = nn.Parameter(torch.empty(rank, base.in_features, dtype=w.dtype, device=w.device))
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            setattr(self, f"lora_a{suffix}", a)
            setattr(self, f"lora_b{suffix}", nn.Parameter(torch.zeros(width, rank, dtype=w.dtype, device=w.device)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.parts is None:
            return y.add_(F.linear(F.linear(x, self.lora_a), self.lora_b), alpha=self.scale)
        for name, (start, _) in self.parts.items():
            delta = F.linear(F.linear(x, getattr(self, f"lora_a_{name}")), getattr(self, f"lora_b_{name}"))
            y = _AddToSlice.apply(y, delta, start, self.scale)
        return y

    def merged_weight(self) -> torch.Tensor:
        w = self.base.weight
        if self.parts is None:
            return w + self.scale * (self.lora_b @ self.lora_a).to(w.dtype)
        merged = w.clone()
        for name, (start, width) in self.parts.items():
            update = getattr(self, f"lora_b_{name}") @ getattr(self, f"lora_a_{name}")
            merged[start:start + width] += self.scale * update.to(w.dtype)
        return merged


def parse_targets(text: str) -> tuple[str, ...]:
    """``qkv,proj,up,down`` (any subset, comma-separated; q, k, v alone, qkv standing for all three; head)
    or ``all`` (the four block matrices)."""
    if text.strip() == "all":
        return LORA_TARGETS
    names = tuple(t.strip() for t in text.split(",") if t.strip())

    bad = [t for t in names if t not in LORA_TARGET_NAMES]
    if bad or not names:
        raise InputError(f"--lora-targets: unknown {', '.join(bad) or repr(text)} (accepted: all, or a comma-separated "
                         f"subset of {', '.join(LORA_TARGET_NAMES)})")
    return tuple(canonical_lora_targets(",".join(names)).split(","))


def _targets_of(block) -> dict[str, tuple[nn.Module, str]]:
    return {"qkv": (block.attn, "qkv"), "proj": (block.attn, "proj"), "up": (block.mlp, "up"),
            "down": (block.mlp, "down")}


def _qkv_parts(block, names: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """The fused qkv output's columns of each of q, k, v in ``names`` (``trainer/model.py``: q, k, v in that
    order, heads·head_dim, then kv_heads·head_dim twice)."""
    attn = block.attn
    q, kv = attn.heads * attn.head_dim, attn.kv_heads * attn.head_dim
    spans = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
    return {p: spans[p] for p in QKV_PARTS if p in names}


def _blocks(model):
    return [getattr(b, "block", b) for b in model.blocks]  # a Checkpointed wrapper's block


def apply_lora(model: nn.Module, rank: int, alpha: float = DEFAULT_ALPHA,
               targets: tuple[str, ...] = LORA_TARGETS) -> nn.Module:
    """Freeze every parameter, then put a rank-``rank`` adapter on each targeted linear of every block."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InputError(f"--lora-rank: {rank!r} must be a positive integer")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise InputError(f"--lora-alpha: {alpha!r} must be a positive number")
    targets = parse_targets(",".join(targets))
    if "head" in targets and model.head.weight is model.embed.weight:
        raise InputError("--lora-targets head: this model ties its LM head to the token embedding, and the adapter "
                         "could not be folded into the one shared matrix; accepted for a tied model: "
                         f"{', '.join(t for t in LORA_TARGET_NAMES if t != 'head')}")
    for p in model.parameters():
        p.requires_grad_(False)
    sites = [(block, name) for block in _blocks(model) for name in targets if name not in (*QKV_PARTS, "head")]
    sites += [(block, "qkv") for block in _blocks(model) if set(QKV_PARTS) & set(targets)]
    for block, name in sites:
        parent, attr = _targets_of(block)[name]
        parts = _qkv_parts(block, targets) if name == "qkv" and "qkv" not in targets else None
        _adapt(parent, attr, name, rank, alpha, parts)
    if "head" in targets:
        _adapt(model, "head", "head", rank, alpha, None)
    return model


def _adapt(parent: nn.Module, attr: str, name: str, rank: int, alpha: float, parts) -> None:
    """``parent.attr`` (an ``nn.Linear``) replaced by its ``LoRALinear``."""
    base = getattr(parent, attr)
    if isinstance(base, LoRALinear):
        raise InputError("the model already has LoRA adapters")
    widths = [w for _, w in parts.values()] if parts else [base.out_features]
    side = min(base.in_features, *widths)
    if rank > side:
        raise InputError(f"--lora-rank {rank} exceeds the {'/'.join(parts) if parts else name} matrix's smaller side "
                         f"({side}); accepted: 1 to that")
    setattr(parent, attr, LoRALinear(base, rank, alpha, parts))


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors only, by their names in the model."""
    return {name: p.detach() for name, p in model.named_parameters() if ".lora_" in name}


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's tensors, under their names without adapters (``attn.qkv.base.weight`` → ``attn.qkv.weight``)."""
    return {name.replace(".base.", "."): t for name, t in model.state_dict().items() if ".lora_" not in name}


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and restore plain ``nn.Linear`` modules (in place)."""
    sites = [site for block in _blocks(model) for site in _targets_of(block).values()] + [(model, "head")]
    for parent, attr in sites:
        m = getattr(parent, attr, None)
        if isinstance(m, LoRALinear):
            m.base.weight.copy_(m.merged_weight())
            setattr(parent, attr, m.base)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def lora_for(model: nn.Module, setup) -> nn.Module:
    """``model`` with the adapters a TrainSetup asks for (``lora_rank`` > 0), else as it is."""
    if not getattr(setup, "lora_rank", 0):
        return model
    return apply_lora(model, setup.lora_rank, DEFAULT_ALPHA, lora_targets(setup))


def lora_targets(setup) -> tuple[str, ...]:
    """The adapters a TrainSetup asks for, by their ``--lora-targets`` names (q, k, v alone; head)."""
    return tuple(setup.lora_targets.split(",")) if setup.lora_rank else ()


class _NoHandle:
    def remove(self) -> None:
        pass


class frozen_params_tracked:
    """MemTracker registers a gradient hook on every parameter of the modules it sees, which torch
    refuses for a parameter without gradients (LoRA's frozen base), and its post-accumulate hook for one that is not
    a leaf (FSDP1 with ``use_orig_params=True`` sets a module's parameters, in its forward, as views of the
    unsharded flat parameter).
    Within this context such a registration is a no-op: a frozen parameter never gets a gradient to report, and
    a view's gradient goes to its flat parameter, whose ``.grad`` MemTracker sees allocated as any tensor."""

    _NAMES = ("register_hook", "register_post_accumulate_grad_hook")

    def __enter__(self):
        self._originals = {name: getattr(torch.Tensor, name) for name in self._NAMES}
        post_accumulate = self._originals["register_post_accumulate_grad_hook"]  # (a leaf's only; FSDP1's own
        # ``register_hook`` on its modules' outputs, not leaves, must be kept)
        for name, original in self._originals.items():
            def register(tensor, hook, _original=original):
                if not tensor.requires_grad or (_original is post_accumulate and not tensor.is_leaf):
                    return _NoHandle()
                return _original(tensor, hook)

            setattr(torch.Tensor, name, register)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        return False

"""LoRA (Hu et al. 2021) for the reference model: low-rank adapters on its linear layers, base weights frozen.

``apply_lora(model, rank, alpha, targets)`` replaces each targeted ``nn.Linear`` of every block
(``qkv``, ``proj``, ``up``, ``down``: the names in ``trainer/model.py``) with a ``LoRALinear``
and freezes every other parameter (embeddings, norms, the LM head, the base matrices). Only the
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
from memplan.setup import LORA_TARGETS

DEFAULT_ALPHA = 16.0


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update B·A scaled by alpha / rank."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        base.weight.requires_grad_(False)
        if base.bias is not None:
            base.bias.requires_grad_(False)
        w = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return y.add_(F.linear(F.linear(x, self.lora_a), self.lora_b), alpha=self.scale)

    def merged_weight(self) -> torch.Tensor:
        return self.base.weight + self.scale * (self.lora_b @ self.lora_a).to(self.base.weight.dtype)


def parse_targets(text: str) -> tuple[str, ...]:
    """``qkv,proj,up,down`` (any subset, comma-separated) or ``all``."""
    if text.strip() == "all":
        return LORA_TARGETS
    names = tuple(t.strip() for t in text.split(",") if t.strip())

    bad = [t for t in names if t not in LORA_TARGETS]
    if bad or not names:
        raise InputError(f"--lora-targets: unknown {', '.join(bad) or repr(text)} (accepted: all, or a comma-separated "
                         f"subset of {', '.join(LORA_TARGETS)})")
    return tuple(t for t in LORA_TARGETS if t in names)


def _targets_of(block) -> dict[str, tuple[nn.Module, str]]:
    return {"qkv": (block.attn, "qkv"), "proj": (block.attn, "proj"), "up": (block.mlp, "up"),
            "down": (block.mlp, "down")}


def _blocks(model):
    return [getattr(b, "block", b) for b in model.blocks]  # a Checkpointed wrapper's block


def apply_lora(model: nn.Module, rank: int, alpha: float = DEFAULT_ALPHA,
               targets: tuple[str, ...] = LORA_TARGETS) -> nn.Module:
    """Freeze every parameter, then put a rank-``rank`` adapter on each targeted linear of every block."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InputError(f"--lora-rank: {rank!r} must be a positive integer")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise InputError(f"--lora-alpha: {alpha!r} must be a positive number")
    for p in model.parameters():
        p.requires_grad_(False)
    for block in _blocks(model):
        for name in targets:
            parent, attr = _targets_of(block)[name]
            base = getattr(parent, attr)
            if isinstance(base, LoRALinear):
                raise InputError("the model already has LoRA adapters")
            if rank > min(base.in_features, base.out_features):
                raise InputError(f"--lora-rank {rank} exceeds the {name} matrix's smaller side "
                                 f"({min(base.in_features, base.out_features)}); accepted: 1 to that")
            setattr(parent, attr, LoRALinear(base, rank, alpha))
    return model


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
    for block in _blocks(model):
        for name, (parent, attr) in _targets_of(block).items():
            m = getattr(parent, attr)
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
    return apply_lora(model, setup.lora_rank, DEFAULT_ALPHA, setup.lora)


class _NoHandle:
    def remove(self) -> None:
        pass


class frozen_params_tracked:
    """MemTracker registers a gradient hook on every parameter of the modules it sees, which torch
    refuses for a parameter without gradients (LoRA's frozen base). Within this context such a
    registration is a no-op: a frozen parameter never gets a gradient to report."""

    _NAMES = ("register_hook", "register_post_accumulate_grad_hook")

    def __enter__(self):
        self._originals = {name: getattr(torch.Tensor, name) for name in self._NAMES}
        for name, original in self._originals.items():
            def register(tensor, hook, _original=original):
                if not tensor.requires_grad:
                    return _NoHandle()
                return _original(tensor, hook)

            setattr(torch.Tensor, name, register)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        return False

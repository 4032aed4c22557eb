"""What wraps the model in a distributed run: DDP or FSDP2, and DDP's ``no_sync``.

A leaf beside ``trainer/distributed.py`` (which wraps the model): ``trainer/step.py`` asks these
questions of every step, and importing them from here keeps the step below the distributed layer
(distributed builds models and runs steps; a step only needs to know what it was given).
"""

from __future__ import annotations

import contextlib

import torch


def is_ddp(model: torch.nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def is_fsdp(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The reference model inside a DDP wrapper (FSDP2 keeps the module itself)."""
    return model.module if is_ddp(model) else model


def no_sync(model: torch.nn.Module, last: bool):
    """DDP's ``no_sync`` for every micro-batch but the last of a step (a no-op otherwise)."""
    if not last and is_ddp(model):
        return model.no_sync()
    return contextlib.nullcontext()

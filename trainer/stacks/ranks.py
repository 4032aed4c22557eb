"""Another stack's step on several ranks, for real: W gloo processes on the CPU, each running the library's
model and step wrapped as the library's own distributed code wraps it (its module's ``wrap_ranks``: litgpt,
Fabric's ``DDPStrategy`` or its scripts' FSDP1 ``FSDPStrategy``; torchtune, its recipes' ``training.shard_model``,
FSDP2), under MemTracker.

DDP's C++ reducer builds its buckets from real storage, so a DDP step cannot be traced on fake tensors; and
torchtune's step is its own. These real ranks are what ``memplan estimate --stack litgpt --sharding ddp|fsdp`` and
``--stack torchtune --sharding fsdp`` are held to (the walk with ``collectives="gloo"``), as
``trainer.distributed.measure_ranks`` (which runs them) holds memplan's own.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from memplan.errors import InputError
from trainer.stacks import StackModel, _built, _stack_module, _vocab, check_stack


def _rank_memory(stack: str, model: StackModel, setup, lora_dropout: float | None, seed: int,
                 wrap_options: dict | None = None):
    """This rank's StepMemory: the stack's model built with the same weights in every rank, wrapped, two steps
    of its step under MemTracker (``trainer.measure._tracked_steps``) on this rank's own token ids."""
    from trainer.measure import StepMemory, _random_ids, _tracked_steps
    from trainer.step import set_matmul_precision

    module = _stack_module(stack)
    wrap = getattr(module, "wrap_ranks", None)
    if wrap is None:
        raise InputError(f"--stack {stack}: its step on several ranks is not run here")
    if wrap_options is None and hasattr(module, "rank_wrap_options"):  # the walk's default layout (torchtune: auto)
        wrap_options = module.rank_wrap_options(model.spec, setup)
    if wrap_options:  # the library's own distributed settings (torchtune's custom_sharded_layers, ...)
        wrap = functools.partial(wrap, **wrap_options)
    torch.manual_seed(seed)
    set_matmul_precision(setup.precision)
    net, optimizer, step = _built(stack, model, setup, lora_dropout, wrap)
    gen = torch.Generator().manual_seed(seed + 1 + dist.get_rank())
    total, categories, _ = _tracked_steps(net, optimizer, setup, lambda: _random_ids(_vocab(model), setup, "cpu", gen),
                                          "cpu", step_fn=step)
    return StepMemory(peak_allocated=total, breakdown=categories, params=sum(p.numel() for p in net.parameters()),
                      method=f"{stack}'s model and step wrapped for {setup.sharding}, MemTracker on real tensors, "
                             f"gloo (rank {dist.get_rank()})")


def measure_stack_ranks(stack: str, model: StackModel, setup, lora_dropout: float | None = None, seed: int = 0,
                        wrap_options: dict | None = None):
    """Every rank's StepMemory of ``stack``'s step under ``setup.sharding`` over ``setup.world_size`` gloo
    processes started here (spawned; the peak is MemTracker's in each rank): ``trainer.distributed.measure_ranks``
    with this stack's measure (``_rank_memory``); ``wrap_options``: keywords of the stack's ``wrap_ranks``."""
    from trainer.distributed import measure_ranks

    check_stack(stack)
    if setup.world_size < 2 or setup.sharding == "none":
        raise InputError("measure_stack_ranks runs several ranks: give a world size above 1 and a sharding")
    measure = functools.partial(_rank_memory, stack, lora_dropout=lora_dropout, seed=seed,
                                wrap_options=wrap_options)
    return measure_ranks([(model, setup)], setup.world_size, measure=measure)[0]


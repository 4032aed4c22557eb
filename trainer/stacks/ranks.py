"""Another stack's step on several ranks, for real: W gloo processes on the CPU, each running the library's
model and step wrapped as the library's own distributed code wraps it (its module's ``wrap_ranks``: litgpt,
Fabric's ``DDPStrategy`` or its scripts' FSDP1 ``FSDPStrategy``; torchtune, its recipes' ``training.shard_model``,
FSDP2), under MemTracker.

DDP's C++ reducer builds its buckets from real storage, so a DDP step cannot be traced on fake tensors; and
torchtune's step is its own. These real ranks are what ``memplan estimate --stack litgpt --sharding ddp|fsdp`` and
``--stack torchtune --sharding fsdp`` are held to (the walk with ``collectives="gloo"``), as
``trainer.distributed.measure_ranks`` (which runs them) holds memplan's own.

``trace_stack_rank`` traces rank 0 of the same wrapped step (FSDP: torchtune's FSDP2, litgpt's finetune_lora FSDP2 or
its scripts' FSDP1) in this process on fake tensors under a fake process group, as ``memplan trace --world-size N``
traces memplan's own (``trainer.distributed.trace_rank_step``).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
import torch.distributed as dist

from memplan.errors import InputError
from memplan.units import possessive
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


def trace_stack_rank(stack: str, model: StackModel, setup, device: str = "cpu", lora_dropout: float | None = None,
                     accelerator: bool = False, rank: int = 0):
    """The exact live-tensor peak of rank ``rank`` of ``stack``'s FSDP step (its module's ``wrap_ranks`` on the mesh
    its ``rank_mesh`` makes, the walk's default layout: ``rank_wrap_options``; litgpt: finetune_lora's FSDP2 with
    LoRA, else its scripts' FSDP1, whose ``FullyShardedDataParallel`` runs on fake tensors too), in this process, on
    fake tensors, after ``WARMUP_STEPS`` untraced steps: ``trainer.stacks.trace_stack``
    over a fake process group of ``setup.world_size`` ranks (torch.testing's FakeStore, as
    ``trainer.distributed.trace_rank_step`` traces memplan's own), whose collectives return at once and allocate
    nothing, as NCCL's do (gloo's reduce-scatter copies its input: ``gloo_reduce_scatter_copy_bytes``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainer.distributed import WARMUP_STEPS
    from trainer.stacks import trace_stack

    check_stack(stack)
    module = _stack_module(stack)
    wrap = getattr(module, "wrap_ranks", None)
    if wrap is None or setup.sharding != "fsdp":
        raise InputError(f"--stack {stack} --sharding {setup.sharding}: a rank is traced for --stack litgpt|torchtune "
                         "with --sharding fsdp")
    options = module.rank_wrap_options(model.spec, setup) if hasattr(module, "rank_wrap_options") else {}
    if dist.is_initialized():
        raise RuntimeError("trace_stack_rank makes its own (fake) process group; this process is already in one")
    dist.init_process_group("fake", rank=rank, world_size=setup.world_size, store=FakeStore())
    try:
        options["mesh"] = module.rank_mesh(device)  # outside fake mode: init_device_mesh reads its ranks' values
        with warnings.catch_warnings():  # FSDP1's _same_storage compares data pointers, which a fake tensor lacks
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            traced = trace_stack(stack, model, setup, device, lora_dropout=lora_dropout, accelerator=accelerator,
                                 wrap=functools.partial(wrap, **options), warmup=WARMUP_STEPS)
    finally:
        dist.destroy_process_group()
    return dataclasses.replace(traced, method=f"rank {rank} of {traced.method}, {setup.world_size} ranks sharded as "
                                              f"{possessive(stack)} own code shards them, a fake process group")

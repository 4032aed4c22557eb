"""Another stack's step on several ranks, for real: W gloo processes on the CPU, each running the library's
model and step wrapped as the library's own distributed code wraps it (litgpt: Fabric's ``DDPStrategy``,
``trainer/stacks/litgpt.py`` ``wrap_ranks``), under MemTracker.

DDP's C++ reducer builds its buckets from real storage, so a DDP step cannot be traced on fake tensors;
these real ranks are what ``memplan estimate --stack litgpt --sharding ddp`` is held to (the walk with
``collectives="gloo"``), as ``trainer.distributed.measure_ranks`` holds memplan's own DDP walk.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from memplan.errors import InputError
from trainer.stacks import StackModel, _built, _stack_module, _vocab, check_stack


def _rank_memory(stack: str, model: StackModel, setup, lora_dropout: float | None, seed: int):
    """This rank's StepMemory: the stack's model built with the same weights in every rank, wrapped, two steps
    of its step under MemTracker (``trainer.measure._tracked_steps``) on this rank's own token ids."""
    from trainer.measure import StepMemory, _random_ids, _tracked_steps
    from trainer.step import set_matmul_precision

    module = _stack_module(stack)
    wrap = getattr(module, "wrap_ranks", None)
    if wrap is None:
        raise InputError(f"--stack {stack}: its step on several ranks is not run here")
    torch.manual_seed(seed)
    set_matmul_precision(setup.precision)
    net, optimizer, step = _built(stack, model, setup, lora_dropout)
    net = wrap(net, setup)
    gen = torch.Generator().manual_seed(seed + 1 + dist.get_rank())
    total, categories, _ = _tracked_steps(net, optimizer, setup, lambda: _random_ids(_vocab(model), setup, "cpu", gen),
                                          "cpu", step_fn=step)
    return StepMemory(peak_allocated=total, breakdown=categories, params=sum(p.numel() for p in net.parameters()),
                      method=f"{stack}'s model and step wrapped for {setup.sharding}, MemTracker on real tensors, "
                             f"gloo (rank {dist.get_rank()})")


def _worker(rank: int, world_size: int, store_path: str, out_dir: str, stack: str, model: StackModel, setup,
            lora_dropout: float | None, seed: int) -> None:
    import pickle

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # the ranks share the cores
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    try:
        memory = _rank_memory(stack, model, setup, lora_dropout, seed)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(memory, f)
    finally:
        dist.destroy_process_group()


def measure_stack_ranks(stack: str, model: StackModel, setup, lora_dropout: float | None = None, seed: int = 0):
    """Every rank's StepMemory of ``stack``'s step under ``setup.sharding`` over ``setup.world_size`` gloo
    processes started here (spawned; the peak is MemTracker's in each rank)."""
    import pickle
    import tempfile

    import torch.multiprocessing as mp

    check_stack(stack)
    if setup.world_size < 2 or setup.sharding == "none":
        raise InputError("measure_stack_ranks runs several ranks: give a world size above 1 and a sharding")
    with tempfile.TemporaryDirectory(prefix="memplan-stack-ranks-") as tmp:
        mp.start_processes(_worker, args=(setup.world_size, os.path.join(tmp, "store"), tmp, stack, model, setup,
                                          lora_dropout, seed),
                           nprocs=setup.world_size, join=True, start_method="spawn")
        out = []
        for rank in range(setup.world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                out.append(pickle.load(f))
    return out

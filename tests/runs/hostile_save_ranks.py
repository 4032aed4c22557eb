"""One rank of tests/runs/test_hostile_ranks.py (run under torchrun, gloo): a tiny DDP model's checkpoint saved
through ``trainer.checkpoint_policy.CheckpointManager`` with a failure planted in one rank's part of the save, once
for each fault asked (comma-separated: one launch of torchrun for them all), each into a run of its own,
OUT/FAULT/run. Each rank writes what each save ended with, one line, to OUT/FAULT/rank{R}.txt, and exits 0 (so
that torchrun's agent ends no rank early: the test reads whether every rank came out of each save, and with
what)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from trainer import checkpoint_format as ckpt
from trainer import distributed


class Tok:
    kind = "tiktoken"  # no tokenizer.json to write


def main(out: str, faults: str, failing: int) -> None:
    ctx = distributed.init("cpu")
    model = torch.nn.Linear(4, 4)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(wrapped.parameters())
    for fault in faults.split(","):
        save_with(Path(out) / fault, fault, failing, ctx, model, wrapped, optimizer)
    distributed.shutdown()


def save_with(out: Path, fault: str, failing: int, ctx, model, wrapped, optimizer) -> None:
    from trainer.checkpoint_policy import CheckpointManager

    out.mkdir(parents=True, exist_ok=True)
    owner, name = {"prepare": (ckpt, "clean_leftovers"),  # rank 0's part before the shards
                   "finish": (ckpt, "save_checkpoint"),  # rank 0's part after them
                   }.get(fault, (distributed, "save_sharded"))  # every rank's part
    original = getattr(owner, name)
    if ctx.rank == failing:
        def broken(*args, **kwargs):
            raise OSError(5, f"planted failure in {fault}")

        setattr(owner, name, broken)
    manager = CheckpointManager(out / "run", keep=1, dist=ctx)
    try:
        manager.save(1, model=model, wrapped=wrapped, optimizer=optimizer, state=lambda: {"step": 1},
                     meta=lambda: {"step": 1}, tokenizer=Tok(), tied=False, sharding="ddp")
        line = "saved"
    except Exception as e:
        line = f"{type(e).__name__}: {' '.join(str(e).split())}"
    finally:
        setattr(owner, name, original)
    (out / f"rank{ctx.rank}.txt").write_text(line + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    os._exit(0)

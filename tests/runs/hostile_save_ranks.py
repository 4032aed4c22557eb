"""One rank of tests/runs/test_hostile_ranks.py (run under torchrun, gloo): a tiny DDP model's checkpoint saved
through ``trainer.checkpoints.CheckpointManager`` with a failure planted in one rank's part of the save.
Each rank writes what it ended with, one line, to OUT/rank{R}.txt, and exits 0 (so that torchrun's agent ends
no rank early: the test reads whether every rank came out of the save, and with what)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from trainer import checkpoint as ckpt
from trainer import distributed


class Tok:
    kind = "tiktoken"  # no tokenizer.json to write


def main(out: str, fault: str, failing: int) -> None:
    ctx = distributed.init("cpu")
    run = Path(out) / "run"
    model = torch.nn.Linear(4, 4)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(wrapped.parameters())
    if ctx.rank == failing:
        def broken(*args, **kwargs):
            raise OSError(5, f"planted failure in {fault}")

        if fault == "prepare":
            ckpt.clean_leftovers = broken  # rank 0's part before the shards
        elif fault == "finish":
            ckpt.save_checkpoint = broken  # rank 0's part after them
        else:
            distributed.save_sharded = broken  # every rank's part
    from trainer.checkpoints import CheckpointManager

    manager = CheckpointManager(run, keep=1, dist=ctx)
    try:
        manager.save(1, model=model, wrapped=wrapped, optimizer=optimizer, state=lambda: {"step": 1},
                     meta=lambda: {"step": 1}, tokenizer=Tok(), tied=False, sharding="ddp")
        line = "saved"
    except Exception as e:
        line = f"{type(e).__name__}: {' '.join(str(e).split())}"
    (Path(out) / f"rank{ctx.rank}.txt").write_text(line + "\n")
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    os._exit(0)

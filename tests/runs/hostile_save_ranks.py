"""One rank of tests/runs/test_hostile_ranks.py (run under torchrun, gloo): a tiny DDP model's checkpoint saved
through ``trainer.checkpoint_policy.CheckpointManager`` with a fault planted in one rank's part of the save, once
for each fault asked (comma-separated: one launch of torchrun for them all), each into a run of its own,
OUT/FAULT/run. Each rank writes what each save ended with, one line, to OUT/FAULT/rank{R}.txt, and the seconds it
took to OUT/FAULT/rank{R}.seconds, and exits 0 (so that torchrun's agent ends no rank early: the test reads
whether every rank came out of each save, and with what).

The faults (each in the rank given, FAILING, except ``hang``): ``prepare`` and ``finish``, rank 0's parts before and
after the shards; ``state``, the sharded state dict; ``write``, DCP's write of the shards; ``weights``, the whole
weights gathered; ``hang``: rank 1 stops in its sharded state for HANG seconds (longer than the save's timeout,
$MEMPLAN_SAVE_TIMEOUT) and then goes on; ``gather``: rank 1 stops for HANG seconds inside the gather of the whole
weights, before its second tensor's all-gather (``DTensor.redistribute``, which FSDP2's full state dict and
``DTensor.full_tensor`` both call), and then goes on; ``none``: nothing planted (rank 0 also writes the whole
weights as torch's own full state dict gathers them, OUT/none/expected.pt). A hang must come last, as the ranks' exchanges are out of
step after it. With a fifth argument ``fsdp`` the model is FSDP2's (two linear layers of 7 and 3 rows, ``fully_shard``), whose
whole weights are all-gathered; else DDP's.
The faults are planted where the trainer looks the functions up at each save, in torch's own modules or in
the trainer's, so the same faults apply to any version of trainer/."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint.filesystem as dcp_files
import torch.distributed.checkpoint.state_dict as dcp_state
from torch.distributed.tensor import DTensor

from trainer import checkpoint_format as ckpt
from trainer import distributed

HANG_RANK = 1


class Tok:
    kind = "tiktoken"  # no tokenizer.json to write


def main(out: str, faults: str, failing: int, hang_seconds: float, sharding: str = "ddp") -> None:
    ctx = distributed.init("cpu")
    if sharding == "fsdp":
        from torch.distributed.fsdp import fully_shard

        model = wrapped = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Linear(7, 3)))
    else:
        model = torch.nn.Linear(4, 4)
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(wrapped.parameters())
    for fault in faults.split(","):
        save_with(Path(out) / fault, fault, failing, hang_seconds, ctx, model, wrapped, optimizer, sharding)
    distributed.shutdown()


def save_with(out: Path, fault: str, failing: int, hang_seconds: float, ctx, model, wrapped, optimizer,
              sharding: str) -> None:
    from trainer.checkpoint_policy import CheckpointManager

    out.mkdir(parents=True, exist_ok=True)
    owner, name = {"prepare": (ckpt, "clean_leftovers"),  # rank 0's part before the shards
                   "state": (dcp_state, "get_state_dict"),  # every rank's sharded state
                   "write": (dcp_files.FileSystemWriter, "write_data"),  # every rank's shards, written by DCP
                   "weights": (dcp_state, "get_model_state_dict"),  # the whole weights, gathered
                   "finish": (ckpt, "save_checkpoint"),  # rank 0's part after them
                   "hang": (dcp_state, "get_state_dict"),
                   "gather": (DTensor, "redistribute"),  # each tensor's all-gather of the whole weights
                   "none": (ckpt, "save_checkpoint"),  # nothing planted: the weights saved, and FSDP2's own gather
                   }[fault]
    original = getattr(owner, name)
    calls = []
    if fault in ("hang", "gather") and ctx.rank == HANG_RANK:
        def slow(*args, **kwargs):
            calls.append(1)
            if fault == "hang" or len(calls) == 2:
                time.sleep(hang_seconds)
            return original(*args, **kwargs)

        setattr(owner, name, slow)
    elif fault not in ("hang", "gather", "none") and ctx.rank == failing:
        def broken(*args, **kwargs):
            raise OSError(5, f"planted failure in {fault}")

        setattr(owner, name, broken)
    manager = CheckpointManager(out / "run", keep=1, dist=ctx)
    t0 = time.monotonic()
    try:
        manager.save(1, model=model, wrapped=wrapped, optimizer=optimizer, state=lambda: {"step": 1},
                     meta=lambda: {"step": 1}, tokenizer=Tok(), tied=False, sharding=sharding)
        line = "saved"
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        line = f"{type(e).__name__}: {' '.join(str(e).split())}"
    finally:
        setattr(owner, name, original)
    if fault == "none":  # the whole weights as torch's full state dict gathers them, to compare with the saved
        expected = distributed.full_weights(wrapped)
        if ctx.rank == 0:
            torch.save({ckpt.canonical_name(k): v for k, v in expected.items()}, out / "expected.pt")
    (out / f"rank{ctx.rank}.seconds").write_text(f"{time.monotonic() - t0:.1f}\n")
    (out / f"rank{ctx.rank}.txt").write_text(line + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), *sys.argv[5:])
    os._exit(0)

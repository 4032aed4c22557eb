"""``python -m trainer RUN``: one rank of a torchrun launch (or one process alone) of the run prepared in RUN.

``memplan train --nproc N --out RUN ...`` resolves the run once (the plan for N processes, the settings, the
data), writes it into RUN/launch.json (docs/run-directory.md) and starts ``torchrun --nproc-per-node N -m
trainer RUN``; each rank reads that file, checked as any input is, and builds its trainer from it
(``trainer.train_run.read_launch`` / ``resolve_launch``). ``memplan finetune --nproc N`` writes the file with kind
``finetune`` and launches the same way. A launch that stopped before its run began can be started again the
same way, e.g. with torchrun's own options: ``torchrun --nproc-per-node 2 -m trainer RUN``.

No command line is parsed here: anything but one run directory (``memplan train``'s options, say) is refused
in one line naming the accepted form, exit code 2.

Under torchrun each process trains on its own device (its GPU by local rank, or the CPU over gloo) with DDP or
FSDP2 (the plan's sharding, else DDP); only rank 0 prints and writes the run. Alone, it trains in one process.

Bad input is one line on stderr, from rank 0 only, and exit code 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PROG = "python -m trainer"


def entry(argv: list[str] | None = None) -> None:
    """``python -m trainer RUN``: train the run RUN/launch.json describes, in this rank. Anything else (no RUN,
    several arguments, an option) is one line on stderr (from rank 0 only) naming the accepted form, exit
    code 2; so is bad input in the file."""
    from memplan.errors import InputError

    argv = sys.argv[1:] if argv is None else argv
    try:
        if len(argv) != 1 or argv[0].startswith("-"):
            raise InputError(f"{PROG} RUN: one run directory, prepared by `memplan train --nproc N --out RUN` "
                             f"(or `memplan finetune --nproc N`); got {' '.join(argv) or 'no argument'!r}. The ranks read the "
                             "run from RUN/launch.json, never options")
        code = run_prepared(argv[0])
    except InputError as e:
        _fail(str(e))
    _exit(code)


def run_prepared(run_dir: str) -> int:
    """Read RUN/launch.json, join the process group torchrun described, build this rank's trainer from the
    file and train; its exit code (0, 1 when the run stopped on an error, 128 + N for signal N)."""
    from rich.console import Console

    from memplan.cli.train import RichUI, trained
    from trainer import distributed
    from trainer.finetune_run import read_launch_file
    from trainer.train_run import LaunchSpec, resolve_launch, start_trainer

    spec = read_launch_file(run_dir)  # checked before the group is joined: every rank refuses it alike
    rank, launched, _ = distributed.env_world()
    console = Console(stderr=True, highlight=False, quiet=rank != 0)
    try:
        if launched > 1:
            distributed.init()
        if not isinstance(spec, LaunchSpec):  # memplan finetune --nproc's
            from trainer import rundir
            from trainer.finetune_run import resolve_finetune_launch, start_finetune

            ft = resolve_finetune_launch(spec, str(Path(run_dir) / rundir.LAUNCH_FILE), max(launched, 1))
            return trained(console, start_finetune(ft), Path(ft.request.out), what="finetuning",
                           log=spec.request.log)
        run = resolve_launch(spec, run_dir, RichUI(console))
        return trained(console, start_trainer(run), run.run_dir, rates_note=run.rates_note, log=spec.log)
    finally:
        distributed.shutdown()


FAIL_GRACE_SECONDS = 2.0  # how long the other ranks wait before leaving, so that rank 0 says why first


def _fail(message: str) -> None:
    """``message`` as one line on stderr from rank 0 (the others say nothing), then exit code 2.

    Every rank refuses the same input alike, but torchrun's agent ends the whole group at the first rank
    that exits: had another rank left first, rank 0 could be killed before its line was written (seen on a
    loaded machine). The other ranks leave ``FAIL_GRACE_SECONDS`` later, or when the agent ends them."""
    if os.environ.get("RANK", "0") == "0":
        prog = "memplan" if os.environ.get("MEMPLAN_LAUNCHED_BY") == "memplan" else PROG
        print(f"{prog}: error: " + " ".join(message.split()), file=sys.stderr)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import time

        time.sleep(FAIL_GRACE_SECONDS)
    _exit(2)


def _exit(code: int) -> None:
    """Leave with ``code``. One rank of several leaves through ``os._exit`` once its output is flushed:
    the command has already destroyed the process group, closed its files and released its lock, and
    what remains is interpreter finalization, where a C++ thread of torch's distributed runtime can
    still abort the process ("terminate called without an active exception", exit -6). That was seen
    once in CI under load, after the run's last checkpoint was complete, and turned a finished run
    into a failed launch. Alone (no torchrun), this is ``sys.exit``."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()

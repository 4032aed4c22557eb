"""``python -m trainer``: ``memplan train`` in this process, which is one rank of a torchrun launch
(``python -m trainer finetune ...``: ``memplan finetune``).

    torchrun --nproc-per-node 2 -m trainer --plan plan.toml --data DATA --out RUN --sharding fsdp
    torchrun --nproc-per-node 2 -m trainer --params 22m --ctx 256 --batch 4 --data DATA --out RUN --max-steps 100
    torchrun --nproc-per-node 2 -m trainer finetune --run RUN --data sft.jsonl --out FT --lora-rank 8

It takes ``memplan train``'s options (``memplan train --nproc N`` launches exactly this), or after
``finetune`` ``memplan finetune``'s (``memplan finetune --nproc N``). Under
torchrun each process trains on its own device (its GPU by local rank, or the CPU over gloo) with
DDP or FSDP2 (``--sharding``, or the plan's, else DDP); only rank 0 prints and writes the run.
Alone, it trains in one process as ``memplan train`` does.
"""

from __future__ import annotations

import os
import sys

PROG = "python -m trainer"


def entry(argv: list[str] | None = None) -> None:
    """Run ``memplan train ARGV`` (``memplan finetune ARGV[1:]`` when ARGV[0] is ``finetune``). Bad input is one
    line on stderr (from rank 0 only) and exit code 2."""
    import typer
    from typer.core import TyperGroup

    from memplan.cli import app, click_exceptions
    from memplan.errors import InputError

    argv = sys.argv[1:] if argv is None else argv
    args = ["finetune", *argv[1:]] if argv[:1] == ["finetune"] else ["train", *argv]
    command = typer.main.get_command(app)
    try:  # the group's own main, not memplan's one-line wrapper: here only rank 0 may print the error
        rv = TyperGroup.main(command, args=args, prog_name=PROG, standalone_mode=False)
    except InputError as e:
        message = str(e)
    except click_exceptions.ClickException as e:
        message = e.format_message()
    except typer.Exit as e:
        _exit(e.exit_code)
    else:
        _exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)
    if os.environ.get("RANK", "0") == "0":
        prog = "memplan" if os.environ.get("MEMPLAN_LAUNCHED_BY") == "memplan" else PROG
        print(f"{prog}: error: " + " ".join(message.split()), file=sys.stderr)
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

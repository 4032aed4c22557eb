"""A run in N processes: ``memplan train --nproc N`` and ``memplan finetune --nproc N`` resolve their run once, in
the launching process (``prepare_train``, ``prepare_finetune``: the plan made for N processes, written into
RUN/launch.json), then start N ranks with torchrun's launcher (``start_ranks``), each ``python -m trainer RUN``
reading that file (``trainer.__main__``). The commands only map flags to the request and render what is said.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from memplan.errors import InputError

LAUNCHED_BY_ENV = "MEMPLAN_LAUNCHED_BY"  # set for the ranks a memplan command starts: their errors read as its own


def check_plan_world_size(plan_path: str | None, nproc: int) -> None:
    """A --plan made for several processes is launched with that many (a plan for one is rescaled for any
    number); an InputError otherwise, before anything else is read or resolved."""
    if not plan_path:
        return
    from memplan.plan import Plan

    world_size = Plan.load(plan_path).setup.world_size
    if world_size not in (1, nproc):
        raise InputError(f"the plan is for --world-size {world_size}; launch it with `memplan train --nproc "
                         f"{world_size}`")


def prepare_train(request, ui, log: list[str]) -> tuple[Path, bool]:
    """``memplan train --nproc N``'s run (``request``, a ``trainer.train_run.TrainRequest`` with ``nproc`` N)
    resolved once for N processes (the embedded corpus, the calibration, autotune and the rescaling,
    ``resolve_train``, speaking through ``ui``) and written into RUN/launch.json (``write_launch``). Returns
    RUN and whether this launch created it. An InputError, and nothing written, for bad input."""
    from trainer.train_run import check_launch_target, launch_spec, resolve_train, write_launch

    check_plan_world_size(request.plan, request.nproc)
    check_launch_target(request)
    resolved = resolve_train(request, ui)
    created = not os.path.lexists(resolved.run_dir)
    write_launch(resolved.run_dir, launch_spec(resolved, request, log))
    return resolved.run_dir, created


def prepare_finetune(request, say: Callable[[str], None]) -> tuple[Path, bool]:
    """``memplan finetune --nproc N``'s finetune (a ``trainer.finetune_run.FinetuneRequest``) resolved once
    for N processes (its plan made for them) and written into RUN/launch.json with kind ``finetune``. Returns
    RUN and whether this launch created it."""
    from trainer.finetune_run import FinetuneLaunch, resolve_finetune
    from trainer.train_run import check_launch_target, write_launch

    check_launch_target(request)  # before the base and the data are read
    run_dir = Path(request.out)
    resolved = resolve_finetune(request, world_size=request.nproc, say=say)
    created = not os.path.lexists(run_dir)
    write_launch(run_dir, FinetuneLaunch(request=request, plan=None if request.resume else resolved.plan.to_dict()))
    return run_dir, created


def start_ranks(run_dir: Path, nproc: int, *, resume: bool, created: bool, what: str,
                say: Callable[[str], None]) -> int:
    """torchrun's launcher starting ``nproc`` ranks of ``python -m trainer RUN``, each reading RUN/launch.json
    (written just before); returns 0 when they all finished, else rank 0's exit code (1 where it had none).
    When they fail: a new run refused before it began takes its launch file (and the directory, if this
    launch ``created`` it) away, and ``say`` names the failed ranks if rank 0 said nothing."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from trainer import rundir

    run_dir = Path(run_dir)
    args = parse_args(["--standalone", "--nproc-per-node", str(nproc), "-m", "trainer", str(run_dir)])
    for name in list(logging.root.manager.loggerDict):  # the launcher's own chatter: the ranks speak for the run
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[LAUNCHED_BY_ENV] = "memplan"  # the ranks' errors read as this command's
    try:
        run(args)
    except ChildFailedError as e:
        if not resume and not os.path.lexists(run_dir / rundir.RUN_FILE):  # refused before it began
            rundir.remove_launch(run_dir, created)
        codes = {f.local_rank: f.exitcode for f in e.failures.values()}
        code = codes.get(0, next(iter(codes.values()), 1))
        if 0 not in codes:  # rank 0 said nothing about it
            say(f"memplan: {what} failed in rank(s) {', '.join(map(str, sorted(codes)))} "
                f"(exit codes {', '.join(map(str, codes.values()))})")
        return code if code > 0 else 1
    return 0

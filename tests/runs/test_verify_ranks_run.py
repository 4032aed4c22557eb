"""`memplan autotune --world-size 2 --verify`, for real: each trial on 2 gloo ranks of this CPU (trainer/verify_ranks.py),
every rank's measured peak against the walk's per-rank prediction, the plan written with its measurement; a rank
out of memory fails the trial; ranks that outlive the trial's timeout are killed with their process. The fast
checks (bad input, refusals) and litgpt's and torchtune's ranks (`libs`) are in tests/unit/test_verify_ranks.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from memplan.autotune import autotune
from memplan.hardware import load_profile
from memplan.model import ModelSpec
from test_verify_ranks import AUTOTUNE, _verified_on_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_verify_runs_a_plan_for_two_devices_on_two_real_ranks(sharding, tmp_path, monkeypatch):
    """Before issue 26 item 3, --verify refused any --world-size above 1 (exit 2)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _verified_on_ranks([*AUTOTUNE, "--sharding", sharding], tmp_path / "plan.toml", sharding)


@pytest.mark.slow
def test_a_rank_out_of_memory_fails_the_trial_and_no_plan_is_verified():
    """A model whose embedding (2^30 × 64 fp32 = 256 GiB; 128 GiB a rank under FSDP) is more than this machine can
    allocate, planned against a budget far beyond it: the ranks' trial runs out of memory for real, the plan is
    not verified."""
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1":
        pytest.skip("with overcommit always on, the allocation would succeed and the OOM killer would act instead")
    from trainer.verify import verify
    from trainer.verify_ranks import RankTrialRunner

    spec = ModelSpec(arch="llama", layers=1, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=2**30, tied=True)
    result = autotune(spec, load_profile("cpu"), ctx=16, global_batch=4, budget_bytes=2**50, margin=0.0,
                      world_size=2, sharding="fsdp")
    with RankTrialRunner(env={"OMP_NUM_THREADS": "1"}) as runner:
        v = verify(result, runner=runner, max_plans=1)
    assert v.plan is None and len(v.attempts) == 1
    attempt = v.attempts[0]
    assert attempt.outcome == "out of memory", attempt.trial
    assert attempt.trial.error.startswith("rank ") and "allocate" in attempt.trial.error
    assert v.to_json()["peak_measured"] is None


def _session(sid: int) -> list[int]:
    """The live processes of session ``sid`` (from /proc: the session id follows the state, ppid and pgrp)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


@pytest.mark.slow
def test_a_rank_that_hangs_ends_the_trial_at_its_timeout_with_every_rank_killed(monkeypatch):
    """A rank stopped (SIGSTOP) as soon as the ranks exist: the other waits for it, the trial outlives its timeout,
    and the ranks' process is killed with both ranks (one session), the stopped one included; the trial is an
    error, and verify goes on."""
    import signal
    import subprocess
    import threading
    import time

    import trainer.verify_ranks as verify_ranks
    from memplan.setup import TrainSetup

    started, stopped = [], []
    real = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    def stop_a_rank() -> None:  # the ranks' process, then its two spawned ranks (and spawn's resource tracker)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not stopped:
            if started:
                ranks = [p for p in _session(started[0].pid) if p != started[0].pid]
                if len(ranks) >= 2:
                    os.kill(max(ranks), signal.SIGSTOP)
                    stopped.append(max(ranks))
            time.sleep(0.05)

    monkeypatch.setattr(verify_ranks.subprocess, "Popen", popen)
    spec = ModelSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=64, tied=True)
    setup = TrainSetup(ctx=16, micro_batch=1, grad_accum=1, world_size=2, sharding="ddp")
    watcher = threading.Thread(target=stop_a_rank)
    watcher.start()
    trials = []

    def trial_on_ranks() -> None:
        with verify_ranks.RankTrialRunner(timeout_s=15) as runner:
            trials.append(runner.run(spec, setup, steps=2))

    running = threading.Thread(target=trial_on_ranks)
    running.start()
    running.join(timeout=120)
    if running.is_alive():  # the runner hangs (the ranks it left hold its pipes): end them, then fail
        for pid in _session(started[0].pid):
            os.kill(pid, signal.SIGKILL)
        running.join()
        pytest.fail("the trial on ranks did not end at its timeout")
    watcher.join()
    assert stopped, "the ranks never started"
    trial = trials[0]
    assert trial.status == "error" and "did not finish within 15 s" in trial.error, trial
    assert trial.peak_bytes is None and trial.ranks == ()
    assert _session(started[0].pid) == [], "processes of the killed trial are still running"

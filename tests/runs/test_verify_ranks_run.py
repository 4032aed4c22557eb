"""`memplan autotune --world-size 2 --verify`, for real: each trial on 2 gloo ranks of this CPU (trainer/verify_ranks.py),
every rank's measured peak against the walk's per-rank prediction, the plan written with its measurement; a rank
out of memory fails the trial; ranks that outlive the trial's timeout are killed with their process. The fast
checks (bad input, refusals) and litgpt's and torchtune's ranks (`libs`) are in tests/unit/test_verify_ranks.py."""

from __future__ import annotations

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


@pytest.mark.slow
def test_ranks_that_outlive_the_timeout_are_killed_with_their_process(monkeypatch):
    """The ranks' process and every rank it spawned are one session, killed when the trial outlives its timeout
    (a rank that hangs ends the trial as an error, never verify); 0.5 s is less than two processes take to
    import torch."""
    import subprocess

    import trainer.verify_ranks as verify_ranks
    from memplan.setup import TrainSetup

    started = []
    real = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(verify_ranks.subprocess, "Popen", popen)
    spec = ModelSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=64, tied=True)
    setup = TrainSetup(ctx=16, micro_batch=1, grad_accum=1, world_size=2, sharding="ddp")
    with verify_ranks.RankTrialRunner(timeout_s=0.5) as runner:
        trial = runner.run(spec, setup, steps=2)
    assert trial.status == "error" and "did not finish within 0.5 s" in trial.error, trial
    assert trial.peak_bytes is None and trial.ranks == ()
    session = started[0].pid
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":  # the session id, after the state, ppid, pgrp
            left.append(stat.parent.name)
    assert not left, f"processes of the killed trial still running: {left}"



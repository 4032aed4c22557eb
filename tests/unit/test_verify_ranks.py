"""`memplan autotune --world-size N --verify`: each trial on N real ranks of this machine (trainer/verify_ranks.py:
gloo processes on the CPU), every rank's measured peak against the walk's per-rank prediction; a rank's failure or
a hang fails the trial (nothing written); --sharding pins the search's sharding; a stack whose code is not run on
ranks is refused in one line.

memplan's own stack on ranks, a rank out of memory and the timeout are in tests/runs/test_verify_ranks_run.py (slow:
each run starts processes that import torch); litgpt's and torchtune's here are `libs`, run in those libraries' own
environments (.ci/run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.autotune import autotune
from memplan.cli import app
from memplan.hardware import load_profile
from memplan.model import ModelSpec

# a 1-layer llama whose whole per-rank batch fits a 2 GiB budget on the CPU profile: one trial, no stepping down
AUTOTUNE = ["autotune", "--arch", "llama", "--layers", "1", "--hidden", "128", "--heads", "4", "--ffn", "384",
            "--vocab", "4096", "--device", "cpu", "--ctx", "128", "--global-batch", "8", "--budget", "2GiB",
            "--precision", "fp32", "--world-size", "2", "--verify", "--verify-steps", "2"]


def run_cli(*args: str):
    return CliRunner().invoke(app, list(args))


def one_line_error(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    return lines[0]


def _verified_on_ranks(args: list[str], out: Path, sharding: str) -> dict:
    """autotune ARGS --json --out OUT: exit 0, one trial on 2 ranks that fit, each rank's peak within the project's
    bar of the walk's per-rank prediction, the plan written with its measurement."""
    done = run_cli(*args, "--json", "--out", str(out))
    assert done.exit_code == 0, done.output
    verified = json.loads(done.stdout)["verified"]
    attempt = verified["attempts"][0]
    assert attempt["outcome"] == "fits" and attempt["steps"] == 2, attempt
    assert attempt["plan"]["world_size"] == 2 and attempt["plan"]["sharding"] == sharding
    ranks = attempt["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(len(r["step_seconds"]) == 2 for r in ranks)
    for r in ranks:  # 0.9-1.1: the project's bar for a measured CPU peak (benchmarks/local_memory.py)
        assert 0.9 < r["measured_peak"] / attempt["predicted_peak"] < 1.1, (r, attempt["predicted_peak"])
    assert attempt["measured_peak"] == verified["peak_measured"] == max(r["measured_peak"] for r in ranks)
    slowest = max(r["step_seconds"][1] for r in ranks)  # the timed step (after the warm-up), its slowest rank
    tokens = 4 * 128 * 1 * 2  # micro-batch 4 × 1 in each of 2 ranks, ctx 128
    assert verified["tokens_per_second"] == pytest.approx(tokens / slowest)
    assert "over 2 ranks" in verified["method"]
    text = out.read_text()
    assert "world_size = 2" in text and f'sharding = "{sharding}"' in text and "[verified]" in text
    return verified


# ---- bad input: one line, exit 2 ---------------------------------------------------------------------------

@pytest.mark.parametrize("args,words", [
    (["--sharding", "ddp"], ["--sharding ddp", "--world-size N"]),  # one device shards nothing
    (["--world-size", "2", "--sharding", "zero3"], ["--sharding", "'zero3'", "accepted: ddp, fsdp"]),
    (["--world-size", "2", "--sharding", "ddp", "--stack", "torchtune"], ["--stack torchtune", "accepted: fsdp"]),
])
def test_autotune_sharding_refused_in_one_line(args, words):
    line = one_line_error(run_cli("autotune", "--params", "22m", "--device", "cpu", "--ctx", "256", *args))
    assert all(w in line for w in words), line


def test_autotune_sharding_that_the_emitted_config_cannot_run_is_refused_in_one_line(tmp_path):
    """litgpt's YAML has no strategy key: with several devices its scripts run FSDP, so ``--sharding ddp --emit``
    is refused before the search, and nothing is written."""
    line = one_line_error(run_cli("autotune", "--params", "22m", "--device", "cpu", "--ctx", "256", "--stack", "litgpt",
                                  "--world-size", "2", "--sharding", "ddp", "--emit", str(tmp_path / "out")))
    assert all(w in line for w in ("--sharding ddp with --emit", "litgpt's config", "accepted with --emit: "
                                   "--sharding fsdp")), line
    assert not (tmp_path / "out").exists()


def test_sharding_pins_the_search():
    spec = ModelSpec(arch="llama", layers=1, hidden=128, heads=4, kv_heads=4, ffn=384, vocab=4096, tied=False)
    cpu = load_profile("cpu")
    both = {c.setup.sharding for c in autotune(spec, cpu, ctx=128, global_batch=8, world_size=2).ranked_fitting()}
    assert both == {"ddp", "fsdp"}
    for sharding in ("ddp", "fsdp"):
        found = autotune(spec, cpu, ctx=128, global_batch=8, world_size=2, sharding=sharding)
        assert {c.setup.sharding for c in found.ranked_fitting()} == {sharding}


def test_verify_on_ranks_refuses_a_plan_for_another_kind_of_device(tmp_path):
    # as the one-process verify: checked before any rank starts, nothing written
    out = tmp_path / "plan.toml"
    line = one_line_error(run_cli("autotune", "--params", "22m", "--device", "rtx-4090", "--world-size", "2",
                                  "--verify", "--out", str(out)))
    assert "this machine's cpu" in line and not out.exists()


def test_transformers_trainer_on_ranks_is_refused_in_one_line_naming_the_stacks_accepted(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "plan.toml"
    line = one_line_error(run_cli(*AUTOTUNE, "--stack", "transformers", "--out", str(out)))
    assert "--stack transformers" in line and "accepted: --stack memplan, litgpt, torchtune" in line, line
    assert not out.exists()


# ---- litgpt's DDP and torchtune's FSDP2 on ranks, in their own environments ----------------------------------

@pytest.mark.libs
@pytest.mark.parametrize("stack,sharding", [("litgpt", "ddp"), ("torchtune", "fsdp")])
def test_verify_runs_the_librarys_own_step_on_two_real_ranks(stack, sharding, tmp_path, monkeypatch):
    pytest.importorskip(stack)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    verified = _verified_on_ranks([*AUTOTUNE, "--stack", stack, "--sharding", sharding], tmp_path / "plan.toml",
                                  sharding)
    assert verified["method"].startswith({"litgpt": "litgpt's GPT", "torchtune": "torchtune's builders"}[stack])
    assert "wrap_ranks" in verified["method"]

"""A plan's [training] table: the optimisation settings a run trains with, so that a plan file reproduces it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.plan import Plan
from runs_helper import one_line_error, tiny_corpus, tiny_run

QUIET = ["--sample-tokens", "0", "--threads", "1", "--max-steps", "2", "--eval-batches", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("run") / "run", corpus, steps=2)


def _start(run: Path) -> dict:
    return next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if '"event": "start"' in line)


def test_a_runs_plan_carries_the_settings_it_trained_with(trained):
    plan = Plan.load(trained / "plan.toml")
    config = _start(trained)["config"]
    for key in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "clip"):
        assert plan.training[key] == pytest.approx(config[key]), key
    assert plan.training["schedule"] == "cosine"


def test_training_on_a_runs_plan_takes_its_settings_unless_the_command_line_gives_them(trained, corpus, tmp_path):
    plan = Plan.load(trained / "plan.toml")
    tuned = tmp_path / "tuned.toml"
    Plan.from_dict({**plan.to_dict(), "training": {**plan.training, "lr": 1.25e-3, "beta2": 0.99,
                                                   "weight_decay": 0.05}}).save(tuned)
    again = tmp_path / "again"
    result = CliRunner().invoke(app, ["train", "--plan", str(tuned), "--data", str(corpus), "--out", str(again), *QUIET])
    assert result.exit_code == 0, result.output
    config = _start(again)["config"]
    assert (config["lr"], config["beta2"], config["weight_decay"]) == (1.25e-3, 0.99, 0.05)
    given = tmp_path / "given"
    result = CliRunner().invoke(app, ["train", "--plan", str(tuned), "--data", str(corpus), "--out", str(given),
                                      "--lr", "2e-3", *QUIET])
    assert result.exit_code == 0, result.output
    assert _start(given)["config"]["lr"] == 2e-3 and _start(given)["config"]["beta2"] == 0.99


def test_a_plan_without_a_training_table_still_loads(trained, tmp_path):
    data = Plan.load(trained / "plan.toml").to_dict()
    data.pop("training")
    old = Plan.from_dict(data)
    assert old.training == {} and "training" not in old.to_dict()


@pytest.mark.parametrize("table,needles", [
    ({"learning_rate": 1e-3}, ["[training]", "learning_rate", "lr, min_lr_ratio"]),
    ({"lr": "fast"}, ["[training] lr", "finite number"]),
    ({"lr": float("nan")}, ["[training] lr", "finite number"]),
    ({"schedule": 3}, ["schedule", "cosine, wsd"]),
])
def test_a_hostile_training_table_is_one_line(trained, corpus, tmp_path, table, needles):
    import tomli_w

    data = Plan.load(trained / "plan.toml").to_dict()
    data["training"] = table
    bad = tmp_path / "bad.toml"
    bad.write_text(tomli_w.dumps(data))
    result = CliRunner().invoke(app, ["train", "--plan", str(bad), "--data", str(corpus), "--out",
                                      str(tmp_path / "run"), *QUIET])
    one_line_error(result, *needles)

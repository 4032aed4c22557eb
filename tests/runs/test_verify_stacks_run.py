"""`memplan autotune --stack transformers --verify`, end to end: transformers' Trainer runs the emitted
TrainingArguments for a few real steps in a trial process, measured as memplan's own verify measures, and the
plan it verified is written (with its stack) and emitted."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.emit import render
from memplan.model import ModelSpec
from memplan.plan import Plan
from memplan.setup import TrainSetup

TINY = ModelSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=64, tied=False)

AUTOTUNE = ["autotune", "--arch", "llama", "--layers", "1", "--hidden", "128", "--heads", "4", "--ffn", "384",
            "--vocab", "4096", "--device", "cpu", "--ctx", "128", "--global-batch", "8", "--budget", "2GiB"]


@pytest.mark.slow
def test_verify_runs_transformers_trainer_and_writes_the_plan_it_measured(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a shared machine: one thread per trial (tests/unit/test_autotune.py)
    out, emitted = tmp_path / "plan.toml", tmp_path / "emitted"
    done = CliRunner().invoke(app, [*AUTOTUNE, "--stack", "transformers", "--precision", "fp32", "--verify", "--json",
                                    "--out", str(out), "--emit", str(emitted)])
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    verified = data["verified"]
    attempt = verified["attempts"][0]
    assert attempt["outcome"] == "fits" and attempt["steps"] == 3 and not attempt["error"], attempt
    assert verified["method"].startswith("transformers' Trainer with the emitted TrainingArguments")
    ratio = attempt["measured_peak"] / attempt["predicted_peak"]
    assert 0.9 < ratio < 1.1, ratio  # the project's bar for a measured CPU peak (benchmarks/local_memory.py)
    assert attempt["measured_tokens_per_second"] > 0
    text = out.read_text()
    assert 'stack = "transformers"' in text and "[verified]" in text
    args = json.loads((emitted / "training_args.json").read_text())
    assert args["per_device_train_batch_size"] == attempt["plan"]["micro_batch"]


@pytest.mark.slow
def test_the_transformers_trial_is_trainer_with_the_emitted_arguments(monkeypatch):
    """trial_steps runs transformers.Trainer itself, its TrainingArguments the emitted ones but for what a trial
    sets (its steps, the accumulation capped, a temporary output_dir), and reports each step's seconds."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch

    from trainer.stacks import StackModel, trial_steps

    seen, train = [], transformers.Trainer.train

    def recorded(self, *a, **kw):
        seen.append(self.args)
        return train(self, *a, **kw)

    monkeypatch.setattr(transformers.Trainer, "train", recorded)
    setup = TrainSetup(ctx=16, micro_batch=2, grad_accum=8, precision="fp32", optimizer="adamw")
    emitted = render(Plan(model=TINY, setup=setup), "transformers")
    seconds = []
    trial_steps("transformers", StackModel(spec=TINY), setup, setup.replace(grad_accum=2), 2, torch.device("cpu"),
                emitted=emitted, on_step=seconds.append)
    assert len(seen) == 1 and len(seconds) == 2 and all(s > 0 for s in seconds)
    args = seen[0]
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_steps) == (2, 2, 2)
    assert args.optim == "adamw_torch" and args.max_grad_norm == 1.0 and args.output_dir != "out"

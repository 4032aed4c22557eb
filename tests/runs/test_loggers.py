"""--log tensorboard|wandb: every scalar of metrics.jsonl reaches TensorBoard and W&B, read back with their own readers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from runs_helper import one_line_error, tiny_corpus

TINY = ["--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "2", "--kv-heads", "2", "--ffn", "128",
        "--ctx", "64", "--batch", "4", "--precision", "fp32", "--sample-tokens", "0", "--threads", "1",
        "--max-steps", "6", "--eval-every", "3", "--eval-batches", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return tiny_corpus(tmp_path_factory.mktemp("corpus"))


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_event_files_hold_every_scalar_of_metrics_jsonl(corpus, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--data", str(corpus), "--out", str(run), *TINY, "--log", "tensorboard"])
    assert result.exit_code == 0, result.output
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    lines = _metrics(run)
    train = [m for m in lines if m["kind"] == "train"]
    evals = [m for m in lines if m["kind"] == "eval"]
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [m["step"] for m in train]
    assert [e.value for e in loss] == pytest.approx([m["loss"] for m in train], rel=1e-6)
    for tag, key in (("train/lr", "lr"), ("train/tokens_per_second", "tokens_per_second"), ("train/mfu", "mfu"),
                     ("train/grad_norm", "grad_norm"), ("memory/measured_bytes", "memory_bytes")):
        assert [e.value for e in events.Scalars(tag)] == pytest.approx([m[key] for m in train], rel=1e-6), tag
    start = next(m for m in lines if m.get("event") == "start")
    predicted = [e.value for e in events.Scalars("memory/predicted_peak_bytes")]
    assert predicted == pytest.approx([start["predicted"]["peak_reserved"]] * len(train), rel=1e-6)
    assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx([m["eval_loss"] for m in evals], rel=1e-6)
    for source, loss in evals[-1]["eval_loss_by_source"].items():
        assert events.Scalars(f"eval/loss/{source}")[-1].value == pytest.approx(loss, rel=1e-6)
    assert "run/config/text_summary" in events.Tags()["tensors"]  # the plan and the predictions, as text


def test_wandb_offline_run_holds_the_config_and_the_history(corpus, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for key in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # not logged in: offline
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--data", str(corpus), "--out", str(run), *TINY, "--log", "wandb"])
    assert result.exit_code == 0, result.output
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run / "wandb").iterdir())
    log = list(offline[0].glob("run-*.wandb"))  # the run's transaction log, what `wandb sync` uploads
    assert len(log) == 1
    # read back with wandb's own reader of that log
    done = subprocess.run([str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--json", str(log[0])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    config = next(r["run"]["config"]["update"] for r in records if r["type"] == "run")
    assert config["setup.ctx"] == 64 and config["model.layers"] == 2 and config["predicted.peak_reserved"] > 0
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    train = [m for m in _metrics(run) if m["kind"] == "train"]
    logged = [h for h in history if "train/loss" in h]
    assert [h["_step"] for h in logged] == [m["step"] for m in train]
    assert [h["train/loss"] for h in logged] == pytest.approx([m["loss"] for m in train], rel=1e-6)
    assert [h["memory/measured_bytes"] for h in logged] == [m["memory_bytes"] for m in train]
    evals = [m for m in _metrics(run) if m["kind"] == "eval"]
    assert [h["eval/loss"] for h in history if "eval/loss" in h] == pytest.approx([m["eval_loss"] for m in evals])


@pytest.mark.parametrize("value,needles", [("csv", ["--log", "csv", "tensorboard, wandb"]),
                                           ("tensorboard,mlflow", ["--log", "mlflow"])])
def test_an_unknown_logger_is_one_line_before_anything_runs(value, needles, tmp_path):
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "run"), *TINY, "--log", value])
    one_line_error(result, *needles)
    assert not (tmp_path / "run").exists()


def test_a_missing_logging_library_names_the_extra(monkeypatch, tmp_path):
    import builtins

    from memplan.errors import InputError
    from trainer.loggers import TensorBoardLogger

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(InputError, match=r"memplan\[logging\]"):
        TensorBoardLogger(tmp_path)

"""How a run reaches its ranks: `python -m trainer RUN` is the one form a rank takes (it reads RUN/launch.json and
never parses memplan's options); the launch and the run's figures are library code the commands call."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("argv", [
    ["--data", "DATA", "--out", "RUN", "--max-steps", "2"],  # memplan train's options
    ["finetune", "--run", "RUN", "--data", "sft.jsonl", "--out", "FT"],  # memplan finetune's
    [],
])
def test_python_m_trainer_takes_a_run_directory_alone(argv, tmp_path, capsys, monkeypatch):
    """Anything but one run directory is one line naming the accepted form, exit code 2, and nothing written
    (no option is parsed, no run started)."""
    from trainer.__main__ import entry

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MEMPLAN_LAUNCHED_BY", raising=False)
    with pytest.raises(SystemExit) as e:
        entry(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("python -m trainer: error: python -m trainer RUN: one run directory, prepared by "
                             "`memplan train --nproc N --out RUN`"), err[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["train", "--max-steps", "1"],
                                     ["finetune", "--run", "RUN", "--data", "sft.jsonl", "--out", "FT"]])
def test_a_command_started_as_a_torchrun_rank_is_refused(command, tmp_path, monkeypatch):
    """`memplan train` / `memplan finetune` run as one of torchrun's ranks: refused in one line (the rank's form is
    `python -m trainer RUN`), before any process group is joined or anything is written."""
    from typer.testing import CliRunner

    from memplan.cli import app
    from runs_helper import one_line_error

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens: joining a group would fail, not hang
    result = CliRunner().invoke(app, command)
    one_line_error(result, "this process is one of 2 started by torchrun", "--nproc N` starts its ranks itself",
                   "python -m trainer RUN")
    assert list(tmp_path.iterdir()) == []


def test_the_summary_and_the_report_take_a_runs_steady_figures_from_one_function(tmp_path, capsys, monkeypatch):
    """``memplan train``'s closing summary and the run report give a recorded run's steady-state figures (peak
    memory, median tokens/s, median MFU) alike, both from ``trainer.records.steady_figures``: what it says, each
    shows (a stand-in's figures too, so neither computes its own)."""
    from memplan.cli.train import _print_summary
    from memplan.hardware import load_profile
    from memplan.plan import Plan
    from memplan.reports.run import build_run_page
    from memplan.setup import TrainSetup
    from memplan.units import format_bytes
    from runs_helper import tiny_corpus, tiny_spec
    from trainer import records
    from trainer.data import PreparedData
    from trainer.loop import TrainConfig, Trainer
    from trainer.rundir import metric_records

    prepared = PreparedData(tiny_corpus(tmp_path / "corpus"))
    plan = Plan(model=tiny_spec("llama", prepared.vocab_size), setup=TrainSetup(ctx=32, micro_batch=2,
                                                                                precision="fp32"), device="cpu")
    trainer = Trainer.start(tmp_path / "run", plan, prepared, TrainConfig(max_steps=6, sample_tokens=0,
                                                                         eval_batches=1), load_profile("cpu"))
    summary = trainer.run()

    def shown(figures: records.SteadyFigures) -> tuple[str, dict]:
        capsys.readouterr()
        _print_summary(trainer, summary, None)
        return capsys.readouterr().out, build_run_page(trainer.run_dir).summary

    recorded = records.steady_figures(metric_records(trainer.run_dir, latest=True))
    assert recorded.steps == 5 and recorded.peak_memory_bytes and recorded.tokens_per_second
    stand_in = records.SteadyFigures(steps=5, peak_memory_bytes=123 << 20, peak_allocated_bytes=45 << 20,
                                     tokens_per_second=98765.0, mfu=0.0321)
    for figures in (recorded, stand_in):
        if figures is stand_in:
            monkeypatch.setattr(records, "steady_figures", lambda lines: stand_in)
        cli, report = shown(figures)
        rate, memory = f"{figures.tokens_per_second:,.0f} tokens/s (median)", format_bytes(figures.peak_memory_bytes)
        assert f"throughput: {rate}" in cli and f"MFU {figures.mfu:.1%}" in cli, cli
        assert report["throughput"].startswith(rate) and f"MFU {figures.mfu:.1%}" in report["throughput"]
        assert f"measured peak {memory}," in cli and report["peak memory"].startswith(f"measured {memory} ")

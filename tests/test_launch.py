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

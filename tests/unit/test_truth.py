"""Small truths of issue 14 ("Every command tells the truth") that belong to no one command's tests:
the report's samples, an export's file modes, `memplan --version`."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memplan.cli import app


def test_report_samples_show_their_newlines_not_a_literal_backslash_n(tmp_path):
    from memplan.reports.run import write_run_report

    records = [
        {"kind": "event", "event": "start", "step": 0, "model": {"describe": "llama 1M"}, "setup": {},
         "predicted": {}, "device": "cpu", "torch_device": "cpu"},
        *({"kind": "train", "step": s, "loss": 5.0 - s / 10, "tokens": 64 * s} for s in range(1, 4)),
        {"kind": "eval", "step": 3, "eval_loss": 4.5, "eval_loss_by_source": {"docs": 4.5},
         "samples": [{"source": "docs", "prompt": "def parse(", "text": "x):\n    return x"}]},
    ]
    from runs_helper import whole_line  # the keys this test does not care about (the report reads them checked)

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(whole_line(r)) + "\n" for r in records))
    page = write_run_report(tmp_path).read_text()
    sample = page[page.index("Sample at step 3"):]
    sample = sample[:sample.index("</p>")]
    assert "x):\n    return x" in sample and "\\n" not in sample
    assert "white-space: pre-wrap" in page  # the note keeps the newline on screen


def test_an_exports_files_have_the_mode_a_normal_file_gets(tmp_path, one_torch_thread):
    """safetensors creates model.safetensors 0o600; an export's files all get 0o666 less the umask."""
    import os
    import stat

    from runs_helper import tiny_corpus, tiny_run

    run = tiny_run(tmp_path / "run", tiny_corpus(tmp_path / "data", n=60), steps=1)
    mask = os.umask(0o022)
    try:
        out = tmp_path / "hf"
        result = CliRunner().invoke(app, ["export", "--run", str(run), "--format", "hf", "--out", str(out)])
        assert result.exit_code == 0, result.output
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    finally:
        os.umask(mask)
    assert modes["model.safetensors"] == 0o644, oct(modes["model.safetensors"])
    assert set(modes.values()) == {0o644}, {k: oct(v) for k, v in modes.items()}


def test_version_prints_the_installed_version_and_exits_0(memplan_cli):
    from importlib import metadata

    import memplan

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"memplan {metadata.version('memplan')}\n"
    assert metadata.version("memplan") == memplan.__version__  # pyproject and the package agree
    out = memplan_cli("--version", timeout=60)  # as a user runs it, in a process of its own
    assert out.returncode == 0 and out.stdout.strip() == f"memplan {memplan.__version__}"


def test_a_size_name_says_what_it_fixes_when_the_vocabulary_changes_the_count():
    """--params 22m is 22.9M at vocab 32,000; with the data's 8,192-token vocabulary (train replaces
    the vocab) it is 13.8M: the count and what the name fixes are said beside the name."""
    from memplan.model import from_size, resolve

    spec = from_size("22m").replace(vocab=8192)  # what `memplan train --params 22m` trains on such data
    note = spec.size_note()
    assert "22m is 22,909,824 parameters at vocab 32,000" in note
    assert "the 6 blocks" in note and f"this model has {spec.params:,}" in note and spec.params == 13_767_552
    assert from_size("22m").size_note() == ""  # the count is the named one: nothing to say
    out = CliRunner().invoke(app, ["estimate", "--params", "22m", "--vocab", "8192", "--device", "rtx-4090"])
    assert out.exit_code == 0 and "the name fixes the 6 blocks" in " ".join(out.stdout.split())
    assert "changed from it" in resolve(params="22m", layers=4).size_note()


def test_a_suffixed_count_is_shown_resolved_with_the_rule():
    """256k tokens is 256,000 (a count), 1k of context is 1024: the resolved number is printed. The
    parses themselves are unchanged (scripts rely on them)."""
    from memplan.units import parse_count

    assert parse_count("256k", "--global-batch-tokens") == 256_000 and parse_count("1k", "--ctx", binary=True) == 1024
    out = CliRunner().invoke(app, ["autotune", "--params", "22m", "--device", "rtx-4090", "--ctx", "1k",
                                   "--global-batch-tokens", "256k", "--tokens", "2b"])
    text = " ".join(out.stdout.split())
    assert out.exit_code == 0, out.output
    assert "--global-batch-tokens 256k = 256,000; --tokens 2b = 2,000,000,000" in text
    assert "only a context length's k is 1024" in text
    est = CliRunner().invoke(app, ["estimate", "--params", "22m", "--device", "rtx-4090", "--tokens", "5m"])
    assert "--tokens 5m = 5,000,000" in " ".join(est.stdout.split())
    plain = CliRunner().invoke(app, ["autotune", "--params", "22m", "--device", "rtx-4090", "--ctx", "1024",
                                     "--global-batch-tokens", "262144"])
    assert "powers of 1000" not in plain.stdout  # numbers written out need no rule

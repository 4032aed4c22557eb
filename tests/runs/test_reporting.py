"""RUN/report.html is rendered in a process of its own (trainer/reporting.py), so the training process
never holds plotly's or the page's memory (on a CPU, that memory is the training's measured peak)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runs_helper import tiny_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return tiny_corpus(tmp_path_factory.mktemp("corpus"))


def tiny_trainer(run: Path, corpus: Path, steps: int = 4):
    from memplan.hardware import load_profile
    from memplan.plan import Plan
    from memplan.setup import TrainSetup
    from runs_helper import tiny_spec
    from trainer.data import PreparedData
    from trainer.loop import TrainConfig, Trainer

    prepared = PreparedData(corpus)
    plan = Plan(model=tiny_spec("llama", prepared.vocab_size), setup=TrainSetup(ctx=64, micro_batch=4), device="cpu")
    return Trainer.start(run, plan, prepared, TrainConfig(max_steps=steps, lr=3e-3, sample_tokens=0, save_every=2,
                                                          eval_every=2, eval_batches=1), load_profile("cpu"))


def test_the_training_process_renders_its_reports_without_importing_plotly(corpus, tmp_path):
    """A run that refreshes its report at every checkpoint and writes it at the end, in a fresh interpreter:
    the page is written, and plotly was never imported by the process that trained."""
    script = f"""
import sys
sys.path[:0] = [{str(ROOT / 'tests' / 'runs')!r}, {str(ROOT / 'tests')!r}]
from pathlib import Path
import trainer.loop as loop
loop.REPORT_REFRESH_SECONDS = 0.0  # every checkpoint refreshes the report
from test_reporting import tiny_trainer
summary = tiny_trainer(Path({str(tmp_path / 'run')!r}), Path({str(corpus)!r})).run()
print(summary.report)
print(sorted(m for m in sys.modules if m.split('.')[0] == 'plotly'))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report, plotly_modules = r.stdout.strip().splitlines()[-2:]
    assert Path(report) == tmp_path / "run" / "report.html"
    page = Path(report).read_text()
    assert "Training run" in page and "Plotly.newPlot" in page
    assert plotly_modules == "[]"
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not [line for line in lines if line.get("event") == "report_failed"]


def test_a_failed_render_is_one_report_failed_line_and_the_run_goes_on(corpus, tmp_path, monkeypatch):
    from trainer import reporting

    monkeypatch.setattr(reporting, "_command", lambda run_dir: [
        sys.executable, "-c", "import sys; print('ValueError: the page broke', file=sys.stderr); sys.exit(1)"])
    run = tmp_path / "run"
    summary = tiny_trainer(run, corpus).run()
    assert summary.step == 4 and summary.report is None
    assert not (run / "report.html").exists()
    failed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"report_failed"' in line]
    assert [(f["step"], f["error"]) for f in failed] == [(4, "ValueError: the page broke")]


def test_a_refresh_while_a_render_runs_starts_no_second_and_write_waits_for_both(tmp_path, monkeypatch):
    from trainer import reporting

    started = []

    def command(run_dir):
        started.append(len(started))
        return [sys.executable, "-c", f"import time, pathlib; time.sleep(0.5); "
                                      f"pathlib.Path({str(run_dir)!r}, 'render-{len(started)}').touch()"]

    monkeypatch.setattr(reporting, "_command", command)
    renderer = reporting.ReportRenderer(tmp_path, on_failure=pytest.fail)
    renderer.refresh()
    assert renderer.running
    renderer.refresh()  # the first is still asleep: skipped
    assert started == [0]
    assert renderer.write() == tmp_path / "report.html"
    assert started == [0, 1] and not renderer.running
    assert sorted(p.name for p in tmp_path.iterdir()) == ["render-1", "render-2"]


def test_the_renderer_exits_3_on_a_full_disk_and_the_trainer_reads_it_as_enospc(tmp_path, monkeypatch):
    import errno

    from memplan.reports import run as run_report
    from trainer import reporting

    def full(run_dir, flag=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(run_dir))

    monkeypatch.setattr(run_report, "write_run_report", full)
    assert run_report.main([str(tmp_path)]) == reporting.NO_SPACE_EXIT
    monkeypatch.setattr(reporting, "_command", lambda run_dir: [
        sys.executable, "-c", f"import sys; sys.exit({reporting.NO_SPACE_EXIT})"])
    renderer = reporting.ReportRenderer(tmp_path, on_failure=pytest.fail)
    with pytest.raises(OSError) as e:
        renderer.write()
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "report.html")

"""Who owns what on the trainer side (issue 16): the run directory's file names are spelled in trainer/rundir.py
alone, and the library below the command line never imports it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from test_device import _import_graph, _reaches  # the package's import graph, lazy imports included

ROOT = Path(__file__).resolve().parents[2]

# The names of a run directory's files (trainer/rundir.py: RUN_FILE, METRICS_FILE, CHECKPOINT_DIR, ...).
RUN_DIR_NAMES = {"run.json", "metrics.jsonl", "checkpoints", "plan.toml", "report.html", "launch.json",
                 "tokenizer.json"}
# Modules that spell one of those strings for something else: a tokenizer file of any directory (a prepared
# corpus's too), a Hugging Face checkpoint's own layout (imported, or exported in its format).
OTHER_MEANINGS = {"trainer/tokenizer.py", "trainer/hf_import.py", "trainer/export/hf.py"}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _run_dir_spellings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    return [f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
            and node.value in RUN_DIR_NAMES]


def test_the_run_directorys_file_names_are_spelled_in_rundir_alone():
    """Paths into RUN/ are built from trainer.rundir's names (``rundir.REPORT_FILE``, ...), in the trainer, the
    commands that read runs and the run report: a file renamed in one place only would split the run in two."""
    modules = [*sorted((ROOT / "trainer").rglob("*.py")), *[ROOT / "memplan" / "cli" / f"{name}.py" for name in (
        "train", "finetune", "generate", "eval", "export")], ROOT / "memplan" / "reports" / "run.py"]
    found = [hit for path in modules if str(path.relative_to(ROOT)) not in OTHER_MEANINGS | {"trainer/rundir.py"}
             for hit in _run_dir_spellings(path)]
    assert found == []


def test_a_report_alone_starts_no_torch(tmp_path):
    """`memplan train --report --out RUN` draws the report from RUN/metrics.jsonl: nothing of it needs torch
    (it imported trainer.loop for two file names)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom memplan.cli import app\n"
            f"r = CliRunner().invoke(app, ['train', '--report', '--out', {str(run)!r}])\n"
            "assert r.exit_code == 0, r.output\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert (run / "report.html").is_file()


# ---- the library below the command line ----------------------------------------------------------------------

# Modules of trainer/ that import memplan.cli on purpose: the torchrun rank's entry point, which renders the run as
# `memplan train` does. (The calibration's runtime context is measured with the modules its caller names.)
CLI_IMPORTERS = {"trainer.__main__": "the rank's entry point renders through memplan.cli.train"}


def test_the_trainer_library_never_imports_the_command_line():
    """Flags are parsed into values by the CLI or by the planner's own parsers (``memplan.model.resolve``,
    ``memplan.setup.setup_from_flags``, ``memplan.hardware.device_from_flags``); the library that resolves and
    runs a request imports no CLI module (trainer.request, now trainer.train_run, took three parsers and a file writer from it)."""
    graph = _import_graph("trainer", "memplan")
    importers = {m: sorted(d for d in deps if d == "memplan.cli" or d.startswith("memplan.cli."))
                 for m, deps in graph.items() if m.startswith("trainer") and m not in CLI_IMPORTERS}
    assert {m: d for m, d in importers.items() if d} == {}



def test_the_metrics_file_is_written_and_read_by_the_run_directory(tmp_path):
    """RUN/metrics.jsonl has one owner, trainer.rundir: its ``MetricsWriter`` appends the typed records that
    ``metric_records`` reads back, and after a kill cut a line short the next record starts a line of its own
    (the cut one is skipped by the reader)."""
    from trainer import records, rundir

    (tmp_path / rundir.METRICS_FILE).write_text('{"kind": "train", "step": 1, "lo')  # a kill, mid-line
    line = records.CheckpointEvent(step=2, path="RUN/checkpoints/step-00000002", seconds=0.5)
    writer = rundir.MetricsWriter(tmp_path)
    writer.write(line)
    writer.sync()
    writer.close()
    assert rundir.metric_records(tmp_path) == [line]
    assert (tmp_path / rundir.METRICS_FILE).read_text().endswith("\n" + records.dumps(line) + "\n")


def test_no_import_cycle_runs_across_the_planner_the_command_line_and_the_trainer():
    """No module of memplan/ or trainer/ reaches itself again through the two packages' imports, lazy ones
    included (memplan.cli -> memplan.cli.calibrate -> trainer.calibrate -> memplan.cli was the last: the
    calibration imported the command line to measure what `memplan train` holds; its caller names it now)."""
    graph = _import_graph("trainer", "memplan")
    assert sorted(m for m in graph if _reaches(graph, m, m)) == []


def test_the_planning_of_a_run_reaches_neither_the_trainer_nor_torch():
    """memplan.planning (the quick start's model, a plan of flags, autotune's plan, the plan for N processes) and
    memplan.local_calibration (the calibration cache) are the planner's: through every import, lazy ones included,
    they reach no trainer or CLI module, and their own code imports no torch (what needs torch is passed in)."""
    graph = _import_graph("trainer", "memplan")
    for module in ("memplan.planning", "memplan.local_calibration"):
        reached = {m for m in graph if _reaches(graph, module, m)}
        assert sorted(m for m in reached if m.split(".")[0] == "trainer" or m.startswith("memplan.cli")) == []
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert sorted(m for m in imported if m.split(".")[0] in ("torch", "trainer")) == [], module

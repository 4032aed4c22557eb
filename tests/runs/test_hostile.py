"""Hostile inputs, kill -9 and concurrent writers (issue 14, items 12-15).

12. A run killed before its first checkpoint resumes as itself (RUN/run.json), and ``--resume`` on a
    directory that holds no run refuses instead of starting a quick start.
13. A file planted in a checkpoint (a ``dcp/.metadata`` that torch.distributed.checkpoint would
    unpickle) is refused before anything is read: the checkpoint's manifest covers every file; and
    sharded state is read with a restricted unpickler, so even a crafted listed .metadata runs nothing.
14. Planted symlinks at the old predictable temporary names (``report.html.tmp``, ``X.html.tmp``,
    ``plan.toml.tmp``) or at ``metrics.jsonl`` are never written through.
15. A second writer of a run or of a corpus is refused with the PID that holds it; a killed holder's
    lock is taken over; simultaneous atomic writes of one file never collide.

Every run is the tiny Llama of tests/runs/test_train.py on the tiny corpus of tests/runs_helper.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import InputError
from memplan.hardware import load_profile
from memplan.plan import Plan
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from trainer import checkpoint_format as ckpt
from trainer.data import PreparedData
from trainer.loop import TrainConfig, Trainer
from trainer.rundir import read_metrics
from runs_helper import one_line_error, story, tiny_corpus

REPO = Path(__file__).resolve().parents[2]
TINY = ["--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "2", "--kv-heads", "2", "--ffn", "128",
        "--ctx", "64", "--batch", "4", "--precision", "fp32", "--sample-tokens", "0"]
FOREVER = ["--max-steps", "1000000", "--save-every", "1000000", "--eval-every", "1000000"]  # killed long before


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return tiny_corpus(tmp_path_factory.mktemp("corpus"))


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}


def spawn(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "memplan", *args], env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, **kw)


def wait_for(condition, proc: subprocess.Popen | None = None, seconds: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the process ended (exit {proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.005)


def train_steps(run: Path) -> list[int]:
    return [l["step"] for l in read_metrics(run) if l.get("kind") == "train"]


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def tiny_trained(run: Path, corpus: Path, steps: int = 2) -> Path:
    prepared = PreparedData(corpus)
    spec = ModelSpec(arch="llama", layers=2, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=prepared.vocab_size,
                     tied=True)
    plan = Plan(model=spec, setup=TrainSetup(ctx=64, micro_batch=4, precision="fp32"), device="cpu")
    Trainer.start(run, plan, prepared, TrainConfig(max_steps=steps, sample_tokens=0), load_profile("cpu")).run()
    return run


# ---- 12: a run killed before its first checkpoint resumes as itself -----------------------------------

def test_resume_after_a_kill_before_the_first_checkpoint_continues_that_run(tmp_path, corpus):
    run = tmp_path / "run"
    proc = spawn("train", "--data", str(corpus), "--out", str(run), *TINY, *FOREVER)
    try:
        wait_for(lambda: len(train_steps(run)) >= 2, proc, what="two training steps")
    finally:
        kill(proc)
    assert not list((run / "checkpoints").glob("step-*")), "killed after a checkpoint: not the case under test"
    plan_before = Plan.load(run / "plan.toml")

    result = cli("train", "--out", str(run), "--resume", "--max-steps", "3")  # the data, plan, seed: the run's
    assert result.exit_code == 0, result.output[-3000:]
    assert "Model for a" not in result.output  # no quick start
    plan_after = Plan.load(run / "plan.toml")
    assert plan_after.model == plan_before.model and plan_after.setup == plan_before.setup
    meta = ckpt.read_meta(ckpt.latest_checkpoint(run / "checkpoints").path)
    assert meta["data"]["path"] == str(corpus.resolve())
    assert Plan.from_dict(meta["plan"]).model == plan_before.model
    starts = [l for l in read_metrics(run) if l.get("event") in ("start", "resume")]
    assert len(starts) == 2
    assert {Path(l["data"]).resolve() for l in starts} == {corpus.resolve()}
    assert {l["model"]["describe"] for l in starts} == {plan_before.model.describe()}
    # from step 0 again, to the new limit (the killed process may have logged more steps than the two waited for:
    # train lines reach the file in batches)
    lines = read_metrics(run)
    resumed = lines[max(i for i, l in enumerate(lines) if l.get("event") in ("start", "resume")):]
    assert [l["step"] for l in resumed if l.get("kind") == "train"] == [1, 2, 3]


@pytest.mark.parametrize("what", ["missing", "empty", "not a run"])
def test_resume_refuses_a_directory_that_holds_no_run(tmp_path, what):
    run = tmp_path / "run"
    if what != "missing":
        run.mkdir()
    if what == "not a run":
        (run / "notes.txt").write_text("hello")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    line = one_line_error(cli("train", "--out", str(run), "--resume", "--max-steps", "1"), "--resume", str(run))
    assert {"missing": "does not exist", "empty": "holds no run", "not a run": "holds no run"}[what] in line
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written, nothing trained


# ---- 13: nothing planted in a checkpoint is read ------------------------------------------------------------

class _Planted:
    """Unpickling this creates the file ``marker`` (as any code a pickle can run)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_dcp_metadata_is_refused_before_it_is_unpickled(tmp_path, corpus):
    run = tiny_trained(tmp_path / "run", corpus)
    newest = ckpt.latest_checkpoint(run / "checkpoints").path
    marker = tmp_path / "code-ran"
    (newest / "dcp").mkdir()
    (newest / "dcp" / ".metadata").write_bytes(pickle.dumps(_Planted(str(marker))))
    result = cli("train", "--out", str(run), "--resume", "--max-steps", "3")
    assert not marker.exists(), "a pickle planted in the checkpoint was unpickled"
    one_line_error(result, "dcp/.metadata", "not listed")


def test_sharded_state_is_read_without_running_what_a_crafted_metadata_holds(tmp_path):
    """Beyond the checksums (a checkpoint whose meta.json was rewritten too): DCP's .metadata is read by an
    unpickler that builds only checkpoint metadata, so a crafted one is refused and runs nothing."""
    import warnings

    from trainer import distributed

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        distributed.save_sharded(tmp_path / "dcp", model, optimizer)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        distributed.load_sharded(tmp_path / "dcp", model, optimizer)  # what it wrote, it reads
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        marker = tmp_path / "code-ran"
        (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Planted(str(marker))))
        with pytest.raises(InputError, match=r"\.metadata: holds .*open"):
            distributed.load_sharded(tmp_path / "dcp", model, optimizer)
    assert not marker.exists()


@pytest.mark.parametrize("plant", ["extra file", "symlink"])
def test_a_checkpoint_holds_only_the_files_its_manifest_lists(tmp_path, corpus, plant):
    run = tiny_trained(tmp_path / "run", corpus)
    newest = ckpt.latest_checkpoint(run / "checkpoints").path
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    if plant == "extra file":
        (newest / "extra.bin").write_bytes(b"x")
    else:
        (newest / "linked.bin").symlink_to(outside)
    with pytest.raises(InputError, match="extra.bin|linked.bin"):
        ckpt.verify_checkpoint(newest)


# ---- 14: planted symlinks are never written through -------------------------------------------------------

def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    return victim


def test_train_report_does_not_write_through_a_planted_temporary_name(tmp_path, corpus):
    run = tiny_trained(tmp_path / "run", corpus)
    victim = _victim(tmp_path)
    (run / "report.html.tmp").symlink_to(victim)
    result = cli("train", "--out", str(run), "--report")
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "precious"
    assert (run / "report.html").is_file() and not (run / "report.html").is_symlink()


def test_sweep_html_does_not_write_through_a_planted_temporary_name(tmp_path):
    victim = _victim(tmp_path)
    page = tmp_path / "sweep.html"
    (tmp_path / "sweep.html.tmp").symlink_to(victim)
    result = cli("sweep", "--params", "124m", "--device", "rtx-4090", "--ctx", "1k", "--batch", "1,2",
                 "--html", str(page))
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "precious"
    assert page.is_file() and not page.is_symlink()


def test_autotune_out_does_not_write_through_a_planted_temporary_name(tmp_path):
    victim = _victim(tmp_path)
    path = tmp_path / "plan.toml"
    (tmp_path / "plan.toml.tmp").symlink_to(victim)
    result = cli("autotune", "--params", "124m", "--device", "rtx-4090", "--ctx", "2048", "--out", str(path))
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "precious"
    assert not path.is_symlink() and Plan.load(path).model.params > 0


def test_a_metrics_file_that_is_a_symlink_is_refused(tmp_path, corpus):
    run = tiny_trained(tmp_path / "run", corpus)
    victim = _victim(tmp_path)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(victim)
    one_line_error(cli("train", "--out", str(run), "--resume", "--max-steps", "3"), "metrics.jsonl", "symbolic link")
    assert victim.read_text() == "precious"


# ---- 15: one writer at a time ------------------------------------------------------------------------------

def test_two_trainings_into_one_out_the_second_is_refused_naming_the_first(tmp_path, corpus):
    run = tmp_path / "run"
    args = ("train", "--data", str(corpus), "--out", str(run), *TINY, *FOREVER)
    procs = [spawn(*args), spawn(*args)]  # at once, into a directory that does not exist yet
    try:
        wait_for(lambda: any(p.poll() is not None for p in procs), seconds=60, what="one of two runs to stop")
        loser = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not loser)
        assert loser.returncode == 2, loser.stderr.read()[-3000:]
        lines = loser.stderr.read().strip().splitlines()
        assert len(lines) == 1 and f"PID {winner.pid}" in lines[0], lines
        wait_for(lambda: len(train_steps(run)) >= 1, winner, what="the winner to train")
        # while it trains, a resume is refused too, naming it
        one_line_error(cli("train", "--out", str(run), "--resume", "--data", str(corpus)), f"PID {winner.pid}")
    finally:
        for p in procs:
            kill(p)
    starts = [l for l in read_metrics(run) if l.get("event") in ("start", "resume")]
    assert len(starts) == 1  # one run's lines only
    # the holder died by SIGKILL: its lock file is left behind, and taken over
    assert (run / ".lock").read_text().strip() == str(winner.pid)
    result = cli("train", "--out", str(run), "--resume", "--max-steps", "2")
    assert result.exit_code == 0, result.output
    assert not (run / ".lock").exists()


def test_two_prepares_into_one_new_out_the_second_is_refused_naming_the_first(tmp_path):
    src = tmp_path / "stories.jsonl"
    src.write_text("".join(json.dumps({"text": story(i)}) + "\n" for i in range(2000)))
    out = tmp_path / "corpus"
    args = ("prepare", "--input", str(src), "--out", str(out), "--tokenizer", "bpe:320", "--workers", "1")
    first = spawn(*args)
    try:
        wait_for(lambda: any(tmp_path.glob(".corpus.prepare-*")), first, what="the first prepare to start")
        os.kill(first.pid, signal.SIGSTOP)  # caught in the middle, holding the corpus
        one_line_error(cli(*args), f"PID {first.pid}", str(out))
        os.kill(first.pid, signal.SIGCONT)
        assert first.wait(timeout=60) == 0, first.stderr.read()[-3000:]
    finally:
        os.kill(first.pid, signal.SIGCONT) if first.poll() is None else None
        kill(first)
    manifest = (out / "manifest.json").read_bytes()
    one_line_error(cli(*args), "--force")  # and afterwards, without --force, it stays the first's
    assert (out / "manifest.json").read_bytes() == manifest
    assert not list(tmp_path.glob(".corpus.*"))  # no lock, temporary or old directory left behind


def _write_report_many(path: str, times: int) -> str | None:
    from memplan.reports.page import Page, write_page

    try:
        for i in range(times):
            write_page(Page(title="Training run", model="tiny", device="cpu", notes=[str(os.getpid()), str(i)]),
                       path)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_simultaneous_reports_of_one_run_do_not_collide(tmp_path):
    path = tmp_path / "report.html"
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(6) as pool:
        errors = pool.starmap(_write_report_many, [(str(path), 60)] * 6)
    assert errors == [None] * 6
    assert "Training run" in path.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary file left

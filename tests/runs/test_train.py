"""memplan train: the loop, the run directory, resuming bit-identically after SIGKILL, out-of-memory and
non-finite recovery, incompatible resumes, corrupt inputs, and the report.

Every run trains a tiny Llama (2 layers, hidden 64) on a two-source corpus prepared once per module
(CPython's pydoc topics and a generated .jsonl), a few steps at a time.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
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
from memplan.model import ModelSpec
from memplan.plan import Plan
from memplan.setup import TrainSetup
from trainer import data
from trainer.data import PreparedData
from trainer.loop import TrainConfig, Trainer
from trainer.rundir import read_metrics
from trainer.schedule import Schedule
from trainer.stopping import TrainingStopped

REPO = Path(__file__).resolve().parents[2]
TINY = ["--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "2", "--kv-heads", "2", "--ffn", "128",
        "--ctx", "64", "--precision", "fp32"]


# ---- fixtures and helpers -----------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine, two OpenMP threads wait on each other for
    milliseconds per op whenever another process holds a core (tiny models run 10-80x slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _story(i: int) -> str:
    animals = ["cat", "dog", "owl", "fox", "bee", "elk", "yak", "ant"]
    places = ["garden", "river", "forest", "city", "meadow", "harbour"]
    return (f"Story {i}. Once upon a time a {animals[i % 8]} walked to the {places[i % 6]}. "
            f"It met a {animals[(i * 3 + 1) % 8]} and they talked about the number {i * 37 % 101}. "
            f"Then the {animals[i % 8]} went home and slept until morning.")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """pydoc topics (120 documents) and 300 generated stories, a 384-token BPE, 10% held out per source."""
    root = tmp_path_factory.mktemp("corpus")
    stories = root / "stories.jsonl"
    stories.write_text("".join(json.dumps({"text": _story(i)}) + "\n" for i in range(300)))
    sources = [s for s in data.embedded_sources() if s.name == "pydoc"] + data.resolve_inputs([str(stories)])
    out = root / "prepared"
    data.prepare(sources, out, data.PrepareConfig(tokenizer="bpe:384", workers=1, max_docs=120, val_fraction=0.1))
    return out


def tiny_plan(vocab: int, micro_batch: int = 4, grad_accum: int = 1, **setup) -> Plan:
    spec = ModelSpec(arch="llama", layers=2, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=vocab, tied=True)
    return Plan(model=spec, setup=TrainSetup(ctx=64, micro_batch=micro_batch, grad_accum=grad_accum,
                                             precision="fp32", **setup), device="cpu")


def start(run_dir: Path, corpus: Path, plan: Plan | None = None, **config) -> Trainer:
    prepared = PreparedData(corpus)
    config.setdefault("sample_tokens", 4)
    return Trainer.start(run_dir, plan or tiny_plan(prepared.vocab_size), prepared, TrainConfig(**config),
                         load_profile("cpu"))


def cli(*args: str):
    return CliRunner().invoke(app, ["train", *args])


def assert_one_line_error(result, *needles: str, code: int = 2) -> str:
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle.lower() in lines[0].lower(), (needle, lines[0])
    return lines[0]


def losses(run_dir: Path) -> dict[int, float]:
    return {l["step"]: l["loss"] for l in read_metrics(run_dir, latest=True) if l.get("kind") == "train"}


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def memplan_subprocess(*args: str) -> list[str]:
    return [sys.executable, "-m", "memplan", "train", *args]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}


# ---- the schedule -------------------------------------------------------------------------------------

def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    s = Schedule(peak_lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=110)
    assert s.lr(1) == pytest.approx(1e-4)  # 1/10 of the peak
    assert s.lr(10) == pytest.approx(1e-3)
    assert s.lr(60) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half-way through the decay: cos(pi/2) = 0
    assert s.lr(110) == pytest.approx(1e-4)
    assert s.lr(500) == pytest.approx(1e-4)  # past the end: the floor
    assert all(s.lr(k) >= s.lr(k + 1) for k in range(10, 120))


def test_wsd_schedule_holds_the_peak_until_the_decay_is_fixed_then_decays_like_cosine():
    s = Schedule(peak_lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=100, kind="wsd")
    assert s.lr(5) == pytest.approx(5e-4) and not s.fixed
    assert s.lr(10) == s.lr(500) == 1e-3  # no decay before its length is known
    d = s.with_decay(last_stable_step=300, decay_steps=100)
    assert d.fixed and d.total_steps == 400
    assert d.lr(300) == 1e-3 and d.lr(350) == pytest.approx(1e-4 + 0.5 * 9e-4) and d.lr(400) == pytest.approx(1e-4)


def test_train_config_rejects_bad_values():
    for bad in (dict(lr=0), dict(lr=-1e-3), dict(max_steps=0), dict(min_lr_ratio=1.5), dict(eval_batches=0),
                dict(beta2=1.0), dict(clip=-1.0), dict(keep=0)):
        with pytest.raises(InputError):
            TrainConfig(**bad)


# ---- a run and its directory --------------------------------------------------------------------------

def test_a_run_writes_the_contract_run_directory(tmp_path, corpus):
    run = tmp_path / "run"
    summary = start(run, corpus, max_steps=6, eval_every=3, save_every=3, keep=1).run()
    assert summary.step == 6 and summary.stop_reason == "max_steps"
    assert summary.tokens == 6 * 4 * 64
    lines = read_metrics(run)
    train = [l for l in lines if l["kind"] == "train"]
    assert [l["step"] for l in train] == [1, 2, 3, 4, 5, 6]
    for l in train:
        assert isinstance(l["loss"], float) and math.isfinite(l["loss"])
        assert l["tokens_per_second"] > 0 and l["memory_bytes"] > 0 and l["step_seconds"] > 0
    evals = [l for l in lines if l["kind"] == "eval"]
    assert [e["step"] for e in evals] == [3, 6]
    assert set(evals[-1]["eval_loss_by_source"]) == {"pydoc", "stories"}
    assert evals[-1]["eval_ppl"] == pytest.approx(math.exp(evals[-1]["eval_loss"]))
    assert len(evals[-1]["samples"]) == 2  # one per source, prompted by its first held-out document
    assert lines[0]["event"] == "start" and lines[-1]["event"] == "stop"
    # plan.toml is the plan trained on; one checkpoint kept; the report exists
    assert Plan.load(run / "plan.toml").setup == tiny_plan(PreparedData(corpus).vocab_size).setup
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000006"]
    html = (run / "report.html").read_text()
    assert "Training run" in html and html.count('class="plot"') == 4


def test_training_lowers_the_held_out_loss(tmp_path, corpus):
    run = tmp_path / "run"
    start(run, corpus, max_steps=30, eval_every=30, lr=3e-3, warmup_steps=3).run()
    first = next(l["loss"] for l in read_metrics(run) if l["kind"] == "train")
    final = [l for l in read_metrics(run) if l["kind"] == "eval"][-1]
    assert final["eval_loss"] < first - 0.5, (first, final["eval_loss"])  # ln(384) = 5.95 at the start


def test_a_new_run_refuses_a_directory_that_holds_one(tmp_path, corpus):
    run = tmp_path / "run"
    start(run, corpus, max_steps=1).run()
    before = snapshot(run)
    with pytest.raises(InputError, match="already holds a run"):
        start(run, corpus, max_steps=1)
    assert snapshot(run) == before


def test_cli_trains_from_model_and_setup_flags(tmp_path, corpus):
    run = tmp_path / "run"
    result = cli("--data", str(corpus), "--out", str(run), *TINY, "--batch", "2", "--grad-accum", "2",
                 "--max-steps", "3", "--eval-every", "3", "--sample-tokens", "4")
    assert result.exit_code == 0, result.output
    assert "Done" in result.stdout and "Sample" in result.stdout
    plan = Plan.load(run / "plan.toml")
    assert (plan.setup.micro_batch, plan.setup.grad_accum, plan.setup.ctx) == (2, 2, 64)
    assert plan.model.vocab == PreparedData(corpus).vocab_size  # the vocabulary comes from the data
    assert [l["step"] for l in read_metrics(run) if l["kind"] == "train"] == [1, 2, 3]


def test_cli_trains_a_plan_file(tmp_path, corpus):
    plan_file = tmp_path / "plan.toml"
    tiny_plan(PreparedData(corpus).vocab_size, micro_batch=2).save(plan_file)
    run = tmp_path / "run"
    result = cli("--plan", str(plan_file), "--data", str(corpus), "--out", str(run), "--max-steps", "2",
                 "--sample-tokens", "0")
    assert result.exit_code == 0, result.output
    assert Plan.load(run / "plan.toml").setup == Plan.load(plan_file).setup


def test_cli_rejects_a_vocabulary_that_conflicts_with_the_data(tmp_path, corpus):
    result = cli("--data", str(corpus), "--out", str(tmp_path / "run"), *TINY, "--batch", "2", "--vocab", "32000")
    assert_one_line_error(result, "--vocab 32000", "384")
    assert not (tmp_path / "run").exists()


def test_cli_rejects_plan_together_with_model_options(tmp_path, corpus):
    result = cli("--plan", str(tmp_path / "p.toml"), "--layers", "2", "--data", str(corpus))
    assert_one_line_error(result, "--plan")


def test_time_limited_run_fixes_its_schedule_from_timed_steps(tmp_path, corpus):
    run = tmp_path / "run"
    trainer = start(run, corpus, max_minutes=0.1, sample_tokens=0)
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    summary = trainer.run()
    assert summary.stop_reason == "max_minutes"
    lines = read_metrics(run)
    assert lines[0]["schedule"]["kind"] == "wsd" and lines[0]["schedule"]["decay_start"] is None
    decay = [l for l in lines if l.get("event") == "decay"]
    assert len(decay) == 1 and trainer.schedule.decay_start == decay[0]["step"]  # fixed once, 80% into the time
    train = [l for l in lines if l["kind"] == "train"]
    peak = trainer.config.lr
    assert all(l["lr"] == peak for l in train if trainer.schedule.warmup_steps < l["step"] <= decay[0]["step"])
    assert train[-1]["lr"] < peak  # decaying at the end
    assert lines[-1]["wall_seconds"] <= 6.0 + 2.0
    # the probe steps ran at learning rate 0: step 1's loss is the untrained model's
    first = start(tmp_path / "fresh", corpus, max_steps=1, sample_tokens=0)
    assert all(torch.equal(weights[k], v) for k, v in first.model.state_dict().items())
    first.run()
    assert losses(run)[1] == losses(tmp_path / "fresh")[1]


def test_report_can_be_rewritten_on_demand(tmp_path, corpus):
    run = tmp_path / "run"
    start(run, corpus, max_steps=2).run()
    (run / "report.html").unlink()
    result = cli("--out", str(run), "--report")
    assert result.exit_code == 0, result.output
    assert (run / "report.html").is_file()
    assert_one_line_error(cli("--out", str(tmp_path / "nothing"), "--report"), "metrics.jsonl")


# ---- resuming -----------------------------------------------------------------------------------------

def test_resume_after_sigkill_gives_bit_identical_losses(tmp_path, corpus):
    """20 steps straight; 10+ steps, SIGKILL, resume to 20: every loss the same, bit for bit."""
    args = ["--data", str(corpus), *TINY, "--batch", "4", "--grad-accum", "2", "--max-steps", "20",
            "--save-every", "5", "--eval-every", "10", "--sample-tokens", "4", "--seed", "3"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    uninterrupted = subprocess.Popen(memplan_subprocess(*args, "--out", str(straight)), env=env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(memplan_subprocess(*args, "--out", str(killed)), env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            done = [p.name for p in (killed / "checkpoints").glob("step-*")] if (killed / "checkpoints").is_dir() else []
            if any(int(n.split("-")[1]) >= 10 for n in done):
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    steps_before = max(losses(killed))
    assert 10 <= steps_before < 20, f"killed after step {steps_before}; nothing would be left to resume"

    result = subprocess.run(memplan_subprocess("--out", str(killed), "--resume"), env=env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert uninterrupted.wait(timeout=300) == 0, uninterrupted.stderr.read()
    expected, got = losses(straight), losses(killed)
    assert sorted(got) == list(range(1, 21))
    assert got == expected  # exact float equality, every step
    events = [l["event"] for l in read_metrics(killed) if l["kind"] == "event"]
    assert events.count("start") == 1 and events.count("resume") == 1


def test_sigterm_saves_a_checkpoint_and_the_run_resumes_from_it(tmp_path, corpus, monkeypatch):
    """SIGTERM (a scheduler's preemption, or Ctrl-C's SIGINT) finishes the step, evaluates, saves, writes the
    report and exits 128 + 15; --resume goes on from that step."""
    from trainer import loop

    real, calls = loop.Trainer._train_step, {"n": 0}

    def step_then_sigterm(self, batches):
        calls["n"] += 1
        if calls["n"] == 3:  # during step 3, as `kill PID` would
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, batches)

    monkeypatch.setattr(loop.Trainer, "_train_step", step_then_sigterm)
    run = tmp_path / "run"
    result = cli("--data", str(corpus), "--out", str(run), *TINY, "--batch", "4", "--max-steps", "200",
                 "--eval-every", "1000", "--sample-tokens", "0")
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert "SIGTERM: stopping after this step (step 3)" in " ".join(result.output.split())  # said at once
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone after the run
    said = [l for l in read_metrics(run) if l.get("event") == "signal"]
    assert [(l["step"], l["signal"], l["now"]) for l in said] == [(2, "SIGTERM", False)]
    stop = [l for l in read_metrics(run) if l.get("event") == "stop"][-1]
    assert stop["reason"] == "interrupted" and stop["signal"] == "SIGTERM" and stop["step"] == 3
    assert sorted(losses(run)) == [1, 2, 3] and (run / "checkpoints" / "step-00000003").is_dir()
    assert [l["step"] for l in read_metrics(run) if l["kind"] == "eval"] == [3]
    monkeypatch.undo()
    result = cli("--out", str(run), "--resume", "--max-steps", "5")
    assert result.exit_code == 0, result.output
    assert sorted(losses(run)) == [1, 2, 3, 4, 5]


def test_a_checkpoint_appears_only_after_the_train_lines_of_its_steps_are_on_disk(tmp_path, corpus, monkeypatch):
    """A kill between a checkpoint's rename and the flush of metrics.jsonl used to leave checkpoint step-8 beside
    train lines up to step 4 (train lines are flushed at most once a second): the resumed run started at step 9
    and steps 5 to 8 were missing from metrics.jsonl for good. The lines now reach the disk first."""
    from trainer import checkpoint_format as ckpt

    real, seen = ckpt.save_checkpoint, []

    def save_reading_the_file(directory, step, *args, **kwargs):
        on_disk = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
        seen.append((step, max((l["step"] for l in on_disk if l.get("kind") == "train"), default=0)))
        return real(directory, step, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", save_reading_the_file)
    run = tmp_path / "run"
    result = cli("--data", str(corpus), "--out", str(run), *TINY, "--batch", "2", "--max-steps", "8",
                 "--save-every", "4", "--eval-every", "1000", "--sample-tokens", "0")
    assert result.exit_code == 0, result.output
    assert seen == [(4, 4), (8, 8)]


@pytest.mark.slow  # it trains (two tiny steps)
def test_a_second_signal_stops_at_once_and_is_recorded_in_metrics(tmp_path, corpus, monkeypatch):
    """Issue 28: a second SIGTERM during a (long) step stops the process at once; before it exits, a ``signal``
    line with now true is in metrics.jsonl (it used to exit 130 with no record of why)."""
    from trainer import loop

    real, calls = loop.Trainer._train_step, {"n": 0}

    def step_then_two_signals(self, batches):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, batches)

    monkeypatch.setattr(loop.Trainer, "_train_step", step_then_two_signals)
    run = tmp_path / "run"
    result = cli("--data", str(corpus), "--out", str(run), *TINY, "--batch", "4", "--max-steps", "200",
                 "--eval-every", "1000", "--sample-tokens", "0")
    assert result.exit_code != 0
    said = [l for l in read_metrics(run) if l.get("event") == "signal"]
    assert [(l["step"], l["now"]) for l in said] == [(1, False), (1, True)]
    assert "SIGTERM again: stopping now" in " ".join(result.output.split())
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_plan_made_for_another_device_is_refused_in_one_line_naming_both(tmp_path, corpus):
    """Issue 28: a plan autotuned for an RTX 4090 (micro-batch 128 in bf16) trained on this CPU without a word.
    It is refused, naming both devices, how to re-plan and how to override; nothing is written."""
    plan = tmp_path / "plan.toml"
    made = CliRunner().invoke(app, ["autotune", "--params", "22m", "--vocab", "8192", "--device", "rtx-4090",
                                    "--ctx", "512", "--out", str(plan)])
    assert made.exit_code == 0, made.output
    run = tmp_path / "run"
    result = cli("--plan", str(plan), "--data", str(corpus), "--out", str(run), "--max-steps", "1")
    line = assert_one_line_error(result, "rtx-4090", "made for", "memplan autotune", "--device rtx-4090")
    assert load_profile("cpu").name in line if torch.cuda.device_count() == 0 else True
    assert not run.exists()


def test_resume_refuses_another_model_shape_and_touches_nothing(tmp_path, corpus):
    run = tmp_path / "run"
    assert cli("--data", str(corpus), "--out", str(run), *TINY, "--batch", "2", "--max-steps", "2",
               "--sample-tokens", "0").exit_code == 0
    before = snapshot(run)
    wider = [a if a != "64" or i != TINY.index("--hidden") + 1 else "128" for i, a in enumerate(TINY)]
    assert_one_line_error(cli("--out", str(run), "--resume", *wider, "--batch", "2"), "hidden", "128")
    assert_one_line_error(cli("--out", str(run), "--resume", *TINY, "--batch", "2", "--precision", "bf16-mixed"),
                          "precision")
    assert_one_line_error(cli("--out", str(run), "--resume", "--lr", "1e-2"), "lr")
    assert snapshot(run) == before


def test_resume_refuses_another_tokenizer_and_touches_nothing(tmp_path, corpus):
    run = tmp_path / "run"
    start(run, corpus, max_steps=2).run()
    other = tmp_path / "other"
    src = data.resolve_inputs([str(corpus.parent / "stories.jsonl")])
    data.prepare(src, other, data.PrepareConfig(tokenizer="bpe:384", workers=1, max_docs=200))
    before = snapshot(run)
    assert_one_line_error(cli("--out", str(run), "--resume", "--data", str(other)), "tokenizer")
    assert snapshot(run) == before


def test_resume_can_extend_a_run(tmp_path, corpus):
    run = tmp_path / "run"
    start(run, corpus, max_steps=3, sample_tokens=0).run()
    result = cli("--out", str(run), "--resume", "--max-steps", "5", "--data", str(corpus))
    assert result.exit_code == 0, result.output
    assert sorted(losses(run)) == [1, 2, 3, 4, 5]


def test_resume_without_a_run_says_so(tmp_path):
    result = cli("--resume")
    assert_one_line_error(result, "--out")


# ---- corrupt inputs -----------------------------------------------------------------------------------

def test_a_truncated_checkpoint_file_is_named(tmp_path, corpus):
    run = tmp_path / "run"
    start(run, corpus, max_steps=4, save_every=2).run()
    state = run / "checkpoints" / "step-00000004" / "state.pt"
    state.write_bytes(state.read_bytes()[:-100])
    line = assert_one_line_error(cli("--out", str(run), "--resume", "--max-steps", "6"), str(state), "truncated")
    assert "step-00000002" in line  # the way out: the older checkpoint


def test_a_corrupt_checkpoint_file_is_named(tmp_path, corpus):
    run = tmp_path / "run"
    start(run, corpus, max_steps=2).run()
    weights = run / "checkpoints" / "step-00000002" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-10] ^= 0xFF
    weights.write_bytes(bytes(raw))
    assert_one_line_error(cli("--out", str(run), "--resume", "--max-steps", "4"), str(weights), "sha256")


def test_a_truncated_or_corrupt_shard_is_named(tmp_path, corpus):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(corpus, broken)
    shard = broken / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    args = ["--data", str(broken), *TINY, "--batch", "2", "--max-steps", "1"]
    assert_one_line_error(cli(*args, "--out", str(tmp_path / "a")), str(shard), "sha256")
    shard.write_bytes(bytes(raw[:-3]))
    assert_one_line_error(cli(*args, "--out", str(tmp_path / "b")), str(shard), "truncated")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---- out of memory and non-finite losses ---------------------------------------------------------------

class _OOMOnce:
    """A forward hook that raises torch.OutOfMemoryError on the n-th forward call of the model."""

    def __init__(self, at_call: int):
        self.at_call, self.calls, self.fired = at_call, 0, False

    def __call__(self, module, args, output):
        self.calls += 1
        if not self.fired and self.calls == self.at_call:
            self.fired = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")
        return output


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_global_batch(tmp_path, corpus):
    prepared = PreparedData(corpus)
    reference = tmp_path / "reference"
    start(reference, corpus, plan=tiny_plan(prepared.vocab_size, micro_batch=4, grad_accum=1), max_steps=5,
          sample_tokens=0).run()

    run = tmp_path / "run"
    trainer = start(run, corpus, plan=tiny_plan(prepared.vocab_size, micro_batch=4, grad_accum=1), max_steps=5,
                    sample_tokens=0, eval_every=100)
    hook = _OOMOnce(at_call=3)  # step 3's forward
    trainer.model.register_forward_hook(hook)
    summary = trainer.run()
    assert hook.fired and summary.step == 5
    lines = read_metrics(run)
    ooms = [l for l in lines if l.get("event") == "oom"]
    assert len(ooms) == 1 and ooms[0]["step"] == 3
    assert (ooms[0]["micro_batch"], ooms[0]["grad_accum"]) == (2, 2)
    train = [l for l in lines if l["kind"] == "train"]
    assert [l["step"] for l in train] == [1, 2, 3, 4, 5]  # step 3 redone, logged once
    assert [(l["micro_batch"], l["grad_accum"]) for l in train] == [(4, 1)] * 2 + [(2, 2)] * 3
    assert all(l["tokens"] == l["step"] * 256 for l in train)  # same global batch throughout
    # the same windows in smaller pieces: the losses match the uninterrupted run's to float rounding
    ref = losses(reference)
    for step, loss in losses(run).items():
        assert loss == pytest.approx(ref[step], rel=1e-5, abs=1e-6), step
    saved = Plan.load(run / "plan.toml").setup
    assert (saved.micro_batch, saved.grad_accum) == (2, 2)


def test_out_of_memory_at_micro_batch_one_stops_with_advice(tmp_path, corpus):
    trainer = start(tmp_path / "run", corpus, plan=tiny_plan(PreparedData(corpus).vocab_size, micro_batch=1),
                    max_steps=3, sample_tokens=0, eval_every=100)
    trainer.model.register_forward_hook(_OOMOnce(at_call=2))
    with pytest.raises(TrainingStopped, match="step 2: out of memory at micro-batch 1.*checkpointing"):
        trainer.run()


def test_non_finite_losses_skip_updates_then_stop_naming_the_step(tmp_path, corpus):
    run = tmp_path / "run"
    trainer = start(run, corpus, max_steps=20, max_nonfinite=3, sample_tokens=0, eval_every=100, save_every=2)

    calls = {"n": 0}

    def poison(module, args, output):  # from step 3 on, every logit is NaN
        calls["n"] += 1
        return output * float("nan") if calls["n"] >= 3 else output

    trainer.model.register_forward_hook(poison)
    with pytest.raises(TrainingStopped) as stopped:
        trainer.run()
    message = str(stopped.value)
    assert message.startswith("step 5:") and "--lr" in message and "\n" not in message
    # the updates of steps 3-5 were skipped: the weights are still those after step 2
    after_two = torch.load(run / "checkpoints" / "step-00000002" / "state.pt", weights_only=True)
    assert after_two["step"] == 2
    from trainer.checkpoint_format import read_weights

    saved = read_weights(run / "checkpoints" / "step-00000002" / "model.safetensors")
    live = trainer.model.state_dict()
    assert all(torch.equal(saved[k], live[k]) for k in saved)
    lines = read_metrics(run)
    assert [l["in_a_row"] for l in lines if l.get("event") == "nonfinite"] == [1, 2, 3]
    assert [l["loss"] for l in lines if l["kind"] == "train"][2:] == [None, None, None]
    assert (run / "report.html").is_file()


def test_threads_sets_torchs_threads_for_the_run(tmp_path, corpus):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        result = cli("--data", str(corpus), "--out", str(tmp_path / "run"), *TINY, "--batch", "2", "--max-steps", "1",
                     "--sample-tokens", "0", "--threads", "1")
        assert result.exit_code == 0, result.output
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cli_prints_a_stopped_run_on_one_line_with_exit_1(tmp_path, corpus, monkeypatch):
    from trainer import loop

    real = loop.Trainer._train_step

    def nan_step(self, batches):
        result = real(self, batches)
        result.loss = result.loss * float("nan")
        return result

    monkeypatch.setattr(loop.Trainer, "_train_step", nan_step)
    result = cli("--data", str(corpus), "--out", str(tmp_path / "run"), *TINY, "--batch", "2", "--max-steps", "9",
                 "--max-nonfinite", "2", "--sample-tokens", "0")
    assert result.exit_code == 1, result.output
    assert "step 2: the loss was not finite" in " ".join(result.stderr.split())


# ---- planning ---------------------------------------------------------------------------------------

def test_without_a_plan_train_picks_a_model_autotunes_it_and_trains_for_the_time_given(tmp_path, corpus, monkeypatch):
    """The quick start's path (what `memplan train` alone does, on this corpus and for 6 seconds): a model
    sized for the time, its setup from autotune, a time-limited schedule, a sample at the end."""
    from memplan import local_calibration

    monkeypatch.setenv("MEMPLAN_CACHE", str(tmp_path / "cache"))  # this test's own calibration of the machine
    monkeypatch.setattr(local_calibration, "QUICKSTART_CALIBRATE_SECONDS", 4.0)
    run = tmp_path / "run"
    result = cli("--data", str(corpus), "--out", str(run), "--max-minutes", "0.1", "--sample-tokens", "4")
    assert result.exit_code == 0, result.output
    assert "Model for a 0.1-minute run" in result.stderr and "Sample" in result.stdout
    out = " ".join(result.stderr.split())
    assert "rates: this machine's calibration of" in out  # a short calibration, in a process of its own
    # steady enough: cached for next time (a noisy one is not; its line says "measured now in" too)
    kept = "(measured now in" in out and "too noisy to keep" not in out
    cached = sorted((tmp_path / "cache" / "calibrated").glob("*.toml"))
    if kept:
        assert len(cached) == 2  # the calibration and the thread count it found fastest
        assert load_profile(str(cached[0])).calibrated["matmul_tflops"]["fp32"] > 0
    else:  # kept apart for its runtime memory only, with the thread count
        assert "too noisy to keep" in out and len(cached) == 2
        assert cached[0].name.endswith(".noisy.toml") and cached[1].name.endswith(".threads.toml")
    plan = Plan.load(run / "plan.toml")
    assert plan.model.vocab == PreparedData(corpus).vocab_size and plan.model.layers == 2  # the smallest rung
    assert plan.predicted["peak_reserved"] > 0  # autotune's prediction, kept in the plan
    lines = read_metrics(run)
    assert lines[0]["schedule"]["total_steps"] >= 1
    assert lines[-1]["event"] == "stop" and lines[-1]["reason"] == "max_minutes"
    assert lines[-1]["wall_seconds"] < 6 * 2

    again = cli("--data", str(corpus), "--out", str(tmp_path / "again"), "--max-minutes", "0.05", "--sample-tokens", "0")
    assert again.exit_code == 0, again.output
    if kept:  # a cached calibration is reused as it is: nothing measured again, nothing rewritten
        assert "(measured now in" not in " ".join(again.stderr.split())
        assert sorted((tmp_path / "cache" / "calibrated").glob("*.toml")) == cached
    assert "rates: this machine's calibration of" in " ".join(again.stderr.split())


def test_the_quick_start_model_is_the_largest_rung_predicted_to_meet_its_tokens_per_parameter():
    """quickstart_model's rule, with memplan's own step-time prediction as the oracle: the chosen rung meets
    QUICKSTART_TOKENS_PER_PARAM in the time given and the next rung does not; where no rung does (a 100
    GFLOP/s CPU core for 3 minutes, as in benchmarks/quickstart.py) it is the smallest rung, and the line
    printed says so rather than claiming the ratio."""
    from memplan.planning import QUICKSTART_LAYERS, QUICKSTART_TOKENS_PER_PARAM, quickstart_model, \
        quickstart_model_line
    from memplan.model import _round_up
    from memplan.timing import step_time

    def tokens_per_param(spec, profile, minutes):
        tps = step_time(spec, TrainSetup(ctx=256, micro_batch=8, precision="fp32"), profile).tokens_per_second
        return tps * minutes * 60 / spec.params

    cpu = load_profile("cpu").replace(calibrated={"matmul_tflops": {"fp32": 0.1}})
    spec, tps, rate, met = quickstart_model(4096, cpu, 3.0, 256, lambda: pytest.fail("measured"))
    assert (spec.layers, spec.hidden, spec.vocab, rate) == (QUICKSTART_LAYERS[0], 64 * QUICKSTART_LAYERS[0], 4096, 1e11)
    assert not met and tokens_per_param(spec, cpu, 3.0) < QUICKSTART_TOKENS_PER_PARAM
    line = quickstart_model_line(spec, tps, rate, met, 3.0)
    assert "the smallest of memplan's ladder" in line and f"{tokens_per_param(spec, cpu, 3.0):.1f} per parameter" in line

    minutes = 600.0  # ten hours: a rung above the smallest meets the rule
    spec, tps, rate, met = quickstart_model(4096, cpu, minutes, 256, lambda: pytest.fail("measured"))
    assert met and spec.layers > QUICKSTART_LAYERS[0]
    assert tokens_per_param(spec, cpu, minutes) >= QUICKSTART_TOKENS_PER_PARAM
    following = QUICKSTART_LAYERS[QUICKSTART_LAYERS.index(spec.layers) + 1]
    bigger = spec.replace(layers=following, hidden=64 * following, heads=following, kv_heads=following,
                          ffn=_round_up(8 * 64 * following / 3, 256))
    assert tokens_per_param(bigger, cpu, minutes) < QUICKSTART_TOKENS_PER_PARAM
    assert f"≥ {QUICKSTART_TOKENS_PER_PARAM:g} tokens per parameter" in quickstart_model_line(spec, tps, rate, met,
                                                                                             minutes)


def test_autotune_options_reach_autotune(tmp_path, corpus):
    result = cli("--data", str(corpus), "--out", str(tmp_path / "run"), "--layers", "2", "--hidden", "64",
                 "--heads", "2", "--ffn", "128", "--ctx", "64", "--budget", "1MiB", "--max-steps", "1")
    assert_one_line_error(result, "nothing fits")
    assert not (tmp_path / "run").exists()


def test_a_plan_that_does_not_fit_this_device_is_refused_before_it_starts(tmp_path, corpus):
    result = cli("--data", str(corpus), "--out", str(tmp_path / "run"), *TINY, "--batch", "2",
                 "--device-memory", "100MiB", "--max-steps", "1")
    assert_one_line_error(result, "predicted peak", "usable")
    assert not (tmp_path / "run").exists()


# ---- the trained model, for sampling and generation ---------------------------------------------------

def test_load_trained_rebuilds_the_model_and_tokenizer_from_the_run_alone(tmp_path, corpus):
    from trainer.loop import load_trained
    from trainer.sample import sample_text

    run = tmp_path / "run"
    trainer = start(run, corpus, plan=tiny_plan(PreparedData(corpus).vocab_size, checkpointing="full"), max_steps=3)
    trainer.run()
    model, tokenizer, meta = load_trained(run)
    assert meta["step"] == 3 and not model.training
    live = {k.replace(".block.", "."): v for k, v in trainer.model.state_dict().items()}
    assert all(torch.equal(v, live[k]) for k, v in model.state_dict().items())  # checkpointing wrapper gone
    assert tokenizer.encode("def main():") == trainer.tokenizer.encode("def main():")
    first = sample_text(model, tokenizer, "Once upon a time", 12, ctx=64, greedy=True)
    assert sample_text(model, tokenizer, "Once upon a time", 12, ctx=64, greedy=True) == first


def test_sampling_leaves_the_global_rng_alone_and_is_seeded(tmp_path, corpus):
    from trainer.sample import sample_text

    trainer = start(tmp_path / "run", corpus)
    state = torch.get_rng_state()
    a = sample_text(trainer.model, trainer.tokenizer, "The", 16, ctx=64, seed=7)
    b = sample_text(trainer.model, trainer.tokenizer, "The", 16, ctx=64, seed=7)
    assert a == b and torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed", "bf16"])
def test_low_precision_runs_train_and_resume_with_their_scaler(tmp_path, corpus, precision):
    """bf16/fp16 autocast and pure bf16 train on the CPU too; fp16 carries a GradScaler whose state the
    checkpoint keeps and a resume restores."""
    run = tmp_path / "run"
    base = tiny_plan(PreparedData(corpus).vocab_size, micro_batch=2)
    trainer = start(run, corpus, plan=Plan(model=base.model, setup=base.setup.replace(precision=precision)),
                    max_steps=2, sample_tokens=0)
    trainer.run()
    assert all(math.isfinite(v) for v in losses(run).values())
    state = torch.load(run / "checkpoints" / "step-00000002" / "state.pt", weights_only=True)
    assert (state["scaler"] is not None) == (precision == "fp16-mixed")
    resumed = Trainer.resume(run, PreparedData(corpus), load_profile("cpu"), overrides={"max_steps": 3})
    if precision == "fp16-mixed":
        assert resumed.scaler.get_scale() == trainer.scaler.get_scale()
    resumed.run()
    assert sorted(losses(run)) == [1, 2, 3]


def test_rotary_has_a_form_torch_compile_can_trace_with_the_same_values(monkeypatch):
    """--compile: torch.compile cannot trace the eager rotary's writes into views of a new tensor, so under
    compilation the rotation is written functionally; both forms give the same numbers."""
    from trainer import model as model_module

    x, cos, sin = torch.randn(2, 8, 3, 16), torch.randn(8, 1, 6), torch.randn(8, 1, 6)  # partial rotary: 12 of 16
    eager = model_module._rotate(x, cos, sin)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced_form = model_module._rotate(x, cos, sin)
    assert torch.allclose(eager, traced_form, atol=1e-6) and torch.equal(eager[..., 12:], x[..., 12:])

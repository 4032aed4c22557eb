"""Run control that tells the truth, and hostile conditions met by a run (issue 14, items 6, 7 and 18).

6. ``finetune`` takes ``train``'s run-control options (one shared definition), keeps its base run's
   precision whatever else is given, and ``train`` and ``finetune`` warn (one stderr line) when they
   will pass over their training tokens more than REPEAT_WARN_PASSES times.
7. On ``--resume``, limits given replace the run's (those not given are lifted), none given keeps
   the run's; the start says which limits are in force; a time limit counts from the resume and a
   resumed run's summary says what the resume itself did.
18. A full disk (checkpoint, metrics, report, or before the start), a read-only ``--out``, a seed out
   of range and a CPU allocation failure each end in one line, never a traceback; nothing half
   written is left and earlier checkpoints still verify.

Every run is a tiny Llama (2 layers, hidden 64) on the tiny corpus of tests/runs_helper.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from conftest import fill_disk
from memplan.cli import app
from memplan.hardware import load_profile
from memplan.model import ModelSpec
from memplan.plan import Plan
from memplan.run_control import LIMITS, SEED_MAX
from memplan.setup import TrainSetup
from runs_helper import one_line_error, tiny_corpus, tiny_run
from trainer import checkpoint_format as ckpt
from trainer.data import PreparedData
from trainer.loop import REPEAT_WARN_PASSES, TrainConfig, Trainer
from trainer.rundir import read_metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = ["--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "2", "--kv-heads", "2", "--ffn", "128",
        "--ctx", "64", "--batch", "4", "--precision", "fp32", "--sample-tokens", "0", "--threads", "1"]
CPU_ALLOCATION_FAILED = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                         "you tried to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)")
# (the message torch 2.13 raised here for torch.empty(2**30) under resource.setrlimit(RLIMIT_AS, 3 GiB))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return tiny_corpus(tmp_path_factory.mktemp("corpus"))


def write_sft(path: Path, n: int = 30) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"Which animal is {i}?", "response": f"The cat is {i}."}) + "\n"
                            for i in range(n)))
    return path


@pytest.fixture(scope="module")
def bases(tmp_path_factory, corpus):
    """Trained runs to finetune, one per precision, and a JSONL of 30 examples."""
    root = tmp_path_factory.mktemp("bases")
    runs = {p: tiny_run(root / p, corpus, steps=2, precision=p) for p in ("fp32", "bf16-mixed")}
    return runs, write_sft(root / "sft.jsonl")


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def finetune(base: Path, data: Path, out: Path, *args: str):
    return cli("finetune", "--device", "cpu", "--run", str(base), "--data", str(data), "--out", str(out),
               "--threads", "1", *args)


def no_traceback(result) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output


def events(run: Path, name: str) -> list[dict]:
    return [l for l in read_metrics(run) if l.get("event") == name]


def train_steps(run: Path) -> list[int]:
    return [l["step"] for l in read_metrics(run) if l.get("kind") == "train"]


def leftovers(directory: Path) -> list[str]:
    """Temporary files and directories anywhere under ``directory`` (what an interrupted write leaves)."""
    return [str(p) for p in directory.rglob("*") if ".tmp" in p.name or p.name.startswith(".trash-")]


# ---- 6: finetune's run control is train's ------------------------------------------------------------------

RUN_CONTROL_FLAGS = ("--max-steps", "--tokens", "--max-minutes", "--save-every", "--eval-every", "--keep",
                     "--eval-batches", "--sample-tokens", "--prompt", "--max-nonfinite", "--verify-data", "--seed",
                     "--threads")


def test_finetune_and_train_share_one_definition_of_the_run_control_options():
    commands = typer.main.get_command(app).commands
    by_flag = {name: {p.opts[0]: p for p in commands[name].params if getattr(p, "opts", None)}
               for name in ("train", "finetune")}
    for flag in RUN_CONTROL_FLAGS:
        t, f = by_flag["train"].get(flag), by_flag["finetune"].get(flag)
        assert f is not None, f"finetune lacks {flag}"
        assert (t.help, t.secondary_opts, t.multiple) == (f.help, f.secondary_opts, f.multiple), flag
    # the limits and the seed's range, defined once (memplan.run_control), are what the trainer and the help say
    assert set(LIMITS) <= {f.name for f in dataclasses.fields(TrainConfig)}
    assert f"0 to {SEED_MAX} " in by_flag["train"]["--seed"].help


def test_finetune_takes_the_run_control_options_of_train(bases, tmp_path):
    runs, data = bases
    out = tmp_path / "ft"
    result = finetune(runs["fp32"], data, out, "--batch", "4", "--tokens", "1536", "--save-every", "1",
                      "--eval-every", "2", "--keep", "1", "--eval-batches", "1", "--sample-tokens", "3",
                      "--prompt", "### User:\nHi", "--max-nonfinite", "2", "--no-verify-data", "--seed", "7")
    assert result.exit_code == 0, result.output
    checkpoints = ckpt.list_checkpoints(out / "checkpoints")
    assert [c.step for c in checkpoints] == [6]  # 1536 tokens in steps of 4 rows × 64; --keep 1
    config = ckpt.read_meta(checkpoints[0].path)["config"]
    assert (config["max_tokens"], config["keep"], config["eval_batches"], config["sample_tokens"]) == (1536, 1, 1, 3)
    assert (config["prompts"], config["max_nonfinite"], config["verify_data"], config["seed"]) == \
        (["### User:\nHi"], 2, False, 7)
    samples = [l["samples"] for l in read_metrics(out) if l.get("kind") == "eval"]
    assert samples and samples[0][0]["prompt"] == "### User:\nHi"


def test_finetune_takes_max_minutes_and_stops_on_it(bases, tmp_path):
    runs, data = bases
    out = tmp_path / "ft"
    result = finetune(runs["fp32"], data, out, "--batch", "4", "--max-minutes", "0.01", "--sample-tokens", "0")
    assert result.exit_code == 0, result.output
    stop = events(out, "stop")[-1]
    assert stop["reason"] == "max_minutes" and stop["wall_seconds"] < 0.01 * 60 + 5
    assert "(time limit)" in result.stdout


@pytest.mark.parametrize("precision, device", [
    ("bf16-mixed", "cpu"),  # autotune alone picks fp32 for the cpu profile
    ("fp32", "rtx-4090"),  # ... and bf16-mixed for a GPU's (the plan is for it; the steps run here)
])
def test_finetune_keeps_the_base_runs_precision_when_it_autotunes(bases, tmp_path, precision, device):
    runs, data = bases
    out = tmp_path / "ft"
    result = finetune(runs[precision], data, out, "--lora-rank", "4", "--max-steps", "1", "--device", device)
    assert result.exit_code == 0, result.output
    assert Plan.load(out / "plan.toml").setup.precision == precision
    assert events(out, "start")[0]["setup"]["precision"] == precision


@pytest.mark.parametrize("command", ["train", "finetune"])
def test_a_run_that_will_repeat_its_data_says_so_on_one_stderr_line(bases, corpus, tmp_path, command):
    runs, data = bases
    out = tmp_path / "run"
    if command == "finetune":
        steps = 30
        result = finetune(runs["fp32"], data, out, "--batch", "4", "--max-steps", str(steps), "--eval-every", "100")
        train_tokens = events(out, "start")[0]["train_tokens"]
    else:
        train_tokens = PreparedData(corpus).train_tokens
        steps = int(REPEAT_WARN_PASSES * train_tokens / 256) + 2  # just over the line
        result = cli("train", "--data", str(corpus), "--out", str(out), *TINY, "--max-steps", str(steps),
                     "--eval-every", "100000")
    assert result.exit_code == 0, result.output
    passes = steps * 256 / train_tokens
    assert passes > REPEAT_WARN_PASSES
    warnings = [l for l in result.stderr.splitlines() if l.startswith("warning:")]
    assert len(warnings) == 1, result.stderr
    assert f"{steps:,} steps of 256 tokens are {passes:,.0f} passes over the {train_tokens:,} training tokens" \
        in warnings[0]
    assert "warning" not in result.stdout
    # a run within the line says nothing
    quiet = cli("train", "--data", str(corpus), "--out", str(tmp_path / "quiet"), *TINY, "--max-steps", "2")
    assert quiet.exit_code == 0 and "warning" not in quiet.output


# ---- 7: the limits given on --resume are the limits in force ----------------------------------------------

def tiny_plan(vocab: int) -> Plan:
    spec = ModelSpec(arch="llama", layers=2, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=vocab, tied=True)
    return Plan(model=spec, setup=TrainSetup(ctx=64, micro_batch=4, precision="fp32"), device="cpu")


@pytest.mark.parametrize("stored, given, in_force", [
    ({"max_steps": 2, "max_minutes": 5.0}, {"max_steps": 4}, {"max_steps": 4}),  # the old time limit goes
    ({"max_steps": 2}, {"max_minutes": 0.01}, {"max_minutes": 0.01}),  # the old step limit goes
    ({"max_steps": 2, "max_tokens": 10**6}, {"max_tokens": 2048}, {"max_tokens": 2048}),
])
def test_limits_given_on_resume_replace_the_runs(tmp_path, corpus, stored, given, in_force):
    prepared = PreparedData(corpus)
    run = tmp_path / "run"
    Trainer.start(run, tiny_plan(prepared.vocab_size), prepared, TrainConfig(**stored, sample_tokens=0),
                  load_profile("cpu")).run()
    trainer = Trainer.resume(run, prepared, load_profile("cpu"), overrides=given)
    assert {k: getattr(trainer.config, k) for k in LIMITS} == {k: in_force.get(k) for k in LIMITS}
    assert trainer.replaced_limits == {k: stored.get(k) for k in LIMITS}
    summary = trainer.run()
    assert summary.step > 2  # trained on, to the new limit
    assert summary.stop_reason == {"max_steps": "max_steps", "max_tokens": "max_tokens",
                                   "max_minutes": "max_minutes"}[next(iter(given))]
    if "max_minutes" in given:  # counted from the resume
        assert summary.wall_seconds < 0.01 * 60 + 5


def test_a_time_limited_run_resumed_with_a_step_limit_decays_to_it(tmp_path, corpus):
    prepared = PreparedData(corpus)
    run = tmp_path / "run"
    first = Trainer.start(run, tiny_plan(prepared.vocab_size), prepared,
                          TrainConfig(max_minutes=30.0, sample_tokens=0, eval_every=100), load_profile("cpu"))
    first.open()  # driven by hand: three steps at the held peak, a checkpoint, then "killed"
    for _ in range(3):
        first.advance()
    first.save()
    first.close()
    assert first.schedule.kind == "wsd" and not first.schedule.fixed
    trainer = Trainer.resume(run, prepared, load_profile("cpu"), overrides={"max_steps": 8})
    assert trainer.config.max_minutes is None and trainer.schedule.fixed
    assert (trainer.schedule.decay_start, trainer.schedule.total_steps) == (6, 8)  # the last fifth of 8 steps
    summary = trainer.run()
    assert (summary.step, summary.stop_reason) == (8, "max_steps")
    lrs = {l["step"]: l["lr"] for l in read_metrics(run) if l.get("kind") == "train"}
    peak, floor = trainer.schedule.peak_lr, trainer.schedule.min_lr
    assert trainer.schedule.warmup_steps == 6  # the 30 minutes' warmup (100 steps) cut to end by the decay
    assert lrs[6] == peak and peak > lrs[7] > lrs[8] == pytest.approx(floor)


def test_resume_prints_the_limits_in_force_and_what_the_resume_itself_did(tmp_path, corpus):
    run = tmp_path / "run"
    first = cli("train", "--data", str(corpus), "--out", str(run), *TINY, "--max-steps", "3", "--max-minutes", "5")
    assert first.exit_code == 0, first.output
    assert "limits: --max-steps 3, --max-minutes 5 (from this command's start)" in " ".join(first.stderr.split())
    kept = cli("train", "--out", str(run), "--resume")  # no limit given: the run's own
    assert kept.exit_code == 0, kept.output
    assert "limits: --max-steps 3, --max-minutes 5 (from this command's start); the run's own" in \
        " ".join(kept.stderr.split())
    resumed = cli("train", "--out", str(run), "--resume", "--max-minutes", "0.01")
    assert resumed.exit_code == 0, resumed.output
    assert ("limits: --max-minutes 0.01 (from this command's start); given now, replacing the run's --max-steps 3, "
            "--max-minutes 5") in " ".join(resumed.stderr.split())
    done = next(l for l in resumed.stdout.splitlines() if l.startswith("Done"))
    steps = train_steps(run)
    assert max(steps) > 3  # the old step limit no longer stops it
    assert f"this resume: {max(steps) - 3:,} steps in" in done and done.endswith("(time limit)")
    assert events(run, "stop")[-1]["wall_seconds"] < 0.01 * 60 + 5


# ---- 18: a full disk ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["checkpoint", "metrics", "report"])
def test_a_full_disk_during_train_is_one_line_and_keeps_the_earlier_checkpoint(small_disk, corpus, monkeypatch,
                                                                               where):
    from trainer import loop, reporting

    run = small_disk / "run"
    real_save, real_report = loop.Trainer.save, reporting.ReportRenderer.write

    def save(self):
        path = real_save(self)
        if self.step == 2:  # the first checkpoint is on disk: now the disk fills
            if where == "checkpoint":
                fill_disk(small_disk, leave=256 * 1024)  # room for metrics lines, not for a checkpoint
            elif where == "metrics":
                fill_disk(small_disk)
                self.save_every = 10**6
        return path

    def report(self):  # the page is rendered in a process of its own, which finds the disk full
        if where == "report":
            fill_disk(small_disk)
        return real_report(self)

    monkeypatch.setattr(loop.Trainer, "save", save)
    monkeypatch.setattr(reporting.ReportRenderer, "write", report)
    steps = {"checkpoint": "4", "metrics": "200", "report": "2"}[where]
    result = cli("train", "--data", str(corpus), "--out", str(run), *TINY, "--max-steps", steps, "--save-every", "2",
                 "--eval-every", "1000")
    no_traceback(result)
    assert result.exit_code == 1, result.output
    last = result.stderr.strip().splitlines()[-1]
    named = {"checkpoint": run / "checkpoints" / "step-00000004", "metrics": run / "metrics.jsonl",
             "report": run / "report.html"}[where]
    assert last.startswith("memplan: training stopped: ") and f"{named}: no space left on device" in last
    assert "step-00000002, is intact" in last
    assert sum("no space left" in l for l in result.output.splitlines()) == 1
    assert leftovers(run) == []
    assert [c.step for c in ckpt.list_checkpoints(run / "checkpoints")] == [2]
    ckpt.verify_checkpoint(run / "checkpoints" / "step-00000002")


def test_a_full_disk_before_the_start_is_refused_in_one_line_leaving_nothing(small_disk, corpus):
    fill_disk(small_disk)
    run = small_disk / "run"
    line = one_line_error(cli("train", "--data", str(corpus), "--out", str(run), *TINY, "--max-steps", "2"),
                          f"--out {run}: cannot write there")
    assert "no space left" in line.lower()
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def test_rewriting_the_report_on_a_full_disk_is_one_line(small_disk, corpus, tmp_path):
    trained = tmp_path / "trained"
    assert cli("train", "--data", str(corpus), "--out", str(trained), *TINY, "--max-steps", "1").exit_code == 0
    run = small_disk / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "plan.toml", "run.json"):  # what the report is made from
        (run / name).write_bytes((trained / name).read_bytes())
    fill_disk(small_disk)
    result = cli("train", "--out", str(run), "--report")
    no_traceback(result)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()  # refused before writing (memplan.reports.page.check_report_path)
    assert len(lines) == 1 and str(run / "report.html") in lines[0] and "free" in lines[0], lines
    assert leftovers(run) == [] and not (run / "report.html").exists()


# ---- 18: a read-only --out ---------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["train", "finetune"])
def test_a_read_only_out_is_refused_in_one_line_before_training(read_only_dir, corpus, bases, command, monkeypatch):
    trained = []
    monkeypatch.setattr(Trainer, "run", lambda self: trained.append(1))
    if command == "train":
        result = cli("train", "--data", str(corpus), "--out", str(read_only_dir), *TINY, "--max-steps", "1")
    else:
        runs, data = bases
        result = finetune(runs["fp32"], data, read_only_dir, "--batch", "4", "--max-steps", "1")
    line = one_line_error(result, f"--out {read_only_dir}: cannot write there", "writable --out")
    assert not trained and not list(read_only_dir.iterdir())
    assert "read-only" in line.lower() or "permission" in line.lower()


# ---- 18: a seed out of range ---------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["train", "finetune"])
@pytest.mark.parametrize("seed", [str(2**70), "-1", str(2**32)])
def test_a_seed_out_of_range_is_one_line_naming_the_range(corpus, bases, tmp_path, command, seed):
    out = tmp_path / "run"
    if command == "train":
        result = cli("train", "--data", str(corpus), "--out", str(out), *TINY, "--max-steps", "1", "--seed", seed)
    else:
        runs, data = bases
        result = finetune(runs["fp32"], data, out, "--batch", "4", "--max-steps", "1", "--seed", seed)
    one_line_error(result, "--seed", seed, "accepted: 0 to 4294967295")
    assert not out.exists()


def test_train_config_refuses_a_seed_out_of_range():
    from memplan.errors import InputError

    with pytest.raises(InputError, match="accepted: 0 to 4294967295"):
        TrainConfig(seed=2**70)


# ---- 18: a CPU allocation failure is an out-of-memory step ------------------------------------------------

class _FailAllocationOnce:
    """A forward hook that raises what a CPU's allocator raises (or a MemoryError) at its ``at_call``-th call."""

    def __init__(self, at_call: int, error: BaseException):
        self.at_call, self.error, self.calls, self.fired = at_call, error, 0, False

    def __call__(self, module, args, output):
        self.calls += 1
        if not self.fired and self.calls == self.at_call:
            self.fired = True
            raise self.error
        return output


@pytest.mark.parametrize("error", [RuntimeError(CPU_ALLOCATION_FAILED), MemoryError()], ids=["allocator", "memory"])
def test_a_cpu_allocation_failure_halves_the_micro_batch(tmp_path, corpus, error):
    prepared = PreparedData(corpus)
    run = tmp_path / "run"
    trainer = Trainer.start(run, tiny_plan(prepared.vocab_size), prepared,
                            TrainConfig(max_steps=4, sample_tokens=0, eval_every=100), load_profile("cpu"))
    hook = _FailAllocationOnce(at_call=3, error=error)
    trainer.model.register_forward_hook(hook)
    summary = trainer.run()
    assert hook.fired and summary.step == 4
    ooms = events(run, "oom")
    assert len(ooms) == 1 and ooms[0]["step"] == 3 and (ooms[0]["micro_batch"], ooms[0]["grad_accum"]) == (2, 2)
    assert train_steps(run) == [1, 2, 3, 4]


@pytest.mark.parametrize("command", ["train", "finetune"])
def test_a_cpu_allocation_failure_at_micro_batch_one_is_one_line(tmp_path, corpus, bases, monkeypatch, command):
    from trainer import loop

    def fail(self, batches):
        raise RuntimeError(CPU_ALLOCATION_FAILED)

    monkeypatch.setattr(loop.Trainer, "_train_step", fail)
    out = tmp_path / "run"
    if command == "train":
        args = [a if a != "4" else "1" for a in TINY]  # --batch 1
        result = cli("train", "--data", str(corpus), "--out", str(out), *args, "--max-steps", "3")
    else:
        runs, data = bases
        result = finetune(runs["fp32"], data, out, "--batch", "1", "--max-steps", "3")
    no_traceback(result)
    assert result.exit_code == 1, result.output
    stopped = [l for l in result.stderr.splitlines() if "stopped" in l]
    assert len(stopped) == 1, result.stderr
    doing = {"train": "training", "finetune": "finetuning"}[command]
    assert stopped[0].startswith(f"memplan: {doing} stopped: step 1: out of memory at micro-batch 1 ([enforce fail "
                                 "at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory")


def test_memory_running_out_outside_a_step_is_one_line(tmp_path, corpus, monkeypatch):
    """Saving a checkpoint (torch.save's buffers, a library mapped late) under a memory limit: nothing to halve,
    one line saying what to do, exit 1."""
    def save_checkpoint(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(ckpt, "save_checkpoint", save_checkpoint)
    result = cli("train", "--data", str(corpus), "--out", str(tmp_path / "run"), *TINY, "--max-steps", "2")
    no_traceback(result)
    assert result.exit_code == 1
    stopped = [l for l in result.stderr.splitlines() if "stopped" in l]
    assert stopped == ["memplan: training stopped: step 1: out of memory outside a training step (MemoryError); no "
                       "checkpoint was saved; free memory (or raise `ulimit -v`), then continue it with --resume"]


ULIMIT_CHILD = """
import re, resource, sys
import torch
torch.set_num_threads(1)
size = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
limit = size + int(sys.argv[1]) * 2**20  # what this process maps already, and a little more
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.argv = ["memplan", *sys.argv[2:]]
from memplan.cli import main
main()
"""


@pytest.mark.slow
def test_under_ulimit_v_a_step_that_cannot_allocate_halves_its_micro_batch(tmp_path, corpus):
    """The real thing: RLIMIT_AS 150 MiB above what the process maps once torch is imported (as `ulimit -v`
    would set), a micro-batch of 64 × 128 tokens, the CLI in that process. Measured here (torch 2.13, 2 cores):
    64 → 32 → 16 at step 1, then 16 → 8 at step 2, and the run ends with its checkpoint."""
    repo = Path(__file__).resolve().parents[2]
    args = ["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--arch", "llama", "--layers", "2",
            "--hidden", "64", "--heads", "2", "--kv-heads", "2", "--ffn", "128", "--ctx", "128", "--batch", "64",
            "--precision", "fp32", "--sample-tokens", "0", "--max-steps", "2", "--eval-every", "100", "--threads",
            "1", "--device", "cpu"]
    done = subprocess.run([sys.executable, "-c", ULIMIT_CHILD, "150", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"})
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "out of memory at step 1: micro-batch 64 → 32" in done.stderr, done.stderr[-3000:]
    if done.returncode != 0:  # a machine with less room: one line, exit 1
        assert done.returncode == 1
        assert [l for l in done.stderr.splitlines() if "stopped" in l][0].startswith("memplan: training stopped: ")
    else:
        assert [e["micro_batch"] for e in events(tmp_path / "run", "oom")][0] == 32

"""The run directory has one owner (issue 16): metrics.jsonl's lines are typed records written and read in
trainer/records.py (the documented keys are exactly their fields, a hostile line is one error line), and
`memplan train --nproc N` resolves the run once and hands each rank RUN/launch.json."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from memplan.errors import InputError
from trainer import records

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from runs_helper import pydoc_corpus

    return pydoc_corpus(tmp_path_factory.mktemp("corpus"))


# ---- lines as the trainer wrote them before the records (its dicts, json.dumps(..., allow_nan=False)) ----------

START = {"kind": "event", "event": "start", "step": 0, "tokens": 0, "time": 0.0, "unix_time": 1764600000.25,
         "model": {"arch": "llama", "layers": 1, "params": 12345, "describe": "llama 1×32"},
         "setup": {"ctx": 32, "micro_batch": 2, "compile": False}, "device": "cpu", "torch_device": "cpu",
         "torch": "2.13.0", "predicted": {"peak_allocated": 1000, "peak_reserved": 2000, "peak_phase": "backward",
                                          "step_seconds": 0.5, "tokens_per_second": 128.0, "mfu": 0.01},
         "schedule": {"peak_lr": 6e-4, "min_lr": 6e-5, "warmup_steps": 0, "total_steps": 3, "kind": "cosine",
                      "decay_start": None},
         "eval_every": 2, "save_every": 2, "tokens_per_step": 64, "planned_steps": 3, "data_passes": 0.01,
         "train_tokens": 9000, "memory_source": "resident set (/proc/self/statm)", "baseline_memory_bytes": 123456,
         "mfu_peak_flops_per_second": 1e12, "data": "/data", "config": {"lr": 6e-4, "prompts": []}}
RESUME = {**{k: v for k, v in START.items() if k not in ("memory_source", "baseline_memory_bytes",
                                                         "mfu_peak_flops_per_second", "data", "config")},
          "event": "resume", "step": 2, "replaced_limits": {"max_steps": 3, "max_tokens": None, "max_minutes": None},
          "memory_source": "rss", "baseline_memory_bytes": None, "mfu_peak_flops_per_second": 1e12, "data": "/d",
          "config": {}, "checkpoint": "/run/checkpoints/step-00000002"}
TRAIN = {"kind": "train", "step": 1, "loss": 5.5, "tokens_per_second": 1234.5, "lr": 0.0006, "grad_norm": 1.25,
         "tokens": 64, "step_seconds": 0.05, "time": 0.05, "mfu": 0.0123, "memory_bytes": 1 << 20, "memory_step": 1,
         "micro_batch": 2, "grad_accum": 1, "skipped": False, "eta_seconds": 0.1, "total_steps": 3}
TRAIN_NONFINITE = {**TRAIN, "step": 2, "loss": None, "grad_norm": None, "memory_step": 1, "skipped": True,
                   "memory_allocated_bytes": 4096, "nonfinite": "nan"}
EVAL = {"kind": "eval", "step": 2, "eval_loss": 5.25, "eval_ppl": 190.5, "eval_tokens": 640,
        "eval_loss_by_source": {"pydoc": 5.25}, "eval_ppl_by_source": {"pydoc": 190.5},
        "eval_tokens_by_source": {"pydoc": 640}, "samples": [{"prompt": "The", "text": " model\n"}],
        "eval_seconds": 0.25, "tokens": 128}
EVENTS = [
    {"kind": "event", "event": "checkpoint", "step": 2, "path": "/run/checkpoints/step-00000002", "seconds": 0.5},
    {"kind": "event", "event": "oom", "step": 3, "time": 1.5, "message": "CUDA out of memory", "micro_batch": 1,
     "grad_accum": 2, "previous": {"micro_batch": 2, "grad_accum": 1}, "predicted": START["predicted"]},
    {"kind": "event", "event": "eval_oom", "step": 3, "message": "out of memory"},
    {"kind": "event", "event": "nonfinite", "step": 2, "loss": "nan", "in_a_row": 1, "lr": 0.0006},
    {"kind": "event", "event": "decay", "step": 40, "decay_steps": 10, "total_steps": 50, "seconds_left": 12.5,
     "step_seconds": 1.25},
    {"kind": "event", "event": "report_failed", "step": 3, "error": "ValueError: no"},
    {"kind": "event", "event": "stop", "step": 3, "reason": "max_steps", "tokens": 192, "time": 0.15,
     "wall_seconds": 2.5},
    {"kind": "event", "event": "stop", "step": 3, "reason": "interrupted", "tokens": 192, "time": 0.15,
     "wall_seconds": 2.5, "signal": "SIGINT"},
]
# issue 28: a prediction of CPU time (the load too unsteady for wall time), a step's CPU time, a signal's line
NEWER = [{**START, "predicted": {**START["predicted"], "clock": "cpu"}}, {**TRAIN, "cpu_seconds": 0.04},
         {"kind": "event", "event": "signal", "step": 2, "signal": "SIGTERM", "now": False}]
OLD_LINES = [START, RESUME, TRAIN, TRAIN_NONFINITE, EVAL, *EVENTS, *NEWER]


@pytest.mark.parametrize("line", OLD_LINES, ids=lambda l: l.get("event", l["kind"]) + str(len(l)))
def test_a_line_written_the_old_way_is_read_as_its_record_and_written_again_byte_for_byte(line):
    text = json.dumps(line, allow_nan=False)
    record = records.parse_line(text, "metrics.jsonl line 1")
    assert type(record) is not records.OtherEvent  # every documented line has a record of its own
    assert records.dumps(record) == text
    assert dataclasses.is_dataclass(record) and record.__dataclass_params__.frozen


def test_every_line_of_a_real_run_round_trips_and_the_writer_takes_records_only(tmp_path, corpus):
    from memplan.hardware import load_profile
    from memplan.model import ModelSpec
    from memplan.plan import Plan
    from memplan.setup import TrainSetup
    from trainer import loop
    from trainer.data import PreparedData
    from trainer.rundir import metric_records, read_metrics

    prepared = PreparedData(corpus)
    spec = ModelSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=prepared.vocab_size,
                     tied=True)
    plan = Plan(model=spec, setup=TrainSetup(ctx=32, micro_batch=2, precision="fp32"), device="cpu")
    config = loop.TrainConfig(max_steps=3, eval_every=2, save_every=2, sample_tokens=2, eval_batches=1,
                              verify_data=False, warmup_steps=0)
    seen = []
    trainer = loop.Trainer.start(tmp_path / "run", plan, prepared, config, load_profile("cpu"))
    trainer.on_event(seen.append)
    summary = trainer.run()
    raw = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    kinds = [type(r) for r in seen]
    assert {records.StartEvent, records.TrainLine, records.EvalLine, records.CheckpointEvent,
            records.StopEvent} <= set(kinds)
    assert [records.dumps(r) for r in seen] == raw  # what the callbacks saw is what was written
    assert [records.dumps(r) for r in metric_records(tmp_path / "run")] == raw
    assert read_metrics(tmp_path / "run") == [json.loads(line) for line in raw]
    assert isinstance(summary.last_eval, records.EvalLine) and summary.last_eval.step == 3
    with pytest.raises(TypeError, match="trainer.records record"):
        records.dumps({"kind": "train", "step": 1})


# ---- the documented keys are the records' fields ---------------------------------------------------------------

def _doc() -> str:
    return (ROOT / "docs" / "run-directory.md").read_text()


def _table(heading: str) -> list[list[str]]:
    text = _doc().split(heading, 1)[1]
    rows = []
    for line in text.splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[1:]  # without the header row


def _top_level_keys(cell: str) -> list[str]:
    """The `key`s of a cell outside parentheses (what is inside explains them)."""
    depth, out = 0, []
    for ch in cell:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return re.findall(r"`([a-z_]+)`", "".join(out))


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_documented_train_and_eval_keys_are_exactly_the_records_fields():
    for heading, cls in (('### `"kind": "train"`', records.TrainLine), ('### `"kind": "eval"`', records.EvalLine)):
        documented = {k for row in _table(heading) for k in re.findall(r"`([a-z_]+)`", row[0])}
        assert documented == _fields(cls), heading


def test_the_documented_events_and_their_keys_are_exactly_the_event_records():
    rows = {re.findall(r"`([a-z_]+)`", row[0])[0]: _top_level_keys(row[2]) for row in _table('### `"kind": "event"`')}
    assert set(rows) == set(records.EVENTS)  # every documented event has its record, and no other
    start = set(rows["start"])
    assert set(rows["resume"]) == {"start", "checkpoint", "replaced_limits"}  # "the keys of `start`, plus ..."
    assert _fields(records.StartEvent) == {"event", "step"} | start | {"checkpoint", "replaced_limits"}
    for name, cls in records.EVENTS.items():
        if cls is not records.StartEvent:
            assert _fields(cls) == {"step"} | set(rows[name]), name


# ---- a hostile metrics.jsonl ------------------------------------------------------------------------------------

def _line(**changes) -> str:
    return json.dumps({**TRAIN, **changes})


@pytest.mark.parametrize("bad, needle", [
    (_line(step="1"), "'step' is \"1\"; accepted: a whole number"),
    (_line(loss=[1]), "'loss' is [1]; accepted: a number or null"),
    (_line(skipped=1), "'skipped' is 1; accepted: true or false"),
    (_line(step=True), "'step' is true; accepted: a whole number"),
    (json.dumps({k: v for k, v in TRAIN.items() if k != "lr"}), "a 'train' line without 'lr'"),
    (_line().replace('"loss": 5.5', '"loss": NaN'), "holds NaN; metrics lines hold finite numbers"),
    (_line().replace('"loss": 5.5', '"loss": -Infinity'), "holds -Infinity"),
    (_line().replace('"loss": 5.5', '"loss": 1e999'), "holds 1e999"),
    (json.dumps({**EVAL, "samples": [{"prompt": "x"}]}), "'samples'[0] has no 'text'"),
    (json.dumps({**EVAL, "eval_tokens_by_source": {"a": "many"}}), "'eval_tokens_by_source'[\"a\"] is \"many\""),
    (json.dumps({**START, "model": {"params": "big"}}), "'model'['params'] is \"big\""),
    (json.dumps({**START, "event": "start", "predicted": {"peak_reserved": "x"}}), "'predicted'[\"peak_reserved\"]"),
    (json.dumps({**EVENTS[1], "previous": {}}), "'previous' has no 'micro_batch'"),
    (json.dumps({"kind": "event", "event": "nonfinite", "step": 1}), "a 'nonfinite' event line without 'loss'"),
    (json.dumps({"kind": "event", "event": "later", "note": 1}), "an event without 'step'"),
    (json.dumps({"step": 1}), "no 'kind'"),
    (json.dumps([1, 2]), "not a JSON object"),
    ("7", "not a JSON object"),
])
def test_a_hostile_line_is_one_error_naming_the_file_and_line(tmp_path, bad, needle):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(START) + "\n" + bad + "\n" + _line(step=2) + "\n")
    with pytest.raises(InputError) as e:
        records.read_records(path)
    message = str(e.value)
    assert message.startswith(f"{path} line 2: ") and "\n" not in message
    assert needle in message, message


def test_a_huge_line_or_bytes_that_are_not_text_are_one_error(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    monkeypatch.setattr(records, "MAX_LINE_BYTES", 1 << 12)
    path.write_text(json.dumps(START) + "\n" + _line(pad="x" * 5000) + "\n")
    with pytest.raises(InputError, match=r"line 2: longer than"):
        records.read_records(path)
    path.write_bytes(json.dumps(START).encode() + b"\n\xff\xfe{}\n")
    with pytest.raises(InputError, match=r"line 2: not UTF-8 text"):
        records.read_records(path)


def test_a_cut_line_is_skipped_and_newer_kinds_and_events_are_kept_or_skipped(tmp_path):
    """What readers were promised stays: a line cut by a kill is skipped, unknown keys and kinds are ignored,
    an unknown event is kept as it is."""
    path = tmp_path / "metrics.jsonl"
    later = {"kind": "event", "event": "later", "step": 2, "what": [1]}
    path.write_text("\n".join([json.dumps(START), _line()[:40], _line(step=2, new_key=1),
                               json.dumps({"kind": "profile", "x": 1}), json.dumps(later)]) + "\n")
    got = records.read_records(path)
    assert [type(r) for r in got] == [records.StartEvent, records.TrainLine, records.OtherEvent]
    assert got[1].step == 2 and "new_key" not in got[1].to_json()
    assert got[2].to_json() == later


def test_a_hostile_metrics_file_is_one_line_from_train_report(tmp_path):
    from typer.testing import CliRunner

    from memplan.cli import app

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(START) + "\n" + _line(tokens_per_second="fast") + "\n")
    result = CliRunner().invoke(app, ["train", "--out", str(run), "--report"])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"memplan: error: {run / 'metrics.jsonl'} "
                                                                        "line 2: 'tokens_per_second'"), result.stderr
    assert not (run / "report.html").exists()


# ---- memplan train --nproc: resolved once, handed to the ranks in RUN/launch.json --------------------------------

TINY = ["--arch", "llama", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "2", "--ffn", "64",
        "--ctx", "32", "--batch", "2", "--precision", "fp32", "--max-steps", "2", "--sample-tokens", "0"]


@pytest.fixture
def launched(monkeypatch):
    """torchrun's launcher replaced by a recorder: the arguments `memplan train --nproc` starts it with."""
    import torch.distributed.run

    calls = []
    monkeypatch.setattr(torch.distributed.run, "run", calls.append)
    monkeypatch.setenv("MEMPLAN_LAUNCHED_BY", "")  # restored after: the launcher sets it for its ranks
    return calls


def _memplan(*args):
    from typer.testing import CliRunner

    from memplan.cli import app

    return CliRunner().invoke(app, list(args))


def test_nproc_resolves_the_run_once_and_starts_each_rank_with_the_run_directory_alone(corpus, tmp_path, launched):
    from trainer.train_run import read_launch

    run = tmp_path / "run"
    result = _memplan("train", "--nproc", "2", "--data", str(corpus), "--out", str(run), *TINY, "--lr", "1e-3",
                      "--prompt", "The")
    assert result.exit_code == 0, result.output
    (args,) = launched
    assert args.module and args.training_script == "trainer" and args.training_script_args == [str(run)]
    assert args.nproc_per_node == "2"
    spec = read_launch(run)
    assert spec.plan["setup"]["world_size"] == 2 and spec.plan["setup"]["sharding"] == "ddp"
    assert spec.config["max_steps"] == 2 and spec.config["lr"] == 1e-3 and spec.config["prompts"] == ["The"]
    assert spec.data == str(corpus.resolve()) and not spec.resume and spec.nproc == 2
    assert sorted(p.name for p in run.iterdir()) == ["launch.json"]  # the ranks write the rest


def test_a_rank_builds_its_run_from_the_launch_file_not_from_flags(corpus, tmp_path, launched, capsys, monkeypatch):
    """One process given RUN (no torchrun) takes the plan in RUN/launch.json, made for 2 processes: refused in
    one line, as the plan says, before anything is written."""
    from trainer.__main__ import entry

    run = tmp_path / "run"
    assert _memplan("train", "--nproc", "2", "--data", str(corpus), "--out", str(run), *TINY).exit_code == 0
    monkeypatch.delenv("MEMPLAN_LAUNCHED_BY")  # launched by hand, not by memplan
    with pytest.raises(SystemExit) as e:
        entry([str(run)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m trainer: error: the plan is for --world-size 2 but 1 process(es) run it; launch it "
                   "with `memplan train --nproc 2` (torchrun)"]
    assert sorted(p.name for p in run.iterdir()) == ["launch.json"]


def test_nproc_refuses_a_run_directory_in_use_before_anything_is_launched_or_written(corpus, tmp_path, launched):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    result = _memplan("train", "--nproc", "2", "--data", str(corpus), "--out", str(run), *TINY)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "already holds a run; add --resume" in result.stderr
    assert not launched and sorted(p.name for p in run.iterdir()) == ["run.json"]
    result = _memplan("train", "--nproc", "2", "--out", str(tmp_path / "none"), "--resume")
    assert result.exit_code == 2 and "--resume: " in result.stderr and result.stderr.count("\n") == 1
    assert not launched and not (tmp_path / "none").exists()


def _spec(corpus) -> dict:
    from memplan.model import ModelSpec
    from memplan.plan import Plan
    from memplan.setup import TrainSetup
    from trainer.loop import TrainConfig
    from trainer.train_run import LaunchSpec

    plan = Plan(model=ModelSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=300, tied=True),
                setup=TrainSetup(ctx=32, micro_batch=2, precision="fp32", world_size=2, sharding="ddp"), device="cpu")
    return LaunchSpec(resume=False, data=str(corpus), plan=plan.to_dict(), config=TrainConfig(max_steps=2).to_dict(),
                      overrides={}, sharding=None, device=None, device_memory=None, threads=None, starting=None,
                      log=[], nproc=2).to_json()


@pytest.mark.parametrize("change, needle", [
    (lambda d: d.update(format="other"), "not a memplan launch file"),
    (lambda d: d.update(version=9), "launch file version 9; this memplan reads 1"),
    (lambda d: d.pop("plan"), "no 'plan'"),
    (lambda d: d.update(plan=None), "a new run without its 'plan'"),
    (lambda d: d.update(nproc="2"), "'nproc' is \"2\"; accepted: a whole number"),
    (lambda d: d.update(sharding="zero"), "'sharding' is 'zero'; accepted: ddp, fsdp or null"),
    (lambda d: d.update(resume=True), "a new run carries its 'config', a resume none"),
    (lambda d: d.update(log=[3]), "'log' is 3; accepted: a string"),
    (lambda d: d.update(starting={"path": "x"}), "'starting'['model_type'] is null"),
])
def test_a_tampered_launch_file_is_one_error_naming_it(corpus, tmp_path, change, needle):
    from trainer.train_run import read_launch

    body = _spec(corpus)
    change(body)
    (tmp_path / "launch.json").write_text(json.dumps(body))
    with pytest.raises(InputError) as e:
        read_launch(tmp_path)
    assert str(e.value).startswith(str(tmp_path / "launch.json")) and "\n" not in str(e.value)
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("config, needle", [
    ({"lr": "fast"}, "config 'lr' is \"fast\"; accepted: a number"),
    ({"lr": -1.0}, "config: --lr: -1.0 must be a positive number"),
    ({"min_lr_ratio": [0.1]}, "config 'min_lr_ratio' is [0.1]"),
    ({"prompts": "The"}, "config 'prompts' is \"The\"; accepted: a list"),
    ({"verify_data": "yes"}, "config 'verify_data' is \"yes\"; accepted: true or false"),
    ({"steps": 3}, "config 'steps' is not a training setting"),
    ({"plan": {"model": {"layers": "x"}}}, "launch.json: plan: --layers: 'x' must be a positive integer"),
])
def test_a_launch_file_with_bad_settings_or_plan_is_refused_in_one_line(corpus, tmp_path, config, needle):
    from trainer.train_run import TrainUI, read_launch, resolve_launch

    body = _spec(corpus)
    if "plan" in config:
        body["plan"]["model"].update(config["plan"]["model"])
    else:
        body["config"].update(config)
    (tmp_path / "launch.json").write_text(json.dumps(body))
    with pytest.raises(InputError) as e:
        resolve_launch(read_launch(tmp_path), tmp_path, TrainUI())
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("raw, needle", [
    (b'{"format": NaN}', "unreadable (ValueError: NaN is not a number JSON holds)"),
    (b"\xff\xfe", "unreadable (UnicodeDecodeError"),
    (b"[" * 100_000, "unreadable (RecursionError"),
    (b"[1]", "not a memplan launch file"),
])
def test_a_launch_file_that_is_not_json_or_too_large_is_one_error(tmp_path, monkeypatch, raw, needle):
    from trainer import train_run

    (tmp_path / "launch.json").write_bytes(raw)
    with pytest.raises(InputError, match=re.escape(needle)):
        train_run.read_launch(tmp_path)
    monkeypatch.setattr(train_run, "MAX_LAUNCH_BYTES", 10)
    (tmp_path / "launch.json").write_bytes(b" " * 11)
    with pytest.raises(InputError, match="larger than"):
        train_run.read_launch(tmp_path)
    (tmp_path / "launch.json").unlink()
    with pytest.raises(InputError, match="missing"):
        train_run.read_launch(tmp_path)


def _ranks(*args: str, via: str):
    """2 gloo ranks on this CPU: `memplan train --nproc 2 ARGS` or `torchrun --nproc-per-node 2 -m trainer ARGS`."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    env.pop("MEMPLAN_LAUNCHED_BY", None)
    cmd = ([sys.executable, "-m", "memplan", "train", "--nproc", "2"] if via == "memplan" else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "trainer"])
    return subprocess.run(cmd + list(args), capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


@pytest.mark.distributed
def test_ranks_train_the_run_their_launch_file_describes_and_refuse_a_tampered_one(corpus, tmp_path):
    from trainer.rundir import read_metrics

    run = tmp_path / "run"
    done = _ranks("--data", str(corpus), "--out", str(run), *TINY, via="memplan")
    assert done.returncode == 0, done.stderr[-3000:]
    (start,) = [l for l in read_metrics(run) if l.get("event") == "start"]
    spec = json.loads((run / "launch.json").read_text())
    assert start["config"] == spec["config"] and start["setup"]["world_size"] == 2
    assert [l["step"] for l in read_metrics(run) if l["kind"] == "train"] == [1, 2]

    # the same file with other settings, launched by hand: the ranks train what the file says
    again = tmp_path / "again"
    again.mkdir()
    spec["config"].update(max_steps=3, seed=7)
    (again / "launch.json").write_text(json.dumps(spec))
    done = _ranks(str(again), via="torchrun")
    assert done.returncode == 0, done.stderr[-3000:]
    (start,) = [l for l in read_metrics(again) if l.get("event") == "start"]
    assert start["config"]["seed"] == 7 and [l["step"] for l in read_metrics(again) if l["kind"] == "train"] == [1, 2, 3]

    # a tampered file: one line, from rank 0 only, and nothing written
    bad = tmp_path / "bad"
    bad.mkdir()
    spec["config"]["lr"] = "fast"
    (bad / "launch.json").write_text(json.dumps(spec))
    done = _ranks(str(bad), via="torchrun")
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert errors == [f"python -m trainer: error: {bad / 'launch.json'}: config 'lr' is \"fast\"; accepted: a number"]
    assert sorted(p.name for p in bad.iterdir()) == ["launch.json"]


@pytest.mark.distributed
def test_ranks_start_from_the_checkpoint_the_launch_file_names(tmp_path, hf_checkpoint, hf_data):
    """`memplan train --nproc 2 --from CHECKPOINT`: the launcher records the checkpoint (path, sha256 of its weights)
    in launch.json; the ranks start from those weights, as one process does at the same global batch."""
    from typer.testing import CliRunner

    from memplan.cli import app
    from trainer.rundir import read_metrics

    ck, _ = hf_checkpoint
    flags = ["--from", str(ck), "--data", str(hf_data), "--ctx", "32", "--precision", "fp32", "--max-steps", "1",
             "--device", "cpu", "--sample-tokens", "0", "--eval-batches", "1"]
    done = _ranks(*flags, "--batch", "2", "--out", str(tmp_path / "two"), via="memplan")
    assert done.returncode == 0, done.stderr[-3000:]
    spec = json.loads((tmp_path / "two" / "launch.json").read_text())
    record = json.loads((tmp_path / "two" / "run.json").read_text())
    assert spec["starting"] == record["base_hf"] and spec["starting"]["path"] == str(ck.resolve())
    one = CliRunner().invoke(app, ["train", *flags, "--batch", "2", "--grad-accum", "2", "--out", str(tmp_path / "one")])
    assert one.exit_code == 0, one.output
    first = [[l["loss"] for l in read_metrics(tmp_path / run) if l["kind"] == "train"][0] for run in ("two", "one")]
    assert first[0] == pytest.approx(first[1], abs=1e-3)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    from test_hf_import import tokenizer, write_checkpoint
    from test_train_from import llama_config

    directory = tmp_path_factory.mktemp("hf") / "tiny-llama"
    return directory, write_checkpoint(directory, llama_config(), tokenizer())


@pytest.fixture(scope="module")
def hf_data(hf_checkpoint, tmp_path_factory):
    from test_train_from import prepare

    return prepare(tmp_path_factory.mktemp("corpus"), str(hf_checkpoint[0]))

"""Hostile inputs of issue 30 (and the full-disk export of issue 29 item 3): a crafted checkpoint's metadata,
manifests naming files outside their corpus, concurrent exports, sizes beyond the shape search, logger checks
before anything is written, full disks under calibrate/autotune/export, and the small ones (a different
``--run`` on resume, renamed symlinks left behind, 0700 outputs, huge integers echoed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import InputError

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, **kwargs):
    return CliRunner().invoke(app, list(args), catch_exceptions=False, **kwargs)


# ---- 1: DCP metadata builds only the exact globals it holds ----------------------------------------------------

def _stack_global_payload(module: str, name: str, command: str) -> bytes:
    """A protocol-4 pickle calling ``module``'s dotted ``name`` (e.g. ``os.system``, resolved through the
    module's own imports) on ``command``: PROTO 4, module, name, STACK_GLOBAL, (command,), REDUCE, STOP."""
    def text(s: str) -> bytes:
        raw = s.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(command) + b"\x85" + b"R" + b"."


def test_a_dotted_name_in_dcp_metadata_runs_nothing(tmp_path):
    """A listed, checksummed ``dcp/.metadata`` (meta.json is not authenticated) whose protocol-4 STACK_GLOBAL names
    ``os.system`` inside torch.distributed.checkpoint.metadata (which imports os) is refused, and runs nothing.
    (A genuine .metadata still loads: tests/runs/test_hostile.py saves and loads one.)"""
    from trainer import distributed

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    marker = tmp_path / "code-ran"
    (tmp_path / "dcp").mkdir()
    payload = _stack_global_payload("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}")
    (tmp_path / "dcp" / ".metadata").write_bytes(payload)
    with pytest.raises(InputError, match=r"\.metadata: holds torch\.distributed\.checkpoint\.metadata\.os\.system"):
        distributed.load_sharded(tmp_path / "dcp", model, optimizer)
    assert not marker.exists(), "the crafted metadata ran os.system"


# ---- 2: a corpus manifest names only files inside the corpus ---------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from runs_helper import tiny_corpus

    return tiny_corpus(tmp_path_factory.mktemp("corpus"))


def _copied_corpus(corpus: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(corpus, dest)
    return dest


@pytest.mark.parametrize("where", ["parent", "absolute"])
@pytest.mark.parametrize("entry", ["shard", "tokenizer"])
def test_a_manifest_naming_a_file_outside_the_corpus_is_refused(tmp_path, corpus, entry, where):
    """A shard or tokenizer copied outside the corpus (same bytes, same sha256) and named there by a rewritten
    manifest.json (``../x`` or an absolute path) is refused in one line, not read."""
    import json
    import shutil

    from trainer.data import PreparedData

    copy = _copied_corpus(corpus, tmp_path / "corpus")
    manifest = json.loads((copy / "manifest.json").read_text())
    item = manifest["train"]["shards"][0] if entry == "shard" else manifest["tokenizer"]
    outside = tmp_path / f"outside-{Path(item['file']).name}"
    shutil.copyfile(copy / item["file"], outside)
    item["file"] = f"../{outside.name}" if where == "parent" else str(outside)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=r"manifest\.json: lists (shard|tokenizer) .*not a file inside the corpus"):
        PreparedData(copy).tokenizer


# ---- 3 (and issue 29 item 3): exports take a lock; a full disk is one line ------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus) -> Path:
    from runs_helper import tiny_run

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tiny_run(tmp_path_factory.mktemp("run") / "run", corpus, steps=2)
    finally:
        torch.set_num_threads(previous)


OUT_NAME = {"hf": "model", "gguf": "model.gguf", "onnx": "model.onnx"}


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _snapshot(path: Path) -> dict[str, bytes]:
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    return {path.name: path.read_bytes()}


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_a_second_export_to_the_same_out_is_refused_while_the_first_writes(tmp_path, run, monkeypatch, fmt):
    """Two exports to one new --out: the one that comes second (here, started while the first is writing) is
    refused in one line naming the PID that holds it; the first's output is what ends up there."""
    import importlib

    from runs_helper import one_line_error

    module = importlib.import_module(f"trainer.export.{fmt}")
    name = f"write_{fmt}"
    real = getattr(module, name)
    out = tmp_path / OUT_NAME[fmt]
    second, started = [], []

    def write_while_another_starts(run_, out_, dtype):
        if not started:  # (the second export, if it gets this far, writes at once)
            started.append(True)
            second.append(cli("export", "--run", str(run), "--format", fmt, "--out", str(out)))
        return real(run_, out_, dtype)

    monkeypatch.setattr(module, name, write_while_another_starts)
    first = cli("export", "--run", str(run), "--format", fmt, "--out", str(out))
    assert first.exit_code == 0, first.output
    one_line_error(second[0], f"--out {out}", "another memplan process", "is exporting to it")
    assert out.exists() and _entries(tmp_path) == [out.name]  # no lock file or temporary sibling left


@pytest.mark.parametrize("fmt", ["hf", "gguf"])  # (onnx goes through the same check; its export takes a minute)
def test_an_export_onto_a_full_disk_is_one_line_and_keeps_the_earlier_export(run, small_disk, fmt):
    from conftest import fill_disk

    out = small_disk / OUT_NAME[fmt]
    assert cli("export", "--run", str(run), "--format", fmt, "--out", str(out)).exit_code == 0
    before, entries = _snapshot(out), _entries(small_disk)
    fill_disk(small_disk, leave=8192)
    result = cli("export", "--run", str(run), "--format", fmt, "--out", str(out), "--force")
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert f"--out {out}: no space left on device" in lines[0] and "is intact" in lines[0], lines[0]
    assert _snapshot(out) == before
    assert _entries(small_disk) == sorted([*entries, "filler"])  # no partial output beside it


def test_an_export_onto_a_full_disk_leaves_nothing_where_there_was_nothing(run, small_disk):
    from conftest import fill_disk

    out = small_disk / "model"
    fill_disk(small_disk, leave=8192)
    result = cli("export", "--run", str(run), "--format", "hf", "--out", str(out))
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "nothing was written" in result.stderr
    assert _entries(small_disk) == ["filler"]


# ---- 7: renamed symlinks are removed; corpora and exports take the umask's mode ------------------------------

def test_export_force_over_a_symlinked_export_leaves_no_renamed_link(tmp_path, run):
    earlier = tmp_path / "earlier"
    assert cli("export", "--run", str(run), "--format", "hf", "--out", str(earlier)).exit_code == 0
    before = _snapshot(earlier)
    out = tmp_path / "model"
    out.symlink_to(earlier)
    result = cli("export", "--run", str(run), "--format", "hf", "--out", str(out), "--force")
    assert result.exit_code == 0, result.output
    assert out.is_dir() and not out.is_symlink()
    assert _entries(tmp_path) == ["earlier", "model"]  # no .model.old-… link left behind
    assert _snapshot(earlier) == before  # the link went, not what it pointed to


def test_checkpoint_pruning_leaves_no_renamed_link(tmp_path):
    from trainer import checkpoint_format as ckpt

    directory = tmp_path / "checkpoints"
    directory.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not the run's")
    (directory / ckpt.checkpoint_name(1)).symlink_to(elsewhere)  # an old "checkpoint" that is a link
    model = torch.nn.Linear(2, 2)
    ckpt.save_checkpoint(directory, 2, model, {}, {}, keep=1)
    assert _entries(directory) == [ckpt.checkpoint_name(2)]  # no .trash-step-… link left behind
    assert (elsewhere / "keep.txt").read_text() == "not the run's"


@pytest.fixture
def umask_022():
    import os

    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_prepared_corpora_and_hf_exports_take_the_umask_mode(tmp_path, corpus, run, umask_022):
    from runs_helper import tiny_corpus

    prepared = tiny_corpus(tmp_path, n=40)
    out = tmp_path / "model"
    assert cli("export", "--run", str(run), "--format", "hf", "--out", str(out)).exit_code == 0
    assert oct(prepared.stat().st_mode & 0o777) == oct(0o755)
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o644)}


# ---- 4: sizes above 13B follow the rule (or a table row), up to 10T; beyond, one line ------------------------

@pytest.mark.parametrize("size, shape", [
    ("13b", (40, 5120, 40, 40, 13824)),  # Llama-2-13B
    ("34b", (48, 8192, 64, 8, 22016)),  # Code Llama 34B
    ("70b", (80, 8192, 64, 8, 28672)),  # Llama-2-70B
])
def test_the_large_table_rows_are_llamas_published_shapes(size, shape):
    from memplan.model import from_size

    spec = from_size(size)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab, spec.tied) == (*shape, 32000,
                                                                                                        False)


@pytest.mark.parametrize("size, target", [("20b", 20e9), ("175b", 175e9), ("1t", 1e12), ("10t", 1e13)])
def test_sizes_beyond_the_old_depth_search_follow_the_rule(size, target):
    """hidden = 64·layers, the depth whose count is closest: within a few percent of any size (before: every size
    above about 13B planned the 64-layer 12.55B model)."""
    from memplan.model import from_size

    spec = from_size(size)
    assert spec.hidden == 64 * spec.layers and spec.layers > 64
    assert abs(spec.params - target) / target < 0.03, spec.params


def test_a_size_beyond_the_largest_planned_is_one_line():
    from runs_helper import one_line_error

    one_line_error(cli("estimate", "--params", "20t", "--device", "h100-sxm"), "--params", "largest size planned")


# ---- 5: --log's loggers are checked before anything is created or appended -----------------------------------

TINY = ["--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "2", "--kv-heads", "2", "--ffn", "128",
        "--ctx", "64", "--batch", "4", "--precision", "fp32", "--sample-tokens", "0", "--threads", "1",
        "--device", "cpu"]


def _tree(run_dir: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(run_dir)): None if p.is_dir() else p.read_bytes()
            for p in sorted(run_dir.rglob("*")) if not p.is_symlink()}


@pytest.mark.parametrize("logger, plant", [("tensorboard", "file"), ("tensorboard", "symlink"),
                                           ("tensorboard", "read-only"), ("wandb", "file"), ("wandb", "read-only")])
def test_an_unusable_logger_directory_is_one_line_before_the_resume_writes(tmp_path, run, logger, plant):
    import shutil

    from conftest import read_only_directory
    from runs_helper import one_line_error

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    where = copy / logger
    needle = {"file": "is a file", "symlink": "symbolic link", "read-only": "cannot write"}[plant]
    if plant == "file":
        where.write_text("not a directory")
    elif plant == "symlink":
        (tmp_path / "elsewhere").mkdir()
        where.symlink_to(tmp_path / "elsewhere")
    with read_only_directory(where) if plant == "read-only" else _nothing():
        before = _tree(copy)
        result = cli("train", "--out", str(copy), "--resume", "--max-steps", "3", "--log", logger)
        one_line_error(result, f"--log {logger}", str(where), needle)
        assert _tree(copy) == before  # no resume event appended, nothing created
    if plant == "symlink":
        assert list((tmp_path / "elsewhere").iterdir()) == []


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_a_missing_logging_package_leaves_no_run_directory(tmp_path, corpus, monkeypatch):
    import sys

    from runs_helper import one_line_error

    for name in ("tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # as where the package is not installed
    out = tmp_path / "run"
    result = cli("train", "--data", str(corpus), "--out", str(out), *TINY, "--max-steps", "1", "--log", "tensorboard")
    one_line_error(result, "--log tensorboard", "memplan[logging]")
    assert _entries(tmp_path) == []  # not even RUN/.lock


def test_an_invalid_wandb_mode_is_one_line_before_anything_runs(tmp_path, corpus, monkeypatch):
    from runs_helper import one_line_error

    monkeypatch.setenv("WANDB_MODE", "sometimes")
    out = tmp_path / "run"
    result = cli("train", "--data", str(corpus), "--out", str(out), *TINY, "--max-steps", "1", "--log", "wandb")
    one_line_error(result, "--log wandb", "WANDB_MODE='sometimes'", "offline")
    assert _entries(tmp_path) == []


# ---- 6: calibrate --out and autotune --out onto a full disk ----------------------------------------------------

AUTOTUNE = ["autotune", "--params", "22m", "--device", "cpu", "--ctx", "256"]


def _one_line_failure(result, *needles):
    assert result.exit_code == 1, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize("command", ["calibrate", "autotune"])
def test_out_onto_a_full_disk_is_refused_before_the_work(small_disk, monkeypatch, command):
    import memplan.autotune as planner
    import trainer.calibrate

    from conftest import fill_disk

    monkeypatch.setattr(trainer.calibrate, "calibrate", lambda *a, **k: pytest.fail("measured onto a full disk"))
    monkeypatch.setattr(planner, "autotune", lambda *a, **k: pytest.fail("planned onto a full disk"))
    old = small_disk / "old.toml"
    old.write_text("the earlier file")
    fill_disk(small_disk)
    args = ["calibrate", "--seconds", "1"] if command == "calibrate" else AUTOTUNE
    result = cli(*args, "--out", str(old), "--force") if command == "calibrate" else cli(*args, "--out", str(old))
    _one_line_failure(result, "--out", "free on its disk")
    assert old.read_text() == "the earlier file" and _entries(small_disk) == ["filler", "old.toml"]


def test_autotune_out_onto_a_disk_that_fills_meanwhile_is_one_line_and_keeps_the_earlier_plan(small_disk,
                                                                                             monkeypatch):
    import memplan.autotune as planner

    from conftest import fill_disk

    old = small_disk / "plan.toml"
    old.write_text("the earlier plan")
    real = planner.autotune

    def filling(*args, **kwargs):
        fill_disk(small_disk)  # someone else's download lands while it plans
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "autotune", filling)
    result = cli(*AUTOTUNE, "--out", str(old))
    _one_line_failure(result, f"--out {old}: no space left on device", "the earlier", "is intact")
    assert old.read_text() == "the earlier plan" and _entries(small_disk) == ["filler", "plan.toml"]


# ---- 7: finetune --resume names its own base; counts are exact ------------------------------------------------

def test_finetune_resume_with_another_run_is_refused_in_one_line(tmp_path, run):
    import json
    import shutil

    from runs_helper import one_line_error

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Which animal is {i}?", "response": f"The cat is {i}."}) + "\n"
                            for i in range(12)))
    out = tmp_path / "ft"
    first = cli("finetune", "--run", str(run), "--data", str(data), "--out", str(out), "--batch", "4",
                "--max-steps", "1", "--save-every", "1", "--eval-every", "1", "--sample-tokens", "0", "--threads", "1")
    assert first.exit_code == 0, first.output
    other = tmp_path / "other-run"  # the same run copied: same tokenizer, another base directory
    shutil.copytree(run, other)
    before = (out / "metrics.jsonl").read_bytes()
    result = cli("finetune", "--run", str(other), "--data", str(data), "--out", str(out), "--resume",
                 "--max-steps", "2", "--threads", "1")
    one_line_error(result, f"--run {other}", f"was finetuned from --run {run.resolve()}")
    assert (out / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize("text, binary, value", [("9223372036854775807", True, 2**63 - 1),
                                                 ("1000000000000000000000000001", False, 10**27 + 1),
                                                 ("1.5m", False, 1_500_000), ("0.5k", True, 512)])
def test_counts_are_parsed_exactly(text, binary, value):
    """``--ctx 9223372036854775807`` is that number, not 2**63 (a float's nearest)."""
    from memplan.units import parse_count

    assert parse_count(text, "--ctx", binary=binary) == value

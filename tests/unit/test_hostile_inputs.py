"""Hostile inputs that once ended in a traceback or a wrong answer (issue 14, item 18): each is now one line
on stderr naming the problem and the accepted values, exit 2, nothing on disk lost.

- ``--device`` that is a directory, empty, binary, unreadable or of wrong types, for every command taking it;
- a profile whose numbers are 0, negative, nan or inf (nan bandwidth used to halve step times silently),
  loaded by path and as a bundled profile;
- a Hugging Face config.json with hostile values (strings, floats, bools, 1e30, huge, non-objects, bad
  UTF-8, 100 MB, heads that do not divide), each named by its key;
- an unwritable ``MEMPLAN_CACHE``: planning commands still answer and say so; the quick start refuses;
- integer and float options out of range (``autotune --top -1``), refused by one rule (memplan.units);
- ``autotune --out`` / ``export --out`` in a missing or read-only directory, refused before any work.

In-process (typer's CliRunner); a read-only directory is a read-only tmpfs where this runs as root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import read_only_directory
from memplan.cli import app
from runs_helper import one_line_error

REPO = Path(__file__).resolve().parents[2]
CPU_TOML = (REPO / "memplan" / "profiles" / "cpu.toml").read_text()
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def cli(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def assert_one_line(result, *needles):
    line = one_line_error(result, *needles)
    assert "Traceback" not in result.output and "Traceback" not in result.stderr
    return line


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can write in, holding ``good.toml`` (conftest's ``read_only_directory``)."""
    with read_only_directory(tmp_path / "ro", {"good.toml": "kept = true\n"}) as d:
        yield d


# ---- --device that is no profile file -------------------------------------------------------------

DEVICE_COMMANDS = {
    "estimate": ["estimate"],
    "autotune": ["autotune"],
    "sweep": ["sweep", "--ctx", "1k"],
    "trace": ["trace"],
    "validate": ["validate", "--quick"],
    "train": ["train", "--max-steps", "1"],
}


@pytest.mark.parametrize("command", sorted(DEVICE_COMMANDS))
def test_device_that_is_a_directory_is_one_line_for_every_command(tmp_path, command):
    folder = tmp_path / "profiles"
    folder.mkdir()
    assert_one_line(cli(*DEVICE_COMMANDS[command], "--device", str(folder)), "--device", str(folder), "directory")


def _profile(tmp_path: Path, text: str | bytes, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize("content, needles", [
    ("", ["is empty", "accepted"]),
    (bytes(range(256)) * 4, ["not UTF-8", "accepted"]),
    (CPU_TOML.replace("total_bytes = 17179869184", 'total_bytes = "16GiB"'),
     ["memory.total_bytes", "'16GiB'", "accepted: a finite number"]),
    (CPU_TOML.replace("match = []", "match = 5"), ["match = 5", "accepted: a list of non-empty strings"]),
    (CPU_TOML.replace('title = "Generic', 'title = ["Generic').replace('RAM)"', 'RAM)"]'), ["title", "a string"]),
], ids=["empty", "binary", "string-size", "match-int", "title-list"])
def test_device_file_of_the_wrong_kind_is_one_line(tmp_path, content, needles):
    path = _profile(tmp_path, content)
    assert_one_line(cli("estimate", "--device", str(path)), str(path), *needles)


# Root reads any file: as root the command runs without the capabilities that let it (util-linux's setpriv).
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search", "--"]


@pytest.mark.skipif(ROOT and shutil.which("setpriv") is None, reason="root reads any file, and setpriv is missing")
def test_device_file_that_cannot_be_read_is_one_line(tmp_path):
    path = _profile(tmp_path, CPU_TOML)
    path.chmod(0)
    if not ROOT:
        assert_one_line(cli("estimate", "--device", str(path)), str(path), "cannot be read")
        return
    r = subprocess.run([*NO_DAC, sys.executable, "-m", "memplan", "estimate", "--device", str(path)],
                       capture_output=True, text=True, timeout=120)
    r.exit_code = r.returncode
    r.output = r.stdout + r.stderr
    assert_one_line(r, str(path), "cannot be read")


# ---- profile numbers: finite and > 0 where they must be ------------------------------------------

BAD_NUMBERS = [
    ("fp32 = 0.768", "fp32 = 0", "peak_tflops.fp32", "0"),
    ("fp32 = 0.768", "fp32 = nan", "peak_tflops.fp32", "nan"),
    ("fp32 = 0.768", "fp32 = inf", "peak_tflops.fp32", "inf"),
    ("bandwidth_bytes_per_second = 51.2e9", "bandwidth_bytes_per_second = nan", "memory.bandwidth_bytes_per_second",
     "nan"),
    ("bandwidth_bytes_per_second = 51.2e9", "bandwidth_bytes_per_second = inf", "memory.bandwidth_bytes_per_second",
     "inf"),
    ("total_bytes = 17179869184", "total_bytes = nan", "memory.total_bytes", "nan"),
    ("context_bytes = 357690839", "context_bytes = inf", "runtime.context_bytes", "inf"),
    ("allocator_overhead = 0.043", "allocator_overhead = nan", "runtime.allocator_overhead", "nan"),
    ("bandwidth_bytes_per_second = 125e6", "bandwidth_bytes_per_second = nan",
     "interconnect.bandwidth_bytes_per_second", "nan"),
    ("latency_seconds = 9.6e-6", "latency_seconds = inf", "interconnect.latency_seconds", "inf"),
]


@pytest.mark.parametrize("old, new, key, value", BAD_NUMBERS, ids=[f"{k}={v}" for _, _, k, v in BAD_NUMBERS])
def test_profile_number_that_is_not_finite_and_positive_is_one_line(tmp_path, old, new, key, value):
    assert CPU_TOML.count(old) == 1
    path = _profile(tmp_path, CPU_TOML.replace(old, new))
    line = assert_one_line(cli("estimate", "--device", str(path)), str(path), f"{key} = {value}", "finite")
    assert "accepted" in line or "values a finite number" in line


def test_calibrated_rate_of_inf_is_one_line(tmp_path):
    path = _profile(tmp_path, CPU_TOML + "\n[calibrated]\nthreads = 1\n\n[calibrated.matmul_tflops]\nfp32 = inf\n")
    assert_one_line(cli("estimate", "--device", str(path)), "calibrated.matmul_tflops.fp32", "finite")


def test_a_bundled_profile_with_nan_bandwidth_is_refused_naming_its_file(tmp_path, monkeypatch):
    from memplan import hardware

    shipped = tmp_path / "profiles"
    shipped.mkdir()
    for p in (REPO / "memplan" / "profiles").glob("*.toml"):
        (shipped / p.name).write_text(p.read_text())
    bad = shipped / "l4.toml"
    text = bad.read_text()
    line = next(l for l in text.splitlines() if l.startswith("bandwidth_bytes_per_second"))
    bad.write_text(text.replace(line, "bandwidth_bytes_per_second = nan"))
    monkeypatch.setattr(hardware, "_profiles_dir", lambda: shipped)
    assert_one_line(cli("profiles"), str(bad), "memory.bandwidth_bytes_per_second = nan", "finite")
    assert_one_line(cli("estimate", "--device", "l4"), str(bad), "memory.bandwidth_bytes_per_second = nan")


# ---- config.json -----------------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 128, "vocab_size": 1000}
HOSTILE_CONFIGS = {
    "string-hidden": ({**LLAMA, "hidden_size": "64"}, ["hidden_size = '64'", "whole number from 1"]),
    "negative-hidden": ({**LLAMA, "hidden_size": -64}, ["hidden_size = -64", "whole number from 1"]),
    "zero-layers": ({**LLAMA, "num_hidden_layers": 0}, ["num_hidden_layers = 0", "whole number from 1"]),
    "float-vocab": ({**LLAMA, "vocab_size": 1000.5}, ["vocab_size = 1000.5", "whole number"]),
    "bool-heads": ({**LLAMA, "num_attention_heads": True}, ["num_attention_heads = True", "whole number"]),
    "1e30-hidden": ({**LLAMA, "hidden_size": 1e30}, ["hidden_size = 1e+30", "2,147,483,647"]),
    "huge-int-ffn": ({**LLAMA, "intermediate_size": 10**30}, ["intermediate_size = 1000", "2,147,483,647"]),
    "heads-not-dividing": ({**LLAMA, "hidden_size": 66}, ["num_attention_heads = 4", "hidden_size = 66",
                                                          "accepted: a divisor"]),
    "kv-not-dividing": ({**LLAMA, "num_key_value_heads": 3}, ["num_key_value_heads = 3", "accepted: a divisor"]),
    "string-rope-theta": ({**LLAMA, "rope_theta": "fast"}, ["rope_theta = 'fast'", "finite number > 0"]),
    "nan-norm-eps": ({**LLAMA, "rms_norm_eps": float("nan")}, ["rms_norm_eps = nan", "finite number > 0"]),
    "gpt2-string-positions": ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100,
                               "n_positions": "1k"}, ["n_positions = '1k'", "whole number"]),
    "array": ([1, 2], ["JSON array", "accepted: a JSON object"]),
    "null": (None, ["JSON null", "accepted: a JSON object"]),
}


@pytest.mark.parametrize("name", list(HOSTILE_CONFIGS))
def test_config_json_hostile_value_is_one_line_naming_the_key(tmp_path, name):
    cfg, needles = HOSTILE_CONFIGS[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert_one_line(cli("estimate", "--device", "cpu", "--model", str(path)), str(path), *needles)


def test_config_json_of_invalid_utf8_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "llama", "name": "\xff\xfe"}')
    assert_one_line(cli("estimate", "--device", "cpu", "--model", str(path)), "not UTF-8", "accepted")


def test_config_json_of_100_mb_is_refused_by_its_size(tmp_path):
    path = tmp_path / "config.json"
    with open(path, "w") as f:  # valid JSON, which the old reader parsed whole before finding keys missing
        f.write('{"model_type": "llama", "pad": "')
        f.write("x" * (100 * 2**20))
        f.write('"}')
    assert_one_line(cli("estimate", "--device", "cpu", "--model", str(path)), str(path), "1 MiB", "accepted")


# ---- MEMPLAN_CACHE that cannot be written -----------------------------------------------------------

def _bad_cache(tmp_path: Path, kind: str, read_only: Path | None = None) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    return {"file": blocker, "under-file": blocker / "cache", "read-only": read_only}[kind]


@pytest.mark.parametrize("kind", ["file", "under-file", "read-only"])
@pytest.mark.parametrize("command", [["estimate"], ["autotune", "--json"]])
def test_planning_with_an_unwritable_cache_answers_and_says_so(tmp_path, request, kind, command):
    cache = _bad_cache(tmp_path, kind, request.getfixturevalue("read_only_dir") if kind == "read-only" else None)
    result = cli(*command, env={"MEMPLAN_CACHE": str(cache)})
    assert result.exit_code in (0, 3), (result.exit_code, result.output)
    assert "Traceback" not in result.output
    text = " ".join(result.stdout.split())  # the rates line, whatever the terminal's wrapping
    assert "not writable" in text or "is a file" in text or "lies under the file" in text, text
    assert "MEMPLAN_CACHE" in text


@pytest.mark.parametrize("kind", ["file", "under-file", "read-only"])
def test_quick_start_with_an_unwritable_cache_is_one_line_naming_it(tmp_path, request, kind, monkeypatch):
    cache = _bad_cache(tmp_path, kind, request.getfixturevalue("read_only_dir") if kind == "read-only" else None)
    from memplan import local

    monkeypatch.setattr(local, "find_calibration", lambda *a, **k: None)  # as on a machine never calibrated
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert_one_line(cli("train", "--out", str(tmp_path / "run"), env={"MEMPLAN_CACHE": str(cache)}),
                    str(cache), "MEMPLAN_CACHE")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no run directory, nothing written
    assert not (tmp_path / "run").exists()


# ---- a family memplan's own trainer does not build --------------------------------------------------

@pytest.mark.parametrize("sharded", [[], ["--world-size", "2", "--sharding", "fsdp"]], ids=["one", "fsdp"])
def test_trace_of_a_family_its_trainer_does_not_build_is_one_line_naming_the_stacks_that_do(sharded):
    """``trace --model qwen3-0.6b`` (``--stack memplan``, the default) is refused as estimate refuses it, before
    any trace: memplan's own model has no separate head width, and its view of qwen3's q raised a traceback."""
    line = assert_one_line(cli("trace", "--model", "qwen3-0.6b", "--layers", "2", "--ctx", "64", *sharded),
                           "--stack memplan", "qwen3", "transformers")
    assert line == one_line_error(cli("estimate", "--model", "qwen3-0.6b", "--layers", "2", "--ctx", "64", *sharded))


# ---- numeric options: one rule -----------------------------------------------------------------------

@pytest.mark.parametrize("args, needles", [
    (["autotune", "--top", "-1"], ["--top", "-1", "from 1"]),
    (["autotune", "--top", "0"], ["--top", "from 1"]),
    (["autotune", "--verify-steps", "0"], ["--verify-steps", "from 2"]),
    (["autotune", "--verify-steps", "-3"], ["--verify-steps", "from 2"]),
    (["autotune", "--margin", "nan"], ["--margin", "finite", "[0, 1)"]),
    (["calibrate", "--seconds", "inf"], ["--seconds", "finite"]),
], ids=["top-1", "top0", "verify-steps0", "verify-steps-3", "margin-nan", "seconds-inf"])
def test_numeric_option_out_of_range_is_one_line_with_the_range(args, needles):
    line = assert_one_line(cli(*args, "--device", "cpu") if args[0] == "autotune" else cli(*args), *needles)
    assert "accepted" in line


def test_units_rule_refuses_nan_inf_and_out_of_range():
    from memplan.errors import InputError
    from memplan.units import parse_float, parse_int

    assert parse_int("8", "--top") == 8 and parse_float("0.5", "--x", low=0, high=1) == 0.5
    for text in ("-1", "0", "1.5", "nan", "", True):
        with pytest.raises(InputError, match="--top.*accepted: a whole number from 1"):
            parse_int(text, "--top")
    for text in ("nan", "inf", "-inf", "1", "-0.1", "x"):
        with pytest.raises(InputError, match=r"--x.*accepted: a finite number in \[0, 1\)"):
            parse_float(text, "--x", low=0, high=1, high_open=True)


# ---- --out in a missing or read-only directory -------------------------------------------------------

def test_autotune_out_in_a_read_only_directory_is_refused_before_work_and_keeps_the_file(read_only_dir,
                                                                                       monkeypatch):
    import memplan.autotune as planner

    monkeypatch.setattr(planner, "autotune", lambda *a, **k: pytest.fail("planned before --out was checked"))
    good = read_only_dir / "good.toml"
    for target in (good, read_only_dir / "plan.toml"):
        assert_one_line(cli("autotune", "--device", "cpu", "--out", str(target)), "--out", str(read_only_dir))
    assert good.read_text() == "kept = true\n"


@pytest.mark.parametrize("where", ["missing-dir", "under-a-file", "a-directory"])
def test_autotune_out_that_cannot_be_a_file_is_refused_before_work(tmp_path, monkeypatch, where):
    import memplan.autotune as planner

    monkeypatch.setattr(planner, "autotune", lambda *a, **k: pytest.fail("planned before --out was checked"))
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-dir").mkdir()
    target = {"missing-dir": tmp_path / "nowhere" / "plan.toml", "under-a-file": tmp_path / "a-file" / "plan.toml",
              "a-directory": tmp_path / "a-dir"}[where]
    assert_one_line(cli("autotune", "--device", "cpu", "--out", str(target)), "--out")
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("fmt, name", [("hf", "model"), ("gguf", "model.gguf")])
def test_export_out_in_a_read_only_or_missing_directory_is_refused_before_work(tmp_path, read_only_dir, fmt, name,
                                                                               monkeypatch):
    import trainer.export as export

    monkeypatch.setattr(export, "load_run", lambda *a, **k: pytest.fail("read the run before --out was checked"))
    run = tmp_path / "run"  # never read: the --out check comes first
    assert_one_line(cli("export", "--run", str(run), "--format", fmt, "--out", str(read_only_dir / name)),
                    "--out", str(read_only_dir))
    assert_one_line(cli("export", "--run", str(run), "--format", fmt, "--out", str(tmp_path / "nowhere" / name)),
                    "--out", "does not exist")
    assert not (tmp_path / "nowhere").exists()
    assert (read_only_dir / "good.toml").read_text() == "kept = true\n"


def test_autotune_out_when_nothing_fits_does_not_write_through_a_planted_temporary_name(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = tmp_path / "plan.toml"
    (tmp_path / "plan.toml.tmp").symlink_to(victim)
    result = cli("autotune", "--params", "7b", "--device", "gtx-1650", "--out", str(path))
    assert result.exit_code == 3, result.output  # nothing fits: --out says so (memplan.plan.save_no_plan)
    assert victim.read_text() == "precious"
    assert not path.is_symlink() and "fits = false" in path.read_text()

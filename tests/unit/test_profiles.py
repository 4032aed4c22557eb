"""The bundled device profiles, their loader, and `memplan profiles`.

Expected figures come from the published sources the profiles cite (each table's ``source`` names
them and the figure they state), not from the profiles themselves.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.compat import tomllib
from memplan.errors import InputError
from memplan.hardware import device_from_toml, load_profile, match_profile, profile_names
from memplan.units import GiB

PROFILES_DIR = Path(__file__).resolve().parents[2] / "memplan" / "profiles"

# The devices memplan ships a profile for: a 4 GB laptop GPU to an H200, AMD, Apple and the CPU fallback.
EXPECTED_NAMES = {
    "strix-halo", "gtx-1650", "rtx-3060-12gb", "rtx-3090", "rtx-4090", "l4", "a100-40gb", "a100-80gb",
    "h100-sxm", "h200", "mi300x", "rx-7900-xtx", "m3-max", "m4-max", "cpu",
}
SOURCED_TABLES = ("memory", "peak_tflops", "achievable", "runtime")


def run_cli(*args: str):
    return CliRunner().invoke(app, list(args))


# ---- the bundled files -----------------------------------------------------------------------

def test_the_fifteen_devices_are_bundled():
    assert set(profile_names()) == EXPECTED_NAMES


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_every_profile_loads_and_is_consistent(name):
    d = load_profile(name)
    assert d.name == name
    assert d.family in ("cuda", "rocm", "mps", "cpu")
    assert 0 < d.usable_bytes <= d.memory_bytes
    assert d.bandwidth_bytes_per_second > 1e9
    assert d.runtime_context_bytes > 0
    assert 0 <= d.allocator_overhead < 0.5
    assert d.native.get("fp32") is True
    # an achievable fraction only for a dtype with a peak, and a peak's dtype needs a native verdict
    assert set(d.achievable) <= set(d.peak_tflops)
    assert set(d.peak_tflops) <= set(d.native)
    assert all(0 < f <= 1 for f in d.achievable.values())
    # the context is counted in peak_reserved, so it must leave room in usable memory
    assert d.runtime_context_bytes < 0.2 * d.usable_bytes


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_every_number_carries_a_source(name):
    d = load_profile(name)
    for table in SOURCED_TABLES + ("native", "interconnect"):
        assert len(d.sources.get(table, "").strip()) > 10, f"{name}: [{table}] has no source"


def _carries_numbers(table: dict) -> bool:
    return any((isinstance(v, (int, float)) and not isinstance(v, bool))
               or (isinstance(v, dict) and _carries_numbers(v))
               or (isinstance(v, list) and any(isinstance(x, (int, float, list)) for x in v))
               for v in table.values())


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_every_table_of_figures_names_its_own_sources(name):
    """Read the file itself, so a table the loader does not know yet is held to the rule too: every
    table with a number carries a ``source`` that names where the figures come from. A bare label such as
    "S3" points at a list of sources that is not in the profile, so it does not count as naming one."""
    data = tomllib.loads((PROFILES_DIR / f"{name}.toml").read_text(encoding="utf-8"))
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    assert {"memory", "peak_tflops", "achievable", "runtime"} <= set(tables)
    for table, values in tables.items():
        if not _carries_numbers(values):
            continue
        source = values.get("source", "")
        assert isinstance(source, str) and len(source.strip()) > 20, f"{name}: [{table}] carries numbers but no source"
        assert not re.search(r"\bS[0-9]\b", source), f"{name}: [{table}] cites a bare label: {source!r}"


# Pointers out of the repository: a build machine's paths, a sibling checkout's files, and documents
# that only the project's authors had. Spelled in pieces so that this list does not match itself.
OUTSIDE_POINTERS = ("/" + "work/", "../" + "shared", "shared/" + "DESIGN" + ".md", "HARD" + "WARE.md", "DES" + "IGN.md")


def test_no_tracked_file_points_outside_the_repository():
    """Users get the repository and nothing else: no file may cite a path or a document outside it (the
    profiles name their published sources; the JSON and run directory are documented in docs/)."""
    root = PROFILES_DIR.parents[1]
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    offenders = []
    for name in filter(None, listed.decode("utf-8").split("\0")):
        path = root / name
        if not path.is_file():
            continue  # deleted in the working tree
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary (images)
        text = data.decode("utf-8", errors="replace")
        for i, line in enumerate(text.splitlines(), 1):
            offenders += [f"{name}:{i}: {p}" for p in OUTSIDE_POINTERS if p in line]
    assert not offenders, "files point outside the repository:\n" + "\n".join(offenders)


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_interconnect_is_described(name):
    link = load_profile(name).interconnect
    assert isinstance(link.get("kind"), str) and link["kind"]
    assert link["bandwidth_bytes_per_second"] > 0
    assert 0 < link["latency_seconds"] < 1e-3


# ---- device facts ----------------------------------------------------------------------------

def test_gtx_1650_has_no_fast_half_precision():
    d = load_profile("gtx-1650")
    assert d.native["fp16"] is False and not d.supports("fp16")
    assert "bf16" not in d.peak_tflops and not d.supports("bf16")
    # PyTorch's fp16 matmul there is slower than fp32 (0.34 vs 2.26 TFLOPS measured)
    assert d.matmul_flops_per_second("fp16") < d.matmul_flops_per_second("fp32")


def test_strix_halo_usable_memory_is_the_tuned_gtt_pool():
    d = load_profile("strix-halo")
    assert 96 * GiB < d.usable_bytes < 128e9  # above BIOS VGM's 96 GB, below the physical 128 GB
    assert d.memory_bytes == 128 * GiB
    assert d.memory_reader == "rocm-smi"
    assert "gttsize" in d.sources["memory"] and "pages_limit" in d.sources["memory"]


@pytest.mark.parametrize("name, dtype, dense", [
    ("h100-sxm", "bf16", 989.0),   # NVIDIA's 1,979 is with sparsity
    ("h100-sxm", "fp8", 1979.0),
    ("h200", "bf16", 989.0),
    ("a100-80gb", "bf16", 312.0),  # not 624
    ("l4", "bf16", 121.0),         # not 242
    ("mi300x", "bf16", 1307.0),    # not 2,615
    ("rtx-4090", "bf16", 165.2),   # FP32 accumulation, not 330
    ("rtx-3060-12gb", "fp16", 25.5),
])
def test_peaks_are_dense(name, dtype, dense):
    assert load_profile(name).peak_tflops[dtype] == pytest.approx(dense, abs=0.5)


def test_h100_usable_memory_is_what_torch_sees():
    d = load_profile("h100-sxm")
    assert d.memory_bytes == 85_520_809_984  # NVML's 81559 MiB
    assert 79 * GiB < d.usable_bytes < d.memory_bytes


def test_apple_profiles_are_the_largest_configuration():
    for name in ("m3-max", "m4-max"):
        d = load_profile(name)
        assert d.memory_bytes == 128 * GiB
        assert d.usable_bytes < d.memory_bytes  # Metal's working-set limit
        assert d.with_memory(64 * GiB).usable_bytes == pytest.approx(64 * GiB * d.usable_bytes / d.memory_bytes,
                                                                       abs=1)


def test_cpu_profile_takes_this_hosts_memory():
    d = load_profile("cpu")
    assert d.memory_bytes == psutil.virtual_memory().total
    assert 0 < d.usable_bytes <= d.memory_bytes
    assert 0 <= d.allocator_overhead < 0.2 and "benchmarks/cpu_runtime.py" in d.sources["runtime"]
    assert d.native.get("bf16") is False


@pytest.mark.parametrize("reported, family, expected", [
    ("NVIDIA GeForce RTX 4090", "cuda", "rtx-4090"),
    ("NVIDIA H100 80GB HBM3", "cuda", "h100-sxm"),
    ("NVIDIA A100-SXM4-80GB", "cuda", "a100-80gb"),
    ("NVIDIA L4", "cuda", "l4"),
    ("NVIDIA L40S", "cuda", None),          # "NVIDIA L4" must not match inside "L40S"
    ("NVIDIA H100 PCIe", "cuda", None),     # a different card from the SXM5 part
    ("NVIDIA GeForce GTX 1650", "cuda", "gtx-1650"),
    ("AMD Instinct MI300X", "rocm", "mi300x"),
    ("Radeon RX 7900 XTX", "rocm", "rx-7900-xtx"),
    ("Radeon 8060S Graphics", "rocm", "strix-halo"),
    ("Apple M4 Max", "mps", "m4-max"),
    ("Apple M3 Max", "cuda", None),         # the family must agree too
])
def test_driver_names_match_the_right_profile(reported, family, expected):
    found = match_profile(reported, family)
    assert (found.name if found else None) == expected


# ---- the loader's errors -------------------------------------------------------------------

def _without(text: str, line_start: str) -> str:
    kept = [ln for ln in text.splitlines() if not ln.startswith(line_start)]
    assert len(kept) == len(text.splitlines()) - 1, f"{line_start!r} is not exactly one line"
    return "\n".join(kept) + "\n"


@pytest.mark.parametrize("line_start, field", [
    ("usable_bytes =", "memory.usable_bytes"),
    ("total_bytes =", "memory.total_bytes"),
    ("bandwidth_bytes_per_second = 1.008e12", "memory.bandwidth_bytes_per_second"),
    ("context_bytes =", "runtime.context_bytes"),
    ("allocator_overhead =", "runtime.allocator_overhead"),
    ("family =", "family"),
    ("name =", "name"),
])
def test_a_missing_field_is_an_input_error_naming_it(tmp_path, line_start, field):
    broken = tmp_path / "broken.toml"
    broken.write_text(_without((PROFILES_DIR / "rtx-4090.toml").read_text(), line_start))
    with pytest.raises(InputError, match=rf"missing field {re.escape(field)}\b"):
        load_profile(str(broken))


def test_a_missing_table_is_an_input_error_naming_it(tmp_path):
    text = (PROFILES_DIR / "rtx-4090.toml").read_text()
    broken = tmp_path / "no-runtime.toml"
    broken.write_text(text.replace("[runtime]", "[runtime_typo]"))
    with pytest.raises(InputError, match=r"missing field runtime\b"):
        load_profile(str(broken))


@pytest.mark.parametrize("table, bad, message", [
    ({"achievable": {"fp32": 1.3}}, "achievable.fp32", "fraction"),
    ({"native": {"fp16": "false"}}, "native.fp16", "true/false"),
    ({"memory": {"usable_bytes": "lots"}}, "memory.usable_bytes", "number"),
    ({"peak_tflops": {"int4": 10.0}}, "peak_tflops.int4", "keys are"),
])
def test_a_wrong_value_is_an_input_error_naming_it(table, bad, message):
    from memplan.compat import tomllib

    data = tomllib.loads((PROFILES_DIR / "rtx-4090.toml").read_text())
    for key, values in table.items():
        data[key] = {**data[key], **values}
    with pytest.raises(InputError, match=re.escape(bad)) as err:
        device_from_toml(data, "test.toml")
    assert message in str(err.value)


def test_an_unknown_device_name_suggests_the_closest():
    with pytest.raises(InputError) as err:
        load_profile("rtx-409")
    message = str(err.value)
    assert "--device" in message
    assert "did you mean" in message and "rtx-4090" in message.split("did you mean")[1]


def test_a_missing_profile_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no such profile file"):
        load_profile(str(tmp_path / "nope.toml"))


def test_a_broken_profile_through_the_cli_names_the_field(tmp_path):
    if "estimate" not in {c.name or c.callback.__name__ for c in app.registered_commands}:
        pytest.skip("needs `memplan estimate --device PATH` (not on this branch yet)")
    broken = tmp_path / "broken.toml"
    broken.write_text(_without((PROFILES_DIR / "rtx-4090.toml").read_text(), "usable_bytes ="))
    result = run_cli("estimate", "--params", "124m", "--device", str(broken))
    assert result.exit_code == 2
    assert "memory.usable_bytes" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# ---- memplan profiles ------------------------------------------------------------------------

def test_profiles_json_lists_every_profile():
    result = run_cli("profiles", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) == 15
    assert {r["name"] for r in rows} == EXPECTED_NAMES
    for r in rows:
        for key in ("name", "title", "family", "memory_bytes", "usable_bytes", "bandwidth_bytes_per_second",
                    "peak_tflops", "achievable", "native", "runtime_context_bytes", "path"):
            assert key in r, f"{r.get('name')}: no {key}"
        assert isinstance(r["memory_bytes"], int) and isinstance(r["usable_bytes"], int)
        assert Path(r["path"]).is_file()


def test_profiles_json_best_dtype_is_the_fastest_native_one():
    rows = {r["name"]: r for r in json.loads(run_cli("profiles", "--json").stdout)}
    assert rows["gtx-1650"]["best_native_dtype"] == "fp32"  # fp16 is slower and bf16 absent there
    h100 = rows["h100-sxm"]
    assert h100["best_native_dtype"] == "bf16"
    assert h100["best_achievable_tflops"] == pytest.approx(989.0 * h100["achievable"]["bf16"], rel=1e-3)


def test_profiles_table_shows_every_profile():
    result = run_cli("profiles")
    assert result.exit_code == 0, result.output
    for name in EXPECTED_NAMES:
        assert re.search(rf"\b{re.escape(name)}\b", result.stdout), f"{name} missing from the table"
    assert "GiB" in result.stdout


def test_a_bad_option_exits_2_with_one_line_on_stderr():
    result = run_cli("profiles", "--bogus")
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memplan: error:") and "--bogus" in lines[0]


def test_profiles_does_not_import_torch():
    code = ("import sys; from typer.testing import CliRunner; from memplan.cli import app; "
            "r = CliRunner().invoke(app, ['profiles', '--json']); "
            "assert r.exit_code == 0, r.output; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PROFILES_DIR.parent, env={"PYTHONPATH": str(PROFILES_DIR.parent), "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

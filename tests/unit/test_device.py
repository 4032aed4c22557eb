"""trainer/device.py: the one owner of device helpers, and the GPU code paths that read through it.

No test here needs a GPU. A GPU is stood in for only at the reading functions of trainer/device.py
(its family, its torch device, the allocator's, the driver's and Metal's figures): the model and
the steps really run, on the CPU, and everything between the readers and the reported figures is
the code a GPU runs.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app
from memplan.hardware import load_profile
from memplan.memory import peak_memory
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from trainer import device as devices

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelSpec(arch="llama", layers=1, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, tied=True)
FP32 = TrainSetup(ctx=32, micro_batch=2, precision="fp32", attention="sdpa", optimizer="adamw")
GiB = 2**30


class FakeGPU:
    """The readers of trainer/device.py as a CUDA (or ROCm, or Apple) GPU would answer them; tensors stay
    on the CPU. Records the calls that matter for the order of reading."""

    def __init__(self, monkeypatch, family="cuda", peak_allocated=3 * GiB, peak_reserved=4 * GiB,
                 reserved=4 * GiB - 2**20, driver_used=5 * GiB, driver_source="NVML", outside=600 * 2**20):
        self.calls: list[str] = []
        self.family = family
        self.allocator = devices.AllocatorMemory(peak_allocated=peak_allocated, peak_reserved=peak_reserved,
                                                 reserved=reserved, alloc_retries=1, ooms=0)
        self.driver = (devices.DriverMemory(total=141 * GiB, used=driver_used, source=driver_source)
                       if driver_used is not None else None)
        self.outside = outside
        self.mps_samples = 0
        for name in ("local_family", "torch_device", "reset_allocator_peaks", "allocator_memory", "driver_memory",
                     "live_tensor_bytes", "outside_allocator_bytes", "mps_memory", "release_cached"):
            monkeypatch.setattr(devices, name, getattr(self, name))

    def local_family(self):
        return self.family

    def torch_device(self, family=None, index=None):
        return torch.device("cpu")

    def reset_allocator_peaks(self, device=None):
        self.calls.append("reset")

    def allocator_memory(self, device=None):
        self.calls.append("allocator")
        return self.allocator

    def driver_memory(self, index=0):
        self.calls.append("driver")
        return self.driver

    def live_tensor_bytes(self, device=None):
        return 0

    def outside_allocator_bytes(self, device=None):
        return self.outside

    def mps_memory(self):
        self.mps_samples += 1
        return 1000 + self.mps_samples, 5000 + 2 * self.mps_samples

    def release_cached(self, device):
        self.calls.append("release")


# ---- one owner, no cycles ------------------------------------------------------------------

DEVICE_LAYER = {"trainer.device", "trainer.wrapping", "trainer.step", "trainer.distributed", "trainer.measure",
                "trainer.calibrate", "trainer.verify", "trainer.validate", "trainer.monitor"}


def _import_graph(*packages: str) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports anywhere in its code (function-level imports included)."""
    modules = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            modules[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _reaches(graph, start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for nxt in graph[node]:
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_no_import_cycle_runs_through_the_device_layer():
    """step, distributed and measure imported each other (step -> distributed -> measure -> step); no module
    of the device layer may reach itself again through the package's imports, lazy ones included."""
    graph = _import_graph("trainer")
    cycles = sorted(m for m in DEVICE_LAYER if m in graph and _reaches(graph, m, m))
    assert cycles == []
    assert graph["trainer.device"] == set()  # a leaf


@pytest.mark.parametrize("package", ["trainer", "memplan"])
def test_no_module_of_either_package_reaches_itself_through_its_imports(package):
    """No import cycle anywhere: no module of ``package`` reaches itself again through the package's imports, lazy
    ones and a package's own ``__init__`` included (the CLI's commands register on ``memplan.cli.app``, the walk's
    ledger is ``memplan.memory.ledger``, the exporters share ``trainer.export.common``)."""
    graph = _import_graph(package)
    assert sorted(m for m in graph if _reaches(graph, m, m)) == []


def test_trainer_device_is_imported_without_starting_torch():
    """The CLI's parent of `autotune --verify` imports trainer.verify (and so trainer.device) without torch."""
    code = "import sys, trainer.device, trainer.verify; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("needle", ["def local_family", "import pynvml", "from pyrsmi", "/proc/self/clear_refs",
                                    "max_memory_reserved(", "max_memory_allocated(", "driver_allocated_memory(",
                                    "current_allocated_memory(", "memory_info().rss", "malloc_trim",
                                    "def torch_device", "def _torch_device", "def device_for"])
def test_each_device_helper_is_written_once_in_trainer_device(needle):
    """The family rule, the torch device, the NVML/ROCm SMI/torch/MPS readers, the RSS and its reset live
    in trainer/device.py alone."""
    holders = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "trainer").rglob("*.py")
                     if needle in "\n".join(line for line in p.read_text().splitlines()
                                            if not line.lstrip().startswith(("#", "-", "``"))))
    assert [h for h in holders if h != "trainer/device.py"] == []


# ---- the readers themselves ------------------------------------------------------------------

class _Info:
    def __init__(self, total, used):
        self.total, self.used = total, used


def test_driver_memory_reads_nvml_on_nvidia(monkeypatch):
    class NVML:
        def nvmlDeviceGetHandleByIndex(self, index):
            return ("handle", index)

        def nvmlDeviceGetMemoryInfo(self, handle):
            assert handle == ("handle", 1)
            return _Info(80 * GiB, 3 * GiB)

    monkeypatch.setattr(devices, "_is_rocm", lambda: False)
    monkeypatch.setattr(devices, "_library", lambda name: NVML() if name == "nvml" else None)
    assert devices.driver_memory(1) == devices.DriverMemory(total=80 * GiB, used=3 * GiB, source="NVML")
    monkeypatch.setattr(devices, "_library", lambda name: None)  # no driver, no package: no figure
    assert devices.driver_memory(0) is None


@pytest.mark.parametrize("vram, gtt, pool", [(24 * GiB, 64 * GiB, "VRAM"), (512 * 2**20, 110 * GiB, "GTT")])
def test_driver_memory_reads_the_pool_torch_allocates_from_on_amd(monkeypatch, vram, gtt, pool):
    """A discrete card trains from VRAM; an APU whose VRAM is a BIOS carve-out (Strix Halo) from GTT."""
    class ROCml:
        def smi_get_device_memory_total(self, dev, type="VRAM"):
            return {"VRAM": vram, "GTT": gtt}[type]

        def smi_get_device_memory_used(self, dev, type="VRAM"):
            return {"VRAM": vram // 4, "GTT": gtt // 8}[type]

    monkeypatch.setattr(devices, "_is_rocm", lambda: True)
    monkeypatch.setattr(devices, "_library", lambda name: ROCml() if name == "rocm" else None)
    total = vram if pool == "VRAM" else gtt
    used = vram // 4 if pool == "VRAM" else gtt // 8
    assert devices.driver_memory(0) == devices.DriverMemory(total=total, used=used, source=f"ROCm SMI ({pool})")


def test_peak_rss_resets_to_the_current_rss_on_linux():
    if not devices.can_reset_peak_rss():
        pytest.skip("needs a writable /proc/self/clear_refs (Linux)")
    ballast = bytearray(64 * 2**20)  # raise the high-water mark, then free it
    ballast[::4096] = b"x" * len(ballast[::4096])
    del ballast
    before = devices.peak_rss()
    assert devices.reset_peak_rss()
    after = devices.peak_rss()
    assert after < before - 32 * 2**20
    assert abs(after - devices.current_rss()) < 16 * 2**20


# ---- the GPU code paths, through the readers -----------------------------------------------

def test_a_cuda_step_is_read_from_the_allocator_after_a_warm_up_and_the_driver_peak_adds_the_context(monkeypatch):
    from trainer.measure import measure_step

    gpu = FakeGPU(monkeypatch)
    m = measure_step(TINY, FP32, "cuda")
    assert gpu.calls == ["reset", "allocator", "driver", "release"]  # the peaks are the steady step's alone
    assert (m.peak_allocated, m.peak_reserved, m.driver_used) == (3 * GiB, 4 * GiB, 5 * GiB)
    # the driver's figure after the step, with torch's reserve now (4 GiB - 1 MiB) swapped for its peak (4 GiB)
    assert m.driver_peak == 4 * GiB + (5 * GiB - (4 * GiB - 2**20))
    assert m.driver_source == "NVML" and "NVML" in m.method
    assert set(m.terms) == {"weights", "gradients", "optimizer", "forward_saved"}


def test_a_cuda_step_without_a_driver_answer_has_no_driver_peak(monkeypatch):
    from trainer.measure import measure_step

    FakeGPU(monkeypatch, family="rocm", driver_used=None)
    m = measure_step(TINY, FP32, "rocm")
    assert m.peak_reserved == 4 * GiB and m.driver_used is None and m.driver_peak is None


def test_an_apple_step_keeps_the_largest_of_the_per_op_samples(monkeypatch):
    from trainer.measure import measure_step

    gpu = FakeGPU(monkeypatch, family="mps")
    m = measure_step(TINY, FP32, "mps")
    assert gpu.mps_samples > 50  # one sample per op of the steady step
    assert (m.peak_allocated, m.peak_reserved) == (1000 + gpu.mps_samples, 5000 + 2 * gpu.mps_samples)


def _tiny_matrix(tmp_path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text('[[config]]\nname = "gqa-fp32"\narch = "llama"\nlayers = 1\nhidden = 64\nheads = 4\nkv_heads = 2\n'
                    'ffn = 128\nvocab = 256\ntied = true\nctx = 32\nmicro_batch = 2\nprecision = "fp32"\n'
                    'attention = "sdpa"\ncheckpointing = "none"\noptimizer = "adamw"\ngrad_accum = 1\nquick = true\n')
    return path


def test_validate_on_a_cuda_gpu_reports_the_reserve_against_the_allocator_and_the_driver(monkeypatch, tmp_path):
    FakeGPU(monkeypatch)
    matrix = _tiny_matrix(tmp_path)
    result = CliRunner().invoke(app, ["validate", "--matrix", str(matrix), "--no-trace", "--device", "h200", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["rows"][0]
    h200 = load_profile("h200")
    # fp32 has no flash kernel on CUDA: the reference model's SDPA repeats K/V, and the walk with it
    predicted = peak_memory(TINY, FP32, h200.runtime_context_bytes, h200.allocator_overhead, gqa_repeat=True)
    assert predicted.peak_allocated != peak_memory(TINY, FP32).peak_allocated
    assert row["predicted_allocated"] == predicted.peak_allocated
    assert row["measured_allocated"] == 3 * GiB and row["measured_reserved"] == 4 * GiB
    assert row["family"] == "cuda" and row["predicted_context"] == h200.runtime_context_bytes
    reserve = predicted.peak_reserved - h200.runtime_context_bytes
    assert row["predicted_allocator_reserve"] == reserve
    assert row["reserved_error"] == pytest.approx((reserve - 4 * GiB) / (4 * GiB))
    driver_peak = 4 * GiB + 2**20 + GiB
    assert row["driver_peak"] == driver_peak and row["driver_source"] == "NVML"
    assert row["driver_error"] == pytest.approx((predicted.peak_reserved - driver_peak) / driver_peak)

    text = CliRunner().invoke(app, ["validate", "--matrix", str(matrix), "--no-trace", "--device", "h200"],
                              env={"COLUMNS": "200"})
    assert text.exit_code == 0, text.output
    assert "Peak reserved: predicted vs measured" in text.output
    assert "max_memory_reserved" in text.output and "driver peak" in text.output
    assert "driver peak (NVML): median |error|" in text.output


def test_validate_on_an_apple_gpu_traces_on_cpu_fake_tensors_and_reports_metals_reserve(monkeypatch, tmp_path):
    """A torch without CUDA (Apple's) cannot make fake CUDA tensors: the trace claims the CPU there."""
    gpu = FakeGPU(monkeypatch, family="mps")
    result = CliRunner().invoke(app, ["validate", "--matrix", str(_tiny_matrix(tmp_path)), "--device", "m3-max",
                                      "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["rows"][0]
    assert row["family"] == "mps" and row["trace_allocated"] > 0
    assert row["measured_allocated"] == 1000 + gpu.mps_samples and row["measured_reserved"] == 5000 + 2 * gpu.mps_samples
    assert row["reserved_error"] is not None and "driver_peak" not in row


def test_validate_on_the_cpu_has_no_reserve_figures(monkeypatch, tmp_path):
    """The CPU rows keep their keys: no family, reserve or driver figures, and no reserve table."""
    monkeypatch.setattr(devices, "local_family", lambda: "cpu")
    result = CliRunner().invoke(app, ["validate", "--matrix", str(_tiny_matrix(tmp_path)), "--no-trace",
                                      "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["rows"][0]
    assert not {"family", "reserved_error", "driver_peak", "driver_error", "predicted_context"} & set(row)


def test_another_stack_is_measured_on_the_gpu_through_the_same_readers(monkeypatch):
    from trainer.stacks import StackModel
    from trainer.validate import measure_stack_on_device

    gpu = FakeGPU(monkeypatch, driver_source="ROCm SMI (VRAM)")
    m = measure_stack_on_device("memplan", StackModel(spec=TINY), FP32, "rocm")
    assert (m.peak_allocated, m.peak_reserved, m.driver_source) == (3 * GiB, 4 * GiB, "ROCm SMI (VRAM)")
    assert gpu.calls[0] == "reset"


def test_the_monitor_on_cuda_adds_the_drivers_context_to_the_reserved_peak(monkeypatch):
    from trainer.monitor import MemoryMonitor

    gpu = FakeGPU(monkeypatch)
    monitor = MemoryMonitor(torch.device("cuda", 0))
    assert monitor.source == "torch.cuda.max_memory_allocated/reserved + NVML"
    monitor.reset()
    reading = monitor.read()
    assert gpu.calls[-3:] == ["reset", "allocator", "driver"]
    assert reading.allocated_bytes == 3 * GiB and reading.reserved_bytes == 4 * GiB
    assert reading.peak_bytes == 4 * GiB + (5 * GiB - (4 * GiB - 2**20))
    assert (reading.driver_bytes, reading.alloc_retries, reading.ooms) == (5 * GiB, 1, 0)


def test_a_verify_trial_on_cuda_is_the_reserved_peak_plus_what_lies_outside_the_allocator(monkeypatch):
    from trainer.verify import run_trial

    FakeGPU(monkeypatch)
    out = run_trial({"model": TINY.to_dict(), "setup": FP32.to_dict(), "steps": 2, "max_micro_batches": 4,
                     "context_bytes": 0})
    assert out["status"] == "ok", out["error"]
    assert out["family"] == "cuda" and out["steps_run"] == 2
    assert out["peak_allocated"] == 3 * GiB
    assert out["peak_bytes"] == 4 * GiB + 600 * 2**20


# ---- benchmarks/gpu_check.sh without a GPU ---------------------------------------------------

def test_gpu_check_refuses_in_one_line_without_a_gpu_and_writes_nothing(tmp_path):
    if devices.local_family() != "cpu":
        pytest.skip("this machine has a GPU")
    out = tmp_path / "gpu.json"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out)], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no GPU" in lines[0] and "cpu" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_compares_a_runs_median_step_and_largest_memory_with_the_prediction(tmp_path):
    gpu_check = _gpu_check()
    start = {"kind": "event", "event": "start", "step": 0, "memory_source": "torch.cuda.max_memory_allocated/reserved",
             "model": {"describe": "llama 124M"},
             "predicted": {"peak_allocated": 9 * GiB, "peak_reserved": 11 * GiB, "step_seconds": 0.1}}
    # five warm-up steps (slow, small) then the timed ones
    steps = [{"kind": "train", "step": i + 1, "step_seconds": 2.0, "memory_bytes": GiB, "memory_allocated_bytes": GiB}
             for i in range(gpu_check.WARMUP_STEPS)]
    steps += [{"kind": "train", "step": 6 + i, "step_seconds": s, "memory_bytes": 10 * GiB + i,
               "memory_allocated_bytes": 8 * GiB + i} for i, s in enumerate((0.12, 0.11, 0.13, 0.5))]
    from runs_helper import whole_line  # the keys this test does not care about (gpu_check reads them checked)

    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(whole_line(r)) for r in [start, *steps]) + "\n")
    out = gpu_check.summarize_train(tmp_path)
    assert out["steps"] == 9 and out["timed_steps"] == 4
    assert out["measured_step_seconds"] == pytest.approx(0.125) and out["step_ratio"] == pytest.approx(1.25)
    assert out["measured_peak_allocated"] == 8 * GiB + 3 and out["measured_peak"] == 10 * GiB + 3
    assert out["allocated_error"] == pytest.approx((9 * GiB - (8 * GiB + 3)) / (8 * GiB + 3))
    assert out["reserved_error"] == pytest.approx((11 * GiB - (10 * GiB + 3)) / (10 * GiB + 3))


def test_gpu_check_summarizes_validate_by_comparison():
    gpu_check = _gpu_check()
    rows = [{"name": "a", "error": 0.01, "reserved_error": -0.2, "driver_error": 0.05, "trace_error": 0.0},
            {"name": "b", "error": -0.03, "reserved_error": 0.1},
            {"name": "c", "error": 0.02, "reserved_error": 0.3, "driver_error": -0.15}]
    out = gpu_check.summarize_validation({"device": "h200", "rows": rows})
    assert out["allocated"] == {"median_abs": 0.02, "max_abs": 0.03, "rows": 3}
    assert out["reserved"] == {"median_abs": 0.2, "max_abs": 0.3, "rows": 3}
    assert out["driver"] == {"median_abs": pytest.approx(0.1), "max_abs": 0.15, "rows": 2}
    assert out["trace"] == {"median_abs": 0.0, "max_abs": 0.0, "rows": 1}

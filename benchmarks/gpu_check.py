"""The whole GPU check in one run: what ``benchmarks/gpu_check.sh`` runs (see benchmarks/README.md).

Three stages, each a memplan command in a process of its own, with a time limit each so that the
whole check ends within ``TOTAL_SECONDS`` on one GPU:

1. ``memplan validate --quick --json`` on the GPU: per config, the walk's ``peak_allocated``
   against ``torch.cuda.max_memory_allocated`` (and the FakeTensor trace), its allocator reserve
   against ``max_memory_reserved``, and its ``peak_reserved`` against the driver's peak (NVML,
   ROCm SMI); on Apple's GPU the per-op samples.
2. ``memplan validate --quick --stack S --no-trace --json`` for every other training stack whose
   library is installed here (transformers with peft, litgpt, torchtune): the same figures for
   their code. Stacks not installed are listed as skipped, with the extra that installs them.
3. A short ``memplan train`` of a 124M model (``TRAIN_STEPS`` steps; a tiny one in the CPU
   rehearsal): the median step time after ``WARMUP_STEPS`` against the predicted step time, and the
   largest measured memory against the predicted ``peak_allocated`` / ``peak_reserved``.

It writes one JSON file. Complete: at the path given (default ``gpu_check.json``), exit 0. A stage
failed or ran out of time: the JSON goes to ``NAME.incomplete.json`` beside it instead (an earlier
complete file is kept), with each stage's status and the tail of its error, and the exit status is 1.
Without a GPU it writes nothing and exits 2 with one line. ``MEMPLAN_GPU_CHECK_REHEARSAL=1`` runs the
same stages on the CPU with a tiny model, to check the script itself where no GPU is (its JSON says
``"rehearsal": true``; its figures are the CPU's). ``MEMPLAN_GPU_CHECK_DEVICE`` passes ``--device``
to every stage, for a GPU without a bundled profile (``memplan calibrate --out my-gpu.toml``).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOTAL_SECONDS = 480  # the whole check, on one GPU
LIMITS = {"validate": 200, "stacks": 120, "train": 130}  # seconds per stage (with start-up: under TOTAL_SECONDS)
TRAIN_STEPS = 40
WARMUP_STEPS = 5  # steps left out of the median step time (kernel selection, the allocator's first blocks)
TRAIN_GPU = ["--params", "124m", "--ctx", "1024", "--batch", "8"]
TRAIN_CPU = ["--layers", "2", "--hidden", "64", "--heads", "2", "--ffn", "128", "--ctx", "64", "--batch", "2"]
STACK_LIBRARIES = {"transformers": ("transformers", "peft"), "litgpt": ("litgpt",), "torchtune": ("torchtune",)}
STACK_EXTRAS = {"transformers": "pip install 'memplan[stacks]'", "litgpt": "pip install 'memplan[litgpt]'",
                "torchtune": "pip install 'memplan[torchtune]'"}
TAIL_CHARS = 2000
REHEARSAL_SLOWER = 4  # the CPU rehearsal's limits are this many times the GPU's (a CPU steps slowly)


class Refused(Exception):
    """A one-line reason the check cannot start (exit 2)."""


def preflight(out: str, rehearsal: bool) -> tuple[Path, dict]:
    """The output path (checked writable) and this machine's device, or Refused with one line."""
    from memplan.errors import InputError
    from memplan.fsutil import check_target

    try:
        path = check_target(out, "gpu_check.sh OUT", "gpu_check.json")
    except InputError as e:
        raise Refused(str(e)) from None
    if path.is_dir():
        raise Refused(f"gpu_check.sh OUT: {out!r} is a directory; give a file path such as gpu_check.json")
    path = Path(os.path.abspath(path))  # the stages run in a work directory of their own
    import torch

    from trainer import device as devices

    family = devices.local_family()
    if family == "cpu" and not rehearsal:
        raise Refused(f"gpu_check: no GPU here: torch {torch.__version__} sees no CUDA, ROCm or Apple GPU "
                      "(device family cpu); run it on a machine with one")
    info = {"family": family, "torch": torch.__version__, "title": devices.device_title(family)}
    if family in ("cuda", "rocm"):
        driver = devices.driver_memory(0)
        free, total = devices.cuda_memory_info(0)
        info.update({"torch_total_bytes": total, "torch_free_bytes": free,
                     "driver": {"source": driver.source, "total_bytes": driver.total, "used_bytes": driver.used}
                     if driver else None, "cuda": torch.version.cuda, "hip": torch.version.hip})
    return path, info


def run_stage(name: str, argv: list[str], work: Path, deadline: float, env: dict, slower: int = 1) -> dict:
    """One memplan command, its stdout kept, within its own limit and what is left of the whole check's."""
    limit = max(1.0, min(LIMITS[name] * slower, deadline - time.monotonic()))
    t0 = time.monotonic()
    command = [sys.executable, "-m", "memplan", *argv]
    stage = {"command": "memplan " + " ".join(argv), "limit_seconds": round(limit)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, env=env, cwd=work)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {**stage, "status": "timeout", "seconds": round(time.monotonic() - t0, 1), "stderr": err[-TAIL_CHARS:]}
    stage.update({"seconds": round(time.monotonic() - t0, 1), "exit_code": done.returncode,
                  "status": "ok" if done.returncode == 0 else "failed"})
    if done.returncode != 0:
        stage["stderr"] = (done.stderr or done.stdout)[-TAIL_CHARS:]
    stage["stdout"] = done.stdout
    return stage


def _errors(rows: list[dict], key: str) -> dict:
    values = [abs(r[key]) for r in rows if r.get(key) is not None]
    if not values:
        return {"median_abs": None, "max_abs": None, "rows": 0}
    return {"median_abs": statistics.median(values), "max_abs": max(values), "rows": len(values)}


def summarize_validation(data: dict) -> dict:
    """The figures of a ``validate --json``: per row the three comparisons, and their medians and worst."""
    rows = data["rows"]
    keep = ("name", "stack", "family", "predicted_allocated", "measured_allocated", "error", "trace_allocated",
            "trace_error", "predicted_reserved", "predicted_allocator_reserve", "measured_reserved",
            "reserved_error", "driver_peak", "driver_source", "driver_error", "seconds")
    return {"device": data.get("device"),
            "allocated": _errors(rows, "error"), "trace": _errors(rows, "trace_error"),
            "reserved": _errors(rows, "reserved_error"), "driver": _errors(rows, "driver_error"),
            "rows": [{k: r[k] for k in keep if k in r} for r in rows]}


def summarize_train(run: Path) -> dict:
    """Step time and memory of a short run against its predictions (from its metrics.jsonl)."""
    from trainer.rundir import read_metrics

    records = read_metrics(run)
    start = next(r for r in records if r.get("kind") == "event" and r.get("event") == "start")
    steps = [r for r in records if r.get("kind") == "train"]
    timed = [r["step_seconds"] for r in steps[WARMUP_STEPS:]] or [r["step_seconds"] for r in steps]
    predicted = start.get("predicted") or {}
    measured_step = statistics.median(timed) if timed else None
    allocated = [r["memory_allocated_bytes"] for r in steps if r.get("memory_allocated_bytes") is not None]
    peak = [r["memory_bytes"] for r in steps if r.get("memory_bytes") is not None]

    def error(pred, meas):
        return (pred - meas) / meas if pred is not None and meas else None

    out = {"steps": len(steps), "timed_steps": len(timed), "model": start.get("model", {}).get("describe"),
           "setup": start.get("setup"), "memory_source": start.get("memory_source"),
           "predicted_step_seconds": predicted.get("step_seconds"), "measured_step_seconds": measured_step,
           "step_ratio": (measured_step / predicted["step_seconds"]) if measured_step and predicted.get("step_seconds")
           else None,
           "predicted_peak_allocated": predicted.get("peak_allocated"),
           "measured_peak_allocated": max(allocated) if allocated else None,
           "predicted_peak_reserved": predicted.get("peak_reserved"), "measured_peak": max(peak) if peak else None}
    out["allocated_error"] = error(out["predicted_peak_allocated"], out["measured_peak_allocated"])
    out["reserved_error"] = error(out["predicted_peak_reserved"], out["measured_peak"])
    return out


def installed_stacks() -> tuple[list[str], dict[str, str]]:
    """(the other stacks whose libraries are importable here, {stack: why not} for the rest)."""
    ready, missing = [], {}
    for stack, modules in STACK_LIBRARIES.items():
        absent = [m for m in modules if importlib.util.find_spec(m) is None]
        if absent:
            missing[stack] = f"{', '.join(absent)} not installed ({STACK_EXTRAS[stack]})"
        else:
            ready.append(stack)
    return ready, missing


def check(out: str, rehearsal: bool) -> int:
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    path, device = preflight(out, rehearsal)
    slower = REHEARSAL_SLOWER if device["family"] == "cpu" else 1
    deadline = t0 + TOTAL_SECONDS * slower
    from memplan.fsutil import write_atomic

    device_flag = ["--device", os.environ["MEMPLAN_GPU_CHECK_DEVICE"]] if os.environ.get("MEMPLAN_GPU_CHECK_DEVICE") \
        else []
    result: dict = {"started": started, "rehearsal": rehearsal, "device": device, "stages": {}}
    with tempfile.TemporaryDirectory(prefix=".gpu_check-", dir=str(path.parent)) as tmp:
        work = Path(tmp)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
        stage = run_stage("validate", ["validate", "--quick", "--json", *device_flag], work, deadline, env, slower)
        if stage["status"] == "ok":
            stage.update(summarize_validation(json.loads(stage.pop("stdout"))))
        result["stages"]["validate"] = {k: v for k, v in stage.items() if k != "stdout"}

        ready, missing = installed_stacks()
        if ready:
            stage = run_stage("stacks", ["validate", "--quick", "--stack", ",".join(ready), "--no-trace", "--json",
                                         *device_flag], work, deadline, env, slower)
            if stage["status"] == "ok":
                stage.update(summarize_validation(json.loads(stage.pop("stdout"))))
        else:
            stage = {"status": "skipped"}
        stage["stacks_run"], stage["stacks_missing"] = ready, missing
        result["stages"]["stacks"] = {k: v for k, v in stage.items() if k != "stdout"}

        run = work / "run"
        precision = ["--precision", "bf16-mixed"] if device["family"] in ("cuda", "rocm") else ["--precision", "fp32"]
        shape = TRAIN_CPU if device["family"] == "cpu" else TRAIN_GPU
        stage = run_stage("train", ["train", *shape, *precision, "--max-steps", str(TRAIN_STEPS if not rehearsal else 12),
                                    "--eval-every", "100000", "--save-every", "100000", "--sample-tokens", "0",
                                    "--out", str(run), *device_flag], work, deadline, env, slower)
        stage.pop("stdout", None)
        if stage["status"] == "ok":
            try:
                stage.update(summarize_train(run))
            except (OSError, StopIteration, KeyError, ValueError) as e:
                stage.update(status="failed", stderr=f"reading {run / 'metrics.jsonl'}: {type(e).__name__}: {e}")
        result["stages"]["train"] = stage

    result["seconds"] = round(time.monotonic() - t0, 1)
    failed = [name for name, s in result["stages"].items() if s["status"] not in ("ok", "skipped")]
    result["complete"] = not failed
    target = path if not failed else path.with_name(path.name.removesuffix(".json") + ".incomplete.json")
    write_atomic(target, json.dumps(result, indent=2) + "\n")
    for name, s in result["stages"].items():
        print(f"{name}: {s['status']}" + (f" ({s['seconds']} s)" if "seconds" in s else ""), file=sys.stderr)
    if failed:
        print(f"gpu_check: stage(s) {', '.join(failed)} did not finish; what ran is in {target}", file=sys.stderr)
        return 1
    print(f"gpu_check: wrote {target} in {result['seconds']} s", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: benchmarks/gpu_check.sh [OUT.json]  (one path, default gpu_check.json)", file=sys.stderr)
        return 2
    rehearsal = os.environ.get("MEMPLAN_GPU_CHECK_REHEARSAL", "") not in ("", "0")
    try:
        return check(argv[0] if argv else "gpu_check.json", rehearsal)
    except Refused as e:
        print(str(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""torch.compile's one-off compile time of memplan's training step, measured against ``memplan.timing``'s
prediction (``compile_seconds``: a fixed part plus seconds per op of the compiled graph), at three sizes.

Each size is compiled in a fresh process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``): the
compile a run's first step pays. The one-off is measured as the trainer's figures take it (benchmarks/
train_throughput.py's ``compile_seconds_measured``): the first compiled step less a steady one, by
``trainer.calibrate.compile_one_off`` (the second step too: a recompile there would be the run's), in wall seconds and in CPU seconds (the process and its C++ builds, with
inductor's ``compile_threads = 1``). CPU seconds are what the bar judges: on a shared machine other processes
stretch the wall time by however much of the cores they take, not the compile's work. The prediction uses a
calibration taken in the same run (``trainer.calibrate.measure_compile_cost``, its own fresh process and cache)
and, beside it, the uncalibrated default (``memplan.timing.DEFAULT_COMPILE_*``). The processes run ``--jobs`` at
a time (CPU seconds do not depend on how many run together, within the noise of shared caches).

    PYTHONPATH=$PWD python benchmarks/compile_time.py [--sizes 1m,12m,50m] [--jobs 4] [--json FILE]

Bar: every size's predicted / measured CPU seconds within 0.7-1.3 (±30%), from the same run's calibration.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from memplan.model import ModelSpec  # noqa: E402
from memplan.setup import TrainSetup  # noqa: E402

SIZES = {  # name -> (layers, hidden, heads, ffn): benchmarks/train_throughput.py's Llama shapes, vocab 4096, tied
    "1m": (2, 128, 4, 384),
    "12m": (6, 384, 6, 1024),
    "50m": (10, 640, 10, 1728),
}
VOCAB, CTX, MICRO_BATCH = 4096, 256, 4
BAR = 0.30  # |predicted / measured − 1|


def spec_of(size: str) -> ModelSpec:
    layers, hidden, heads, ffn = SIZES[size]
    return ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=ffn, vocab=VOCAB,
                     tied=True)


SETUP = TrainSetup(ctx=CTX, micro_batch=MICRO_BATCH, precision="fp32", attention="sdpa", optimizer="adamw",
                   compile=True)


def worker(what: str) -> dict:
    """In this (fresh) process: ``calibrate`` (measure_compile_cost) or one size's compile_one_off."""
    import torch

    torch.set_num_threads(1)
    from trainer import calibrate

    if what == "calibrate":
        cal = calibrate.Calibration(family="cpu", title="compile_time", threads=1)
        calibrate.measure_compile_cost(cal)
        return {"compile_cost": cal.compile_cost, "skipped": cal.skipped}
    return calibrate.compile_one_off(spec_of(what), SETUP, torch.device("cpu"))


def spawn(what: str) -> dict:
    """``worker(what)`` in a fresh Python process with an empty inductor cache."""
    with tempfile.TemporaryDirectory(prefix="memplan-ctime-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, __file__, "--worker", what], env=env, cwd=ROOT, capture_output=True,
                             text=True)
    if out.returncode != 0:
        raise SystemExit(f"{what}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1m,12m,50m", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--jobs", type=int, default=4, help="processes at a time (default 4)")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown {', '.join(unknown)} (accepted: {', '.join(SIZES)})")

    from bars import Bar, judge

    from memplan.hardware import load_profile
    from memplan.timing import compile_cost, compile_seconds, compiled_graph_ops, trainer_recompiles

    load0 = os.getloadavg()[0]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        found = list(pool.map(spawn, ["calibrate", *sizes]))
    load1 = os.getloadavg()[0]
    measured_cost = found[0]
    if not measured_cost["compile_cost"]:
        raise SystemExit(f"calibration compiled nothing: {measured_cost['skipped']}")
    cpu = load_profile("cpu")
    calibrated = cpu.replace(calibrated={"compile_cost": measured_cost["compile_cost"]})
    fixed, per_op, _ = compile_cost(calibrated)
    d_fixed, d_per_op, _ = compile_cost(cpu)
    print(f"calibration (same run): fixed {fixed:.1f} s + {per_op * 1e3:.2f} ms per op "
          f"(its compiles: {measured_cost['compile_cost']['seconds']} CPU s at {measured_cost['compile_cost']['ops']} "
          f"ops); default: {d_fixed:.1f} s + {d_per_op * 1e3:.2f} ms per op")
    print(f"load average {load0:.1f} before, {load1:.1f} after (2 cores here: wall seconds stretch with it)")
    rows = []
    header = (f"{'size':>5} {'layers':>6} {'ops':>5} {'measured cpu s':>14} {'(first)':>7} {'wall s':>7} "
              f"{'predicted s':>11} {'ratio':>6} {'default s':>9} {'ratio':>6} {'recompiles':>10}")
    print(header)
    for size, m in zip(sizes, found[1:]):
        spec = spec_of(size)
        ops = compiled_graph_ops(spec, SETUP)
        predicted = compile_seconds(spec, calibrated, SETUP)
        default = compile_seconds(spec, cpu, SETUP)
        row = {"size": size, "layers": spec.layers, "params": spec.params, "ops": ops, **m,
               "predicted_recompiles": trainer_recompiles(spec, SETUP),
               "predicted_seconds": predicted, "ratio": predicted / m["cpu_seconds"],
               "default_seconds": default, "default_ratio": default / m["cpu_seconds"]}
        rows.append(row)
        print(f"{size:>5} {spec.layers:>6} {ops:>5} {m['cpu_seconds']:>14.1f} {m['first_cpu_seconds']:>7.1f} "
              f"{m['wall_seconds']:>7.1f} {predicted:>11.1f} {row['ratio']:>6.2f} {default:>9.1f} "
              f"{row['default_ratio']:>6.2f} {m['recompiles']:>4} ({row['predicted_recompiles']})")
    print("measured: the first two steps less two steady ones (a recompile would be in the second); (first): the "
          "first step's part; recompiles: measured (predicted)")
    if args.json:
        Path(args.json).write_text(json.dumps({"compile_cost": measured_cost["compile_cost"], "rows": rows,
                                               "load_average": [load0, load1]}, indent=1))
    bars = [Bar(f"compile time {r['size']}: |predicted / measured − 1|", abs(r["ratio"] - 1), BAR) for r in rows]
    bars.append(Bar("recompiles not predicted (second step, or later)", sum(
        abs(r["recompiles"] - r["predicted_recompiles"]) + r["late_recompiles"] for r in rows), 0, unit=""))
    return judge(bars)


if __name__ == "__main__":
    sys.exit(main())

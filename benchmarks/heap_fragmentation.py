"""What glibc's heap holds beyond the live tensors in CPU training steps, under the heap policy memplan's
trainer uses and under a low mmap threshold: why local_memory.py's predicted peaks miss with the heap kept.

For each of `local_memory.py`'s `train` shapes, in a fresh process per policy: the process baseline
(trainer.calibrate.process_baseline_bytes, as the calibration measures it), then STEPS bare steps
(trainer.step.train_step, fp32, 2 threads, vocabulary 4096). Per step: the resident high-water mark
over the baseline (VmHWM, reset before the step), the step's wall time, its minor page faults, and
glibc's view of its arenas after the step (mallinfo2: the heap's extent, in use, free). Printed per
shape and policy, over the steps after the first two: the median step time and faults, the highest
resident growth, the walk's live peak (memplan.memory.peak_memory) and their difference, and the
heap's free bytes (holes between live chunks: fragmentation).

Policies:
  kept  trainer.device.keep_heap_resident: mmap threshold 32 MiB, trim threshold out of reach (train,
        finetune and autotune --verify's trials use it)
  1mib  mmap threshold 1 MiB, trim threshold out of reach: tensors of 1 MiB or more are mmapped, so
        they leave no holes, and are faulted in afresh every step

    python benchmarks/heap_fragmentation.py [--steps N] [--policies kept,1mib]

Reports, judges no bar (the bar is local_memory.py's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name, (layers, hidden, heads, ffn, ctx, micro-batch, attention, checkpointing): local_memory.py's TRAIN
SHAPES = [
    ("2x128 ctx256 b4 sdpa", (2, 128, 2, 384, 256, 4, "sdpa", "none")),
    ("4x256 ctx256 b8 eager", (4, 256, 4, 768, 256, 8, "eager", "none")),
    ("4x256 ctx512 b4 full-ckpt", (4, 256, 4, 768, 512, 4, "sdpa", "full")),
    ("6x384 ctx256 b8 sdpa", (6, 384, 6, 1024, 256, 8, "sdpa", "none")),
    ("8x512 ctx256 b4 selective", (8, 512, 8, 1536, 256, 4, "sdpa", "selective")),
]
THRESHOLDS = {"kept": None, "1mib": 1 << 20}

STEPS = r"""
import ctypes, json, resource, sys, time
import torch
torch.set_num_threads(2)
from memplan.memory import peak_memory
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from trainer import device
from trainer.calibrate import process_baseline_bytes
from trainer.model import build_model
from trainer.step import make_optimizer, train_step

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
layers, hidden, heads, ffn, ctx, batch, attention, checkpointing = json.loads(sys.argv[1])
threshold, steps = json.loads(sys.argv[2]), int(sys.argv[3])
base = process_baseline_bytes(("memplan.cli",))  # as `memplan calibrate` measures it
assert device.keep_heap_resident()
if threshold is not None:
    assert libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
spec = ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=ffn, vocab=4096,
                 tied=True)
setup = TrainSetup(ctx=ctx, micro_batch=batch, precision="fp32", attention=attention, checkpointing=checkpointing)
model = build_model(spec, attention, checkpointing, torch.float32)
optimizer = make_optimizer(model, setup.optimizer)
rows = []
for _ in range(steps):
    x = torch.randint(0, 4096, (batch, ctx + 1))
    device.reset_peak_rss()
    faults, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    train_step(model, optimizer, [(x[:, :-1].contiguous(), x[:, 1:].contiguous())], setup, "cpu")
    seconds, faults = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    info = libc.mallinfo2()
    rows.append({"seconds": seconds, "faults": faults, "growth": device.peak_rss() - base,
                 "extent": info.arena, "in_use": info.uordblks, "free": info.fordblks})
print(json.dumps({"walk_peak": peak_memory(spec, setup).peak_allocated, "steps": rows}))
"""


def measure(shape: tuple, threshold: int | None, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    r = subprocess.run([sys.executable, "-c", STEPS, json.dumps(shape), json.dumps(threshold), str(steps)],
                       capture_output=True, text=True, timeout=1800,
                       env={**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"})
    if r.returncode != 0:
        sys.exit(f"a measuring process failed: {r.stderr.strip()[-800:]}")
    return json.loads(r.stdout.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--policies", default="kept,1mib", help="comma-separated: " + ", ".join(THRESHOLDS))
    args = ap.parse_args()
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in THRESHOLDS]
    if unknown or args.steps < 4:
        sys.exit(f"--policies: unknown {unknown} (accepted: {', '.join(THRESHOLDS)}); --steps: at least 4")
    mib = 2 ** 20
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; steps {args.steps} (the first two "
          "left out)\n")
    print(f"{'shape':27}{'policy':>7}{'ms/step':>9}{'faults':>8}{'walk':>8}{'growth':>8}{'excess':>8}"
          f"{'heap free':>10}")
    for name, shape in SHAPES:
        for policy in policies:
            m = measure(shape, THRESHOLDS[policy], args.steps)
            steady = m["steps"][2:]
            growth = max(s["growth"] for s in steady)
            last = steady[-1]
            print(f"{name:27}{policy:>7}{statistics.median(s['seconds'] for s in steady) * 1e3:>9.1f}"
                  f"{statistics.median(s['faults'] for s in steady):>8.0f}{m['walk_peak'] / mib:>8.1f}"
                  f"{growth / mib:>8.1f}{(growth - m['walk_peak']) / m['walk_peak']:>+8.0%}"
                  f"{last['free'] / mib:>10.1f}", flush=True)
    print(f"\nMiB; growth: the highest resident memory of a step over the process baseline; excess: growth over "
          f"the walk's live peak; heap free: glibc's free bytes inside its arenas after the last step.\n"
          f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

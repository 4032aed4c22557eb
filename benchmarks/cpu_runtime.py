"""What a CPU training process holds beyond its live tensors: the figures behind memplan/profiles/cpu.toml's [runtime].

peak_reserved on the CPU is what the OS shows for the process (its resident set). For each
config, in a fresh process: warm up the runtime with a tiny model's steps, take the resident
size (the runtime context: interpreter, torch, memplan, oneDNN), reset VmHWM, train the config
for three steps, and read the resident high-water mark. The growth over the baseline is compared
with memplan's live-tensor peak; a least-squares line growth = (1 + overhead) · peak + fixed gives
the allocator overhead (glibc keeps freed memory in its arenas) and the fixed part that joins the
runtime context.

    python benchmarks/cpu_runtime.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r'''
import gc, json, sys, torch
from memplan.memory import peak_memory
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from trainer.model import build_model
from trainer.step import make_optimizer, train_step

layers, hidden, vocab, ctx, batch, precision = json.loads(sys.argv[1])
spec = ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=hidden // 32, kv_heads=hidden // 32,
                 ffn=hidden * 8 // 3 // 32 * 32, vocab=vocab, tied=True)
setup = TrainSetup(ctx=ctx, micro_batch=batch, precision=precision)


def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024


tiny = ModelSpec(arch="llama", layers=1, hidden=32, heads=1, kv_heads=1, ffn=64, vocab=64, tied=True)
model = build_model(tiny)
opt = make_optimizer(model, "adamw")
for _ in range(2):
    train_step(model, opt, [(torch.randint(0, 64, (1, 16)), torch.randint(0, 64, (1, 16)))],
               TrainSetup(ctx=16, precision=precision), "cpu")
del model, opt
gc.collect()
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
model = build_model(spec)
opt = make_optimizer(model, "adamw")
for _ in range(3):
    train_step(model, opt, [(torch.randint(0, vocab, (batch, ctx)), torch.randint(0, vocab, (batch, ctx)))],
               setup, "cpu")
print(json.dumps({"base": base, "hwm": status("VmHWM"), "peak": peak_memory(spec, setup).peak_allocated}))
'''
CASES = [(2, 128, 4096, 128, 4, "fp32"), (4, 256, 8192, 256, 4, "fp32"), (4, 256, 8192, 256, 4, "bf16-mixed"),
         (6, 384, 16384, 256, 8, "bf16-mixed"), (2, 512, 32000, 512, 4, "fp32")]


def main() -> None:
    rows = []
    for case in CASES:
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case)], capture_output=True, text=True,
                             cwd=ROOT, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(f"{case}: baseline {r['base'] / 2**20:.0f} MiB, growth {(r['hwm'] - r['base']) / 2**20:.1f} MiB, "
              f"live-tensor peak {r['peak'] / 2**20:.1f} MiB, growth / peak {(r['hwm'] - r['base']) / r['peak']:.3f}")
    x = [r["peak"] for r in rows]
    y = [r["hwm"] - r["base"] for r in rows]
    mx, my = statistics.fmean(x), statistics.fmean(y)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)
    fixed = my - slope * mx
    base = statistics.median(r["base"] for r in rows)
    print(f"fit: growth = {slope:.3f} x peak + {fixed / 2**20:.1f} MiB")
    print(f"suggested [runtime]: context_bytes = {int(base + fixed)} (baseline {base / 2**20:.0f} MiB + "
          f"{fixed / 2**20:.0f} MiB), allocator_overhead = {slope - 1:.3f}")


if __name__ == "__main__":
    main()

"""How fast `memplan estimate` answers: the whole process, and one estimate in-process.

Issue bars: the whole process under 0.5 s on a 2-core machine; one in-process estimate under 5 ms.
Prints medians over repeated runs (the machine is shared, so single runs are noise), and checks
that the estimate path never imports torch.

    python benchmarks/startup.py [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bars import Bar, judge  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ["--params", "22m", "--device", "cpu", "--json"],
    ["--params", "1.1b", "--ctx", "2k", "--batch", "4", "--device", "rtx-4090", "--json"],
    ["--model", "llama-3.2-1b", "--ctx", "8k", "--checkpointing", "full", "--device", "h100-sxm", "--json"],
]


def whole_process(args: list[str], runs: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package has its bytecode compiled
    subprocess.run([sys.executable, "-m", "memplan", "estimate", *args], env=env, capture_output=True, check=True)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "memplan", "estimate", *args], env=env, capture_output=True, check=True)
        times.append(time.perf_counter() - t0)
    return times


def in_process(runs: int) -> tuple[list[float], bool]:
    sys.path.insert(0, str(ROOT))
    from memplan.estimate import estimate
    from memplan.hardware import load_profile
    from memplan.model import from_size
    from memplan.setup import TrainSetup

    spec, setup, device = from_size("1.1b"), TrainSetup(ctx=2048, micro_batch=4), load_profile("rtx-4090")
    estimate(spec, setup, device)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        estimate(spec, setup, device)
        times.append(time.perf_counter() - t0)
    return times, "torch" in sys.modules


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    bars = []
    for case in CASES:
        t = whole_process(case, args.runs)
        print(f"memplan estimate {' '.join(case):80s} median {statistics.median(t):.3f} s "
              f"(min {min(t):.3f}, max {max(t):.3f}; bar 0.5 s)")
        bars.append(Bar(f"memplan estimate {' '.join(case)}: median process time", statistics.median(t), 0.5,
                        unit="s"))
    t, torch_loaded = in_process(max(args.runs, 200))
    print(f"in-process estimate (1.1b, ctx 2k, batch 4, rtx-4090, includes max_micro_batch) median "
          f"{statistics.median(t) * 1000:.2f} ms (min {min(t) * 1000:.2f}, max {max(t) * 1000:.2f}; bar 5 ms)")
    print(f"torch imported on the estimate path: {torch_loaded}")
    bars.append(Bar("in-process estimate: median", statistics.median(t), 0.005, unit="ms"))
    bars.append(Bar("torch imported on the estimate path (1 = yes)", float(torch_loaded), 0.0, unit=""))
    return judge(bars)


if __name__ == "__main__":
    sys.exit(main())

"""How long `memplan sweep` takes to compute a grid: the median of several runs, against estimating
every cell with `estimate` one by one (what the grid's shortcut saves), in one process.

    python benchmarks/sweep_speed.py [--params 124m] [--device rtx-4090] [--repeat 7]

The default grid is 4 contexts × 5 micro-batches × 2 attentions × 3 checkpointings × 2 precisions
(240 cells). It reports and does not judge: timings on a shared machine are noisy, so quote the
medians and their ratio, never one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memplan.estimate import estimate  # noqa: E402
from memplan.hardware import load_profile  # noqa: E402
from memplan.model import resolve  # noqa: E402
from memplan.setup import TrainSetup  # noqa: E402
from memplan.sweep import SweepAxes, sweep  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="124m")
    ap.add_argument("--device", default="rtx-4090")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    spec, dev = resolve(params=args.params), load_profile(args.device)
    axes = SweepAxes(ctx=(1024, 2048, 4096, 8192), micro_batch=(1, 2, 4, 8, 16), attention=("eager", "sdpa"),
                     checkpointing=("none", "selective", "full"), precision=("bf16-mixed", "fp32"))
    grid_seconds, naive_seconds = [], []
    for _ in range(args.repeat):
        t = time.perf_counter()
        sw = sweep(spec, TrainSetup(), dev, axes, tokens=10**9)
        grid_seconds.append(time.perf_counter() - t)
        t = time.perf_counter()
        naive = [estimate(spec, c.setup, dev, 10**9) for c in sw.cells]
        naive_seconds.append(time.perf_counter() - t)
        assert list(sw.cells) == naive  # the shortcut gives the same estimates
    g, n = statistics.median(grid_seconds), statistics.median(naive_seconds)
    print(f"{axes.cells} cells ({' × '.join(str(len(getattr(axes, a))) for a in ('ctx', 'micro_batch', 'attention', 'checkpointing', 'precision'))}), "
          f"{args.params} on {args.device}, {args.repeat} runs")
    print(f"sweep:                 median {g * 1000:.0f} ms (min {min(grid_seconds) * 1000:.0f}, "
          f"max {max(grid_seconds) * 1000:.0f})")
    print(f"estimate of each cell: median {n * 1000:.0f} ms (min {min(naive_seconds) * 1000:.0f}, "
          f"max {max(naive_seconds) * 1000:.0f})")
    print(f"ratio: the sweep takes {g / n:.2f} of the cell-by-cell time")


if __name__ == "__main__":
    main()

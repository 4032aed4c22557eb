"""The quick start's predicted tokens/s against what it measures, over consecutive runs on a fresh cache.

Runs `memplan train --max-minutes M` (the quick start: the embedded corpus, this machine's calibration,
taken by the first run in a process of its own and reused by the others when it was steady) N times in
a row with a fresh MEMPLAN_CACHE, and prints per run: the rates line, the model, predicted tokens/s
(the plan's), measured tokens/s (the median of the steady steps, as the run's summary prints it),
their ratio, and the predicted and measured peak. The bar: every ratio within 25% (0.75-1.25).

    python benchmarks/quickstart_prediction.py [--runs 5] [--minutes 0.5] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bars import Bar, judge  # noqa: E402
from local_memory import env_for, memplan, run_figures  # noqa: E402

BAR = 0.25


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--minutes", default="0.5", help="--max-minutes of each quick start")
    ap.add_argument("--cache", help="memplan cache directory (default: a fresh temporary one)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    cache = Path(args.cache or tempfile.mkdtemp(prefix="memplan-cache-"))
    runs = Path(tempfile.mkdtemp(prefix="memplan-quickstart-"))
    env = env_for(cache)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; cache {cache}; "
          f"memplan train --max-minutes {args.minutes}, {args.runs} runs", flush=True)
    rows = []
    for i in range(args.runs):
        out = runs / f"run{i}"
        r = memplan("train", "--max-minutes", args.minutes, "--out", str(out), "--sample-tokens", "0", env=env)
        if r.returncode != 0:
            sys.exit(f"run {i}: {r.stderr.strip()[-800:]}")
        text = " ".join(r.stderr.split())
        rates = text[text.index("rates:"):].split(" eval step")[0].split(" step ")[0][:160] if "rates:" in text else ""
        from trainer.rundir import read_metrics

        start = read_metrics(out)[0]
        f = run_figures(out)
        ratio = f["predicted_tps"] / f["measured_tps"]
        rows.append({"run": i, "model": start["model"]["describe"], "rates": rates, **f, "ratio": ratio,
                     "load": os.getloadavg()[0]})
        print(f"run {i}: {start['model']['describe']}\n  {rates}\n  tokens/s predicted {f['predicted_tps']:,.0f}, "
              f"measured {f['measured_tps']:,.0f} (median of {f['steps'] - 1} steady steps): ratio {ratio:.2f}; "
              f"peak predicted {f['predicted_peak'] / 2**20:.1f} MiB, measured {f['measured_peak'] / 2**20:.1f} MiB "
              f"({(f['predicted_peak'] - f['measured_peak']) / f['measured_peak']:+.1%}); load {rows[-1]['load']:.1f}",
              flush=True)
    ratios = [row["ratio"] for row in rows]
    print(f"\nratios predicted/measured tokens/s: {', '.join(f'{x:.2f}' for x in ratios)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return judge([Bar("predicted/measured tokens/s: lowest ratio", min(ratios), 1 - BAR, at_most=False, unit=""),
                  Bar("predicted/measured tokens/s: highest ratio", max(ratios), 1 + BAR, unit="")])


if __name__ == "__main__":
    sys.exit(main())

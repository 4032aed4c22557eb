"""The quick start's predicted tokens/s against what it measures, over consecutive runs on a fresh cache.

Runs `memplan train --max-minutes M` (the quick start: the embedded corpus, this machine's calibration,
taken by the first run in a process of its own and reused by the others when it was steady) N times in
a row with a fresh MEMPLAN_CACHE, and prints per run: the rates line, the model, predicted tokens/s
(the plan's), measured tokens/s (the median of the steady steps, as the run's summary prints it),
their ratio, and the predicted and measured peak. The bar: every ratio within 25% (0.75-1.25).

Two cases, each of --runs runs, one after the other on the same cache: the machine as it is, then loaded
by --spinners more processes that spin on the CPU for the whole run (a second user's work). A third
(``--late S``, S > 0) starts each run on a fresh cache and the spinners S seconds into it, after the
calibration's thread trial and during its measurements: load that the trial did not see. Where the run
found the load too unsteady to predict wall time (its rates line says so; the start line's predicted
``clock`` is "cpu"), its prediction is of CPU time, and it is compared with the steps' CPU time (the
median tokens per CPU second); otherwise wall time with wall time.

    python benchmarks/quickstart_prediction.py [--runs 2] [--minutes 0.5] [--spinners 1] [--late 6] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bars import Bar, judge  # noqa: E402
from local_memory import env_for, memplan, run_figures  # noqa: E402

BAR = 0.25


def spin() -> subprocess.Popen:
    """A process that keeps one core busy until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="runs per case")
    ap.add_argument("--minutes", default="0.5", help="--max-minutes of each quick start")
    ap.add_argument("--spinners", type=int, default=1, help="processes spinning on the CPU in the loaded case")
    ap.add_argument("--late", type=float, default=0.0,
                    help="also: runs on a fresh cache whose spinners start this many seconds in (0: not run)")
    ap.add_argument("--cache", help="memplan cache directory (default: a fresh temporary one)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    cache = Path(args.cache or tempfile.mkdtemp(prefix="memplan-cache-"))
    runs = Path(tempfile.mkdtemp(prefix="memplan-quickstart-"))
    env = env_for(cache)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; cache {cache}; "
          f"memplan train --max-minutes {args.minutes}, {args.runs} runs as it is, then {args.runs} with "
          f"{args.spinners} spinning process(es)", flush=True)
    rows = []
    for case in ("as it is", f"loaded by {args.spinners} spinning process(es)"):
        spinners = [spin() for _ in range(args.spinners)] if case != "as it is" else []
        try:
            for i in range(args.runs):
                rows.append(one_run(runs / f"{len(rows)}", env, args.minutes, case, i))
        finally:
            for p in spinners:
                p.kill()
                p.wait()
    if args.late > 0:
        case = f"{args.spinners} spinning process(es) from {args.late:g} s in, fresh cache"
        for i in range(args.runs):
            spinners: list[subprocess.Popen] = []
            timer = threading.Timer(args.late, lambda held=spinners: held.extend(spin() for _ in range(args.spinners)))
            timer.start()
            try:
                rows.append(one_run(runs / f"{len(rows)}", env_for(cache / f"late-{i}"), args.minutes, case, i))
            finally:
                timer.cancel()
                timer.join()
                for p in spinners:
                    p.kill()
                    p.wait()
    for case in dict.fromkeys(row["case"] for row in rows):
        ratios = [row["ratio"] for row in rows if row["case"] == case]
        print(f"{case}: ratios predicted/measured: {', '.join(f'{x:.2f}' for x in ratios)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    ratios = [row["ratio"] for row in rows]
    return judge([Bar("predicted/measured tokens/s: lowest ratio", min(ratios), 1 - BAR, at_most=False, unit=""),
                  Bar("predicted/measured tokens/s: highest ratio", max(ratios), 1 + BAR, unit="")])


def one_run(out: Path, env: dict, minutes: str, case: str, i: int) -> dict:
    from trainer.rundir import read_metrics

    r = memplan("train", "--max-minutes", minutes, "--out", str(out), "--sample-tokens", "0", env=env)
    if r.returncode != 0:
        sys.exit(f"{case}, run {i}: {r.stderr.strip()[-800:]}")
    text = " ".join(r.stderr.split())
    rates = text[text.index("rates:"):].split(" Training ")[0].split(" eval step")[0] if "rates:" in text else ""
    start = read_metrics(out)[0]
    f = run_figures(out)
    cpu = f["predicted_clock"] == "cpu" and f["measured_cpu_tps"]
    measured = f["measured_cpu_tps"] if cpu else f["measured_tps"]
    row = {"case": case, "run": i, "model": start["model"]["describe"], "rates": rates, **f,
           "ratio": f["predicted_tps"] / measured, "load": os.getloadavg()[0]}
    print(f"{case}, run {i}: {start['model']['describe']}; global batch {start['tokens_per_step']:,} tokens\n"
          f"  {rates}\n  tokens/s predicted {f['predicted_tps']:,.0f} ({f['predicted_clock']} time), measured "
          f"{f['measured_tps']:,.0f} wall" + (f", {f['measured_cpu_tps']:,.0f} per CPU second"
                                               if f["measured_cpu_tps"] else "")
          + f" (median of {f['steps'] - 1} steady steps): ratio {row['ratio']:.2f} ({'CPU' if cpu else 'wall'} time); "
          f"peak predicted {f['predicted_peak'] / 2**20:.1f} MiB, measured {f['measured_peak'] / 2**20:.1f} MiB "
          f"({(f['predicted_peak'] - f['measured_peak']) / f['measured_peak']:+.1%}); load {row['load']:.1f}",
          flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())

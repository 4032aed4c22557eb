"""How long `memplan prepare` takes for the embedded corpus (what the quick start prepares before it trains).

The quick start (`memplan train` with no arguments) prepares the embedded corpus, then trains for about three
minutes, so preparing it must take well under a minute on a laptop-class machine. Times the whole process
(start-up, the two sources, the 4,096-token BPE, the shards) in a fresh directory each run; prints the median.
Bar: median under 60 s. (tests/unit/test_data.py checks what the corpus holds, not how fast it is made.)

    PYTHONPATH=$PWD python benchmarks/prepare_embedded.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bars import Bar, judge  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECONDS_BAR = 60.0  # the quick start's preparation, well under its three minutes of training


def prepare_seconds(out: Path) -> float:
    """Seconds of one `memplan prepare --out OUT` process (the embedded corpus), checked to succeed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "memplan", "prepare", "--out", str(out)], env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"memplan prepare failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        times = [prepare_seconds(Path(tmp) / f"corpus-{i}") for i in range(args.runs)]
    print(f"memplan prepare (embedded corpus): median {statistics.median(times):.1f} s "
          f"(min {min(times):.1f}, max {max(times):.1f}; {args.runs} runs; bar {SECONDS_BAR:.0f} s)")
    return judge([Bar("memplan prepare (embedded corpus): median process time", statistics.median(times),
                      SECONDS_BAR, unit="s")])


if __name__ == "__main__":
    sys.exit(main())

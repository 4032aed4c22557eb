"""Collectives on this machine against memplan/comm.py's ring formulas and a profile's [interconnect].

Starts W processes (default 2) and times all-reduce, all-gather and reduce-scatter of fp32 messages
from 64 KiB to 64 MiB (the slowest rank's median of several repetitions, after a warm-up): over
NCCL/RCCL with one GPU per process where there are W GPUs, else over gloo on the CPU. Each time is
compared with two predictions:

- ``profile``: the ring formulas with the bandwidth and latency of ``--device``'s [interconnect]
  (what ``memplan estimate`` uses): checks the profile's figures on a machine that has that link;
- ``fitted``: the same formulas with B and α fitted to this run's all-reduce times (least squares
  on t = 2·(W−1)/W · S/B + 2·(W−1)·α): checks the factors between the collectives (an all-gather
  or a reduce-scatter moves half of what an all-reduce does) whatever the link.

    python benchmarks/comm.py [--device h100-sxm] [--world-size 2] [--reps 7] [--json FILE]

Bars, over NCCL/RCCL (one GPU per rank): the fitted formulas' median |error| per collective ≤ 25%
(the factors between the collectives hold), and the profile's ≤ 50% where ``--device`` names this
machine's link. On a CPU (gloo) nothing is judged, and the run says why: the ranks share one
machine's memory instead of a link (the CPU profile's [interconnect] is the Ethernet between two
machines, which these ranks never use), and gloo's all-gather and reduce-scatter on shared memory
do not move half of what its all-reduce does; a shared 2-core machine is noisy besides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bars import Bar, judge, not_judged  # noqa: E402  (benchmarks/, the script's own directory)

FITTED_BAR, PROFILE_BAR = 0.25, 0.50

SIZES = [1 << k for k in range(16, 27, 2)]  # 64 KiB ... 64 MiB
OPS = ("all-reduce", "all-gather", "reduce-scatter")


def _worker(rank: int, world: int, store: str, reps: int, out: str, gpus: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpus else "gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)

    def sync() -> None:
        if gpus:
            torch.cuda.synchronize()

    results = {}
    for size in SIZES:
        n = size // 4 // world * world
        full = torch.ones(n, device=device)
        shard = torch.ones(n // world, device=device)
        # torch 2.13 renamed the tensor forms (the old names warn, FutureWarning, on every call)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        calls = {
            "all-reduce": lambda: dist.all_reduce(full),
            "all-gather": lambda: gather(full, shard),
            "reduce-scatter": lambda: scatter(shard, full),
        }
        for op, call in calls.items():
            call()  # warm-up
            sync()
            times = []
            for _ in range(reps):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                call()
                sync()
                times.append(time.perf_counter() - t0)
            # every rank's time, the slowest counts (the collective ends when the last rank has its data)
            t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            results[f"{op}:{n * 4}"] = float(t)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def measure(world: int, reps: int, gpus: bool) -> dict[str, dict[int, float]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), reps, out, gpus), nprocs=world,
                           start_method="spawn")
        raw = json.loads(Path(out).read_text())
    by_op: dict[str, dict[int, float]] = {op: {} for op in OPS}
    for key, seconds in raw.items():
        op, size = key.split(":")
        by_op[op][int(size)] = seconds
    return by_op


def fit_all_reduce(times: dict[int, float], world: int) -> tuple[float, float]:
    """(B bytes/s, α seconds) from all-reduce times by least squares on t = a·S + b."""
    xs, ys = list(times), [times[s] for s in times]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    bandwidth = 2 * (world - 1) / world / slope
    latency = max(0.0, intercept / (2 * (world - 1)))
    return bandwidth, latency


def main() -> int:
    import torch

    from memplan import comm
    from memplan.hardware import resolve_device

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", help="the profile whose [interconnect] to check (default: the local device)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    world = args.world_size
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world
    profile = resolve_device(args.device)
    measured = measure(world, args.reps, gpus)
    bandwidth, latency = fit_all_reduce(measured["all-reduce"], world)
    links = {"profile": comm.link_of(profile, world),
             "fitted": comm.Link(kind="fitted", bandwidth_bytes_per_second=bandwidth, latency_seconds=latency)}
    formula = {"all-reduce": comm.all_reduce_seconds, "all-gather": comm.all_gather_seconds,
               "reduce-scatter": comm.reduce_scatter_seconds}
    backend = "NCCL/RCCL, one GPU per process" if gpus else "gloo on this CPU"
    print(f"{world} processes, {backend}; profile {profile.name}: {links['profile'].kind}, "
          f"{links['profile'].bandwidth_bytes_per_second / 1e9:.3g} GB/s, "
          f"{links['profile'].latency_seconds * 1e6:.1f} µs; fitted to all-reduce: {bandwidth / 1e9:.3g} GB/s, "
          f"{latency * 1e6:.1f} µs")
    print(f"{'op':15s} {'bytes':>10s} {'measured':>10s} {'profile':>10s} {'error':>8s} {'fitted':>10s} {'error':>8s}")
    rows, errors = [], {(op, k): [] for op in OPS for k in links}
    for op in OPS:
        for size, seconds in sorted(measured[op].items()):
            row = {"op": op, "bytes": size, "measured_seconds": seconds}
            cells = []
            for k, link in links.items():
                predicted = formula[op](size, world, link)
                error = (predicted - seconds) / seconds
                errors[(op, k)].append(abs(error))
                row[f"{k}_seconds"], row[f"{k}_error"] = predicted, error
                cells.append(f"{predicted * 1e3:8.2f}ms {error:+8.1%}")
            rows.append(row)
            print(f"{op:15s} {size:10d} {seconds * 1e3:8.2f}ms " + " ".join(cells))
    summary = {f"{op} ({k})": statistics.median(v) for (op, k), v in errors.items()}
    print("median |error|: " + ", ".join(f"{name} {v:.0%}" for name, v in summary.items()))
    if not gpus:
        print(f"profile: the ring formulas with {profile.name}'s [interconnect] ({links['profile'].kind}, "
              f"{links['profile'].bandwidth_bytes_per_second / 1e9:.3g} GB/s), the link between two machines of "
              "this profile; these ranks share one machine's memory and never use it, so its errors measure that "
              "link against this loopback, not the formulas.")
        print("fitted: the formulas with B and α fitted to gloo's all-reduce here; gloo's all-gather and "
              "reduce-scatter on shared memory do not move half of what its all-reduce does, as a ring on a link "
              "does.")
        verdict = not_judged("gloo on one machine's CPU: the bars are for NCCL/RCCL over a real link "
                             "(one GPU per rank)")
    else:
        bars = [Bar(f"{op} (fitted): median |error|", summary[f"{op} (fitted)"], FITTED_BAR) for op in OPS]
        if args.device:  # the profile named is this machine's: its link is judged too
            bars += [Bar(f"{op} (profile {profile.name}): median |error|", summary[f"{op} (profile)"], PROFILE_BAR)
                     for op in OPS]
        verdict = judge(bars)
    if args.json:
        Path(args.json).write_text(json.dumps({"world_size": world, "backend": backend, "profile": profile.name,
                                               "fitted": {"bandwidth_bytes_per_second": bandwidth,
                                                          "latency_seconds": latency},
                                               "rows": rows, "median_abs_error": summary,
                                               "judged": bool(gpus), "passed": verdict == 0}, indent=1))
    return verdict


if __name__ == "__main__":
    sys.exit(main())

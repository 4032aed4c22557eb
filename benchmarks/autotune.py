"""How good and how cheap `memplan autotune` is: the analytic search's time, and, on this CPU, the chosen
plan measured against an exhaustive measured grid and against a batch-size finder.

    python benchmarks/autotune.py [--quick] [--json-out out/autotune-benchmark.json] [--search-only]

Part 1, the analytic search (no torch): the median and the largest time of `autotune()` over
repeated runs for a spread of models and devices, including ones where nothing fits (the advice is
part of the answer). The bar: under 1 s, because autotune runs inside every quick start and every
`memplan train` given model options alone, before anything trains: the search must not be noticed.

Part 2, measured on this CPU: three small models × two contexts × budgets of 256 MiB, 1 GiB and 4 GiB.
For each (model, context) every setup of the space autotune searches (micro-batch over the divisors
of the global batch × checkpointing × attention × fused/foreach AdamW; fp32, the CPU's only fast
precision; no compile: the CPU profile does not say it helps) is run for real once, in a fresh
process, as `autotune --verify` runs a trial (trainer/verify.py; at most 4 micro-batches a step), with
4 steps: a warm-up and three timed, tokens/s from the median step. A measurement does not depend on the budget, so the grid is shared
by the three budgets. Per budget:

- autotune's plan, verified with `trainer.verify.verify` (its own trials, counted): its measured peak
  must be ≤ the budget;
- its measured tokens/s against the best measured grid setup that fits the budget (the grid's own
  measurement of the chosen setup is used for the ratio, so both sides come from the same campaign).
  The best of 48 noisy measurements is biased upward (the winner's curse), so when it is not the
  chosen setup both are run twice more, interleaved, and the medians of three give the "confirmed"
  ratio. The bar: ≥ 90%. autotune chooses from predictions, not measurements, so its plan may lose to
  the best measured setup by about the step-time prediction's error; 10% is what a plan may give up for
  never running the grid;
- the real trial steps autotune used, against a doubling-then-bisection batch-size finder (Lightning's
  BatchSizeFinder, mode "binsearch", steps_per_trial=3) on the same budget, probing the micro-batch of
  the default setup (SDPA, no checkpointing, foreach AdamW, no accumulation) from 1, doubling up to the
  global batch (a generous cap: the real finder doubles until it fails or runs out of data). A probe
  fails when its measured peak exceeds the budget. Probe measurements, like the grid, are shared across
  budgets (a probe is the same run whatever the budget); the steps counted are those the finder would run.

"Measured peak" on a CPU (trainer/verify.py): the CPU profile's runtime context plus the growth of the
trial process's resident memory over a baseline taken after a warm-up step, so it compares with the
predicted peak_reserved (allocated + the same runtime context). The absolute peak RSS of the trial
process is printed too: it is higher by however much the profile's runtime context undercounts a
process that has run a training step.

The trials run with OMP_NUM_THREADS=1 (set here unless already set): the machine is shared, and two
OpenMP threads spin-waiting against other processes made small steps 10-30× slower in this
environment. It reports and does not judge; timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bars import Bar, judge  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")

from memplan.autotune import ATTENTIONS, OPTIMIZERS, autotune, divisors  # noqa: E402
from memplan.hardware import load_profile  # noqa: E402
from memplan.model import ModelSpec, from_size, preset  # noqa: E402
from memplan.setup import CHECKPOINTINGS, TrainSetup  # noqa: E402
from memplan.units import GiB, MiB, format_bytes  # noqa: E402

SEARCH_CASES = [
    # (label, spec, device, ctx)
    ("22m gtx-1650 1k", from_size("22m"), "gtx-1650", 1024),
    ("124m rtx-4090 2k", from_size("124m"), "rtx-4090", 2048),
    ("350m rtx-3060 2k", from_size("350m"), "rtx-3060-12gb", 2048),
    ("1b rtx-4090 2k", from_size("1b"), "rtx-4090", 2048),
    ("tinyllama h100 4k", preset("tinyllama-1.1b"), "h100-sxm", 4096),
    ("3b strix-halo 4k", from_size("3b"), "strix-halo", 4096),
    ("7b h200 8k", from_size("7b"), "h200", 8192),
    ("gpt2 l4 1k (96 seq)", preset("gpt2"), "l4", 1024),
    ("1b gtx-1650 2k (none)", from_size("1b"), "gtx-1650", 2048),
    ("7b gtx-1650 2k (none)", from_size("7b"), "gtx-1650", 2048),
]

CPU_MODELS = {
    "S": ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=4, ffn=192, vocab=512, tied=True, name="S"),
    "M": ModelSpec(arch="llama", layers=3, hidden=128, heads=4, kv_heads=4, ffn=352, vocab=1024, tied=True, name="M"),
    "L": ModelSpec(arch="llama", layers=4, hidden=192, heads=6, kv_heads=6, ffn=512, vocab=2048, tied=True, name="L"),
}
CPU_CTXS = (128, 512)
BUDGETS = (256 * MiB, 1 * GiB, 4 * GiB)
GLOBAL_BATCH_TOKENS = 1024
FINDER_STEPS_PER_TRIAL = 3  # Lightning's BatchSizeFinder default
GRID_STEPS = 4  # per grid trial: a warm-up and three timed steps (tokens/s from the median)
CONFIRM_RUNS = 2  # extra runs each of the chosen setup and the grid's best, interleaved, when they differ


# ---- part 1 -----------------------------------------------------------------------------------

def search_times(repeat: int) -> list[dict]:
    rows = []
    for label, spec, device_name, ctx in SEARCH_CASES:
        device = load_profile(device_name)
        kwargs = {"global_batch": 96} if "96 seq" in label else {}
        autotune(spec, device, ctx=ctx, **kwargs)  # warm the profile cache
        times, result = [], None
        for _ in range(repeat):
            t0 = time.perf_counter()
            result = autotune(spec, device, ctx=ctx, **kwargs)
            times.append(time.perf_counter() - t0)
        rows.append({"case": label, "median_seconds": statistics.median(times), "max_seconds": max(times),
                     "walks": result.evaluated, "fits": result.plan is not None,
                     "plan": result.plan.contract_plan() if result.plan else None})
    return rows


def print_search(rows: list[dict]) -> float:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Part 1: analytic search time (autotune(), in-process, no torch)", title_justify="left")
    for col in ("case", "median", "max", "walks", "plan"):
        table.add_column(col, justify="left" if col in ("case", "plan") else "right")
    for r in rows:
        p = r["plan"]
        plan = (f"{p['micro_batch']}×{p['grad_accum']} {p['checkpointing']} {p['attention']} {p['precision']}"
                if p else "nothing fits (advice)")
        table.add_row(r["case"], f"{r['median_seconds'] * 1e3:.0f} ms", f"{r['max_seconds'] * 1e3:.0f} ms",
                      str(r["walks"]), plan)
    Console().print(table)
    worst = max(r["max_seconds"] for r in rows)
    print(f"slowest search: {worst * 1e3:.0f} ms ({'under' if worst < 1 else 'OVER'} the 1 s bar)")
    return worst


# ---- part 2 -----------------------------------------------------------------------------------

def _key(s: TrainSetup) -> str:
    return f"{s.micro_batch}x{s.grad_accum} {s.checkpointing} {s.attention} {s.optimizer}"


def measure_grid(runner, spec: ModelSpec, ctx: int, per: int, context: int, progress) -> dict[TrainSetup, object]:
    grid = {}
    for checkpointing in CHECKPOINTINGS:
        for attention in ATTENTIONS:
            for optimizer in OPTIMIZERS:
                for m in divisors(per):
                    setup = TrainSetup(ctx=ctx, micro_batch=m, grad_accum=per // m, precision="fp32",
                                       attention=attention, checkpointing=checkpointing, optimizer=optimizer)
                    grid[setup] = runner.run(spec, setup, steps=GRID_STEPS, context_bytes=context)
                    progress()
    return grid


def finder(probe, budget: int, cap: int) -> tuple[int, int]:
    """Doubling then bisection on the micro-batch (Lightning's binsearch); returns (batch found, probes)."""
    probes = 0

    def ok(m: int) -> bool:
        nonlocal probes
        probes += 1
        t = probe(m)
        return t.status == "ok" and t.peak_bytes <= budget

    if not ok(1):
        return 0, probes
    lo, hi = 1, None
    m = 2
    while m <= cap:
        if ok(m):
            lo, m = m, m * 2
        else:
            hi = m
            break
    if hi is None:
        return lo, probes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def cpu_campaign(quick: bool) -> list[dict]:
    from trainer.verify import DEFAULT_STEPS, TrialRunner, verify

    device = load_profile("cpu")
    models = {"S": CPU_MODELS["S"]} if quick else CPU_MODELS
    ctxs = CPU_CTXS[:1] if quick else CPU_CTXS
    rows = []
    started = time.perf_counter()
    with TrialRunner() as runner:
        for name, spec in models.items():
            for ctx in ctxs:
                per = GLOBAL_BATCH_TOKENS // ctx
                count = [0]
                total = len(CHECKPOINTINGS) * len(ATTENTIONS) * len(OPTIMIZERS) * len(divisors(per))

                def progress():
                    count[0] += 1
                    print(f"\r  {name} ctx {ctx}: grid {count[0]}/{total} "
                          f"({time.perf_counter() - started:.0f} s)", end="", file=sys.stderr, flush=True)

                grid = measure_grid(runner, spec, ctx, per, device.runtime_context_bytes, progress)
                print(file=sys.stderr)
                probes = {}
                reruns: dict[TrainSetup, list] = {}

                def rerun(setup: TrainSetup) -> list:
                    """The grid's measurement of a setup and CONFIRM_RUNS more (made once, shared by budgets)."""
                    if setup not in reruns:
                        reruns[setup] = [grid[setup]]
                    return reruns[setup]

                def confirm(a: TrainSetup, b: TrainSetup) -> tuple[float, float]:
                    ra, rb = rerun(a), rerun(b)
                    while len(ra) <= CONFIRM_RUNS or len(rb) <= CONFIRM_RUNS:  # interleaved: a, b, a, b
                        for setup, runs in ((a, ra), (b, rb)):
                            if len(runs) <= CONFIRM_RUNS:
                                runs.append(runner.run(spec, setup, steps=GRID_STEPS,
                                                       context_bytes=device.runtime_context_bytes))
                    return (statistics.median(t.tokens_per_second or 0.0 for t in ra),
                            statistics.median(t.tokens_per_second or 0.0 for t in rb))

                def probe(m: int):
                    if m not in probes:
                        setup = TrainSetup(ctx=ctx, micro_batch=m, grad_accum=1, precision="fp32", attention="sdpa",
                                           checkpointing="none", optimizer="adamw")
                        probes[m] = runner.run(spec, setup, context_bytes=device.runtime_context_bytes)
                    return probes[m]

                for budget in BUDGETS:
                    rows.append(_case(runner, verify, spec, name, ctx, per, budget, grid, probe, confirm, device,
                                      DEFAULT_STEPS))
                    _print_row(rows[-1])
    return rows


def _case(runner, verify, spec, name, ctx, per, budget, grid, probe, confirm, device, steps) -> dict:
    result = autotune(spec, device, ctx=ctx, global_batch_tokens=GLOBAL_BATCH_TOKENS, budget_bytes=budget)
    fitting = {s: t for s, t in grid.items() if t.status == "ok" and t.peak_bytes <= budget}
    best = max(fitting.items(), key=lambda kv: kv[1].tokens_per_second) if fitting else None
    row = {"model": name, "params": spec.params, "ctx": ctx, "global_batch_sequences": per, "budget_bytes": budget,
           "analytic_plan": _key(result.plan.setup) if result.plan else None,
           "analytic_predicted_peak": result.plan.predicted["peak_reserved"] if result.plan else None,
           "grid_points": len(grid), "grid_fitting": len(fitting),
           "grid_best": _key(best[0]) if best else None,
           "grid_best_tokens_per_second": best[1].tokens_per_second if best else None}
    if result.plan is not None:
        v = verify(result, runner=runner, steps=steps)
        row.update({"verified_plan": _key(v.plan.setup) if v.plan else None,
                    "verify_trials": v.trials, "verify_plans_tried": len(v.attempts),
                    "attempts": [{"plan": _key(a.plan.setup), "outcome": a.outcome,
                                  "predicted_peak": a.plan.predicted["peak_reserved"],
                                  "measured_peak": a.trial.peak_bytes, "peak_rss": a.trial.peak_rss,
                                  "tokens_per_second": a.trial.tokens_per_second} for a in v.attempts]})
        if v.plan is not None:
            same = grid[v.plan.setup]
            last = v.attempts[-1].trial
            row.update({"measured_peak": last.peak_bytes, "peak_rss": last.peak_rss,
                        "within_budget": last.peak_bytes <= budget,
                        "grid_peak_of_chosen": same.peak_bytes,
                        "verify_tokens_per_second": last.tokens_per_second,
                        "grid_tokens_per_second_of_chosen": same.tokens_per_second,
                        "ratio_to_grid_best": (same.tokens_per_second / best[1].tokens_per_second) if best else None,
                        "verify_ratio_to_grid_best": (last.tokens_per_second / best[1].tokens_per_second)
                        if best else None})
            if best is not None and best[0] != v.plan.setup:
                chosen_tps, best_tps = confirm(v.plan.setup, best[0])
                row.update({"confirmed_chosen_tokens_per_second": chosen_tps,
                            "confirmed_best_tokens_per_second": best_tps,
                            "confirmed_ratio": chosen_tps / best_tps})
            elif best is not None:
                row["confirmed_ratio"] = 1.0
    else:
        row.update({"verified_plan": None, "verify_trials": 0, "verify_plans_tried": 0, "attempts": [],
                    "advice": result.advice})
    found, probes = finder(probe, budget, per)
    row.update({"finder_batch": found, "finder_probes": probes, "finder_steps": probes * FINDER_STEPS_PER_TRIAL})
    return row


def _print_row(r: dict) -> None:
    ratio = f"{r['ratio_to_grid_best']:.0%}" if r.get("ratio_to_grid_best") is not None else "-"
    print(f"  {r['model']} ctx {r['ctx']} budget {format_bytes(r['budget_bytes'])}: autotune "
          f"{r.get('verified_plan') or 'nothing'} (analytic {r['analytic_plan']}), grid best {r['grid_best']}, "
          f"ratio {ratio}, steps {r['verify_trials']} vs finder {r['finder_steps']}", file=sys.stderr, flush=True)


def print_campaign(rows: list[dict]) -> list:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Part 2: on this CPU, autotune --verify against the measured grid and a batch-size finder",
                  title_justify="left")
    cols = ("model", "ctx", "budget", "autotune plan (verified)", "meas. peak", "abs RSS", "≤ budget",
            "tok/s (grid)", "grid best", "best tok/s", "ratio", "confirmed", "steps", "finder steps")
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "autotune plan (verified)", "grid best") else "right")
    for r in rows:
        fits = r.get("within_budget")
        table.add_row(
            f"{r['model']} ({r['params'] / 1e6:.2f}M)", str(r["ctx"]), format_bytes(r["budget_bytes"]),
            r.get("verified_plan") or ("nothing fits" if r["analytic_plan"] is None else "none verified"),
            format_bytes(r["measured_peak"]) if r.get("measured_peak") else "-",
            format_bytes(r["peak_rss"]) if r.get("peak_rss") else "-",
            "-" if fits is None else ("yes" if fits else "NO"),
            f"{r['grid_tokens_per_second_of_chosen']:,.0f}" if r.get("grid_tokens_per_second_of_chosen") else "-",
            r["grid_best"] or "none fits", f"{r['grid_best_tokens_per_second']:,.0f}"
            if r["grid_best_tokens_per_second"] else "-",
            f"{r['ratio_to_grid_best']:.0%}" if r.get("ratio_to_grid_best") is not None else "-",
            f"{r['confirmed_ratio']:.0%}" if r.get("confirmed_ratio") is not None else "-",
            str(r["verify_trials"]), f"{r['finder_steps']} (→{r['finder_batch']})")
    Console(width=200).print(table)
    verified = [r for r in rows if r.get("verified_plan")]
    over = [r for r in verified if not r["within_budget"]]
    ratios = [r["ratio_to_grid_best"] for r in verified if r.get("ratio_to_grid_best") is not None]
    confirmed = [r["confirmed_ratio"] for r in verified if r.get("confirmed_ratio") is not None]
    missed = [r for r in rows if r["grid_best"] and not r.get("verified_plan")]
    print(f"cases: {len(rows)}; verified plans: {len(verified)}; measured peak over budget: {len(over)}")
    if ratios:
        print(f"tokens/s of the chosen plan / best fitting grid setup: median {statistics.median(ratios):.0%}, "
              f"min {min(ratios):.0%}; cases at ≥ 90%: {sum(x >= 0.9 for x in ratios)}/{len(ratios)}")
    if confirmed:
        print(f"the same, re-measured {CONFIRM_RUNS + 1}× each, interleaved (medians): median "
              f"{statistics.median(confirmed):.0%}, min {min(confirmed):.0%}; cases at ≥ 90%: "
              f"{sum(x >= 0.9 for x in confirmed)}/{len(confirmed)}")
    print(f"cases where the grid has a fitting setup but autotune offers none: {len(missed)}")
    steps = [r["verify_trials"] for r in rows]
    finder_steps = [r["finder_steps"] for r in rows]
    print(f"real trial steps: autotune {sum(steps)} in all (median {statistics.median(steps)} per case), "
          f"finder {sum(finder_steps)} (median {statistics.median(finder_steps)})")
    bars = [Bar("verified plans whose measured peak is over the budget", len(over), 0, unit="")]
    if confirmed:
        bars.append(Bar("chosen plan's tokens/s ÷ best fitting grid setup (confirmed): lowest", min(confirmed), 0.9,
                        at_most=False))
    return bars


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one model, one context (a smoke run)")
    parser.add_argument("--search-only", action="store_true", help="part 1 only (no torch)")
    parser.add_argument("--repeat", type=int, default=7, help="runs per search case")
    parser.add_argument("--json-out", default="out/autotune-benchmark.json")
    args = parser.parse_args()

    report = {"search": search_times(args.repeat)}
    bars = [Bar("slowest analytic search", print_search(report["search"]), 1.0, unit="s")]
    if not args.search_only:
        t0 = time.perf_counter()
        report["cpu"] = cpu_campaign(args.quick)
        report["cpu_seconds"] = time.perf_counter() - t0
        bars += print_campaign(report["cpu"])
        print(f"part 2 took {report['cpu_seconds'] / 60:.1f} min")
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from memplan.fsutil import write_atomic

    write_atomic(out, json.dumps(report, indent=2, default=str))
    print(f"wrote {out}")
    return judge(bars)


if __name__ == "__main__":
    sys.exit(main())

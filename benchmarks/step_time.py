"""Step time: memplan's prediction against real training steps on this machine's CPU.

For each config (models from ~300k to ~110M parameters; ctx 64-1024; batch 1-16; fp32 and bf16-mixed;
eager and SDPA attention; no and full checkpointing) it builds the reference model
(``trainer.model.build_model``), runs ``trainer.step.train_step`` (the exact step memplan plans) for a
few warm-up steps and then at least 5 measured steps, and compares the median step time with:

- the prediction from a profile calibrated at the start of the same run (``trainer.calibrate``, the
  code behind ``memplan calibrate``), with the same thread count and clock;
- the prediction from the static ``cpu`` profile (``memplan/profiles/cpu.toml``), which is what memplan says
  without calibration.

Bars: median absolute error ≤ 15%, worst ≤ 35%, for the calibrated prediction. Step time is predicted from
measured kernel rates on a shared, noisy CPU, so it cannot be as tight as memory (≤ 3% / ≤ 10%); 15% is
close enough to rank setups (what autotune needs) and to tell a run's length in advance; 35% is the allowance
for the worst single config, where one measurement on a shared machine can be far off (see Noise below).

Noise. This machine is shared with other engineers' test runs. By default the benchmark pins torch to
ONE thread and times with the process's CPU time (``--clock cpu``): a one-thread process's CPU time is
the wall time its work takes on a core nobody else uses, while its wall time also counts the time other
processes hold the core. With two threads on two shared cores every op waits at a barrier for whichever
thread was descheduled, and measured rates varied 5x within one minute (12-88 GFLOPS for the same matmul).
Calibration and measurement use the same threads and clock. Between configs a reference matmul is
timed; its spread over the run, each config's spread over its steps and the wall/CPU ratio (how much
of the wall time other processes took) are reported as the noise seen. ``--clock wall --threads N``
measures the way a dedicated machine would.

    PYTHONPATH=. python benchmarks/step_time.py --json step_time.json --html step_time.html
    PYTHONPATH=. python benchmarks/step_time.py --quick            # 6 configs, a 20 s calibration
    PYTHONPATH=. python -m memplan calibrate --threads 1 --clock cpu --out cal.toml
    PYTHONPATH=. python benchmarks/step_time.py --device cal.toml   # reuse that calibration (same threads/clock)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from memplan.compat import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch

from bars import Bar, judge, not_judged  # noqa: E402  (benchmarks/, the script's own directory)
from memplan.hardware import device_from_toml, load_profile
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.timing import model_flops, step_time
from trainer.calibrate import calibrate, clock_function, merge_calibrations, profile_data, profile_toml
from trainer.model import build_model
from trainer.step import make_optimizer, param_dtype, set_matmul_precision, train_step

MEDIAN_BAR, WORST_BAR = 0.15, 0.35


def llama(layers: int, hidden: int, ffn: int, vocab: int, heads: int | None = None) -> ModelSpec:
    heads = heads or max(1, hidden // 64)
    return ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=ffn, vocab=vocab,
                     tied=True)


MODELS = {
    "300k": llama(4, 64, 192, 1024, heads=2),  # 0.28M
    "1.3m": llama(4, 128, 352, 4096, heads=2),  # 1.3M
    "gpt2-2m": ModelSpec(arch="gpt2", layers=4, hidden=128, heads=2, kv_heads=2, ffn=512, vocab=8192, tied=True,
                         max_positions=1024),  # 1.9M: LayerNorm, GELU, biases, learned positions
    "23m": llama(6, 384, 1024, 32000),  # memplan's 22m size
    "42m": llama(8, 512, 1408, 32000),  # 42M
    "109m": llama(12, 768, 2048, 32000),  # 109M
}


@dataclass(frozen=True)
class Config:
    model: str
    ctx: int
    batch: int
    precision: str = "fp32"
    attention: str = "sdpa"
    checkpointing: str = "none"

    @property
    def name(self) -> str:
        return (f"{self.model} ctx{self.ctx} b{self.batch} {self.precision} {self.attention}"
                + (f" ckpt-{self.checkpointing}" if self.checkpointing != "none" else ""))

    @property
    def spec(self) -> ModelSpec:
        return MODELS[self.model].replace(name=self.model)

    @property
    def setup(self) -> TrainSetup:
        return TrainSetup(ctx=self.ctx, micro_batch=self.batch, precision=self.precision, attention=self.attention,
                          checkpointing=self.checkpointing, optimizer="adamw")


CONFIGS = [
    Config("300k", 64, 1),
    Config("300k", 64, 16),
    Config("300k", 256, 4, attention="eager"),
    Config("300k", 64, 2, precision="bf16-mixed"),
    Config("300k", 128, 8, checkpointing="full"),
    Config("300k", 1024, 1, attention="eager", checkpointing="full"),
    Config("1.3m", 256, 4),
    Config("1.3m", 128, 2, precision="bf16-mixed", attention="eager"),
    Config("1.3m", 512, 2, attention="eager", checkpointing="full"),
    Config("1.3m", 64, 4, precision="bf16-mixed", checkpointing="full"),
    Config("gpt2-2m", 256, 2),
    Config("23m", 256, 4),
    Config("23m", 1024, 1, attention="eager"),
    Config("23m", 512, 2, checkpointing="full"),
    Config("23m", 64, 1, precision="bf16-mixed"),
    Config("42m", 128, 8),
    Config("42m", 1024, 1, attention="eager", checkpointing="full"),
    Config("42m", 64, 1, precision="bf16-mixed", attention="eager"),
    Config("109m", 64, 1),
    Config("109m", 256, 2),
]
QUICK = [CONFIGS[i] for i in (0, 2, 3, 6, 11, 18)]


def random_batches(spec: ModelSpec, setup: TrainSetup, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, spec.vocab, (setup.micro_batch, setup.ctx), generator=g),
             torch.randint(0, spec.vocab, (setup.micro_batch, setup.ctx), generator=g))
            for _ in range(setup.grad_accum)]


def reference_probe(now) -> float:
    """Seconds of a fixed fp32 matmul (512³, median of 5): the drift of the machine across the run."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a @ b
    times = []
    for _ in range(5):
        t0 = now()
        a @ b
        times.append(now() - t0)
    return statistics.median(times)


def measure(cfg: Config, now, steps: int, warmup: int, seed: int = 0) -> dict:
    """Median seconds of ``steps`` train_step calls after ``warmup`` (by the chosen clock), plus wall times."""
    spec, setup = cfg.spec, cfg.setup
    torch.manual_seed(seed)
    set_matmul_precision(setup.precision)
    model = build_model(spec, setup.attention, setup.checkpointing, param_dtype(setup.precision))
    optimizer = make_optimizer(model, setup.optimizer)
    batches = random_batches(spec, setup, seed)
    for _ in range(warmup):
        train_step(model, optimizer, batches, setup, "cpu")
    clock, wall = [], []
    for _ in range(steps):
        w0, c0 = time.perf_counter(), now()
        train_step(model, optimizer, batches, setup, "cpu")
        clock.append(now() - c0)
        wall.append(time.perf_counter() - w0)
    del model, optimizer, batches
    gc.collect()
    med = statistics.median(clock)
    q = statistics.quantiles(clock, n=4) if len(clock) >= 4 else [min(clock), med, max(clock)]
    return {"seconds": med, "steps": clock, "wall_seconds": statistics.median(wall), "spread": (q[2] - q[0]) / med,
            "wall_over_clock": statistics.median(wall) / med}


def predict(cfg: Config, device) -> dict:
    t = step_time(cfg.spec, cfg.setup, device)
    data = t.terms["data"].seconds  # the benchmark feeds prepared batches: no loading in the measured step
    return {"seconds": t.step_seconds - data, "breakdown": {k: v.seconds for k, v in t.terms.items() if k != "data"},
            "bounds": {k: v.bound for k, v in t.terms.items()}, "mfu": t.mfu}


def calibrate_now(args, label: str):
    print(f"calibrating ({label}) for {args.calibrate_seconds:g} s ({args.threads} thread(s), clock {args.clock}) ...",
          file=sys.stderr, flush=True)
    cal = calibrate(args.calibrate_seconds, threads=args.threads, clock=args.clock, loaded=("memplan.cli",))
    print(f"  fp32 matmul {cal.matmul_tflops().get('fp32', 0) * 1e3:.1f} GFLOPS, launch "
          f"{cal.launch_overhead_seconds * 1e6:.1f} us/op, timing spread {cal.noise:.0%}, {cal.seconds:.0f} s",
          file=sys.stderr, flush=True)
    return cal


def as_device(cal, path: str):
    text = profile_toml(profile_data(cal, "cpu-calibrated"))
    Path(path).write_text(text)
    return device_from_toml(tomllib.loads(text), path)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    now = clock_function(args.clock)
    t_start = time.perf_counter()
    configs = QUICK if args.quick else CONFIGS
    if args.only:
        configs = [c for c in configs if any(s in c.name for s in args.only)]
    cals = []
    if args.profile:
        calibrated = load_profile(args.profile)
        if calibrated.calibrated.get("threads") != args.threads or calibrated.calibrated.get("clock") != args.clock:
            print(f"warning: {args.profile} was calibrated with {calibrated.calibrated.get('threads')} thread(s) "
                  f"and clock {calibrated.calibrated.get('clock')}; this run uses {args.threads} and {args.clock}",
                  file=sys.stderr)
    else:
        cals.append(calibrate_now(args, "start"))
    probes = [reference_probe(now)]
    per_pass = max(3, -(-args.steps // args.passes))
    samples: list[list[dict]] = [[] for _ in configs]
    for p in range(args.passes):
        if p and cals:
            cals.append(calibrate_now(args, f"after pass {p}"))
        for i, cfg in enumerate(configs):
            m = measure(cfg, now, per_pass, args.warmup if p == 0 else 1, seed=i)
            probes.append(reference_probe(now))
            samples[i].append(m)
            print(f"pass {p + 1}: {cfg.name:44s} {m['seconds'] * 1e3:9.1f} ms (spread {m['spread']:4.0%}, wall/clock "
                  f"{m['wall_over_clock']:.2f})", file=sys.stderr, flush=True)
    measured = []
    for runs in samples:
        steps = [t for r in runs for t in r["steps"]]
        walls = [r["wall_seconds"] for r in runs]
        med = statistics.median(steps)
        q = statistics.quantiles(steps, n=4)
        measured.append({"seconds": med, "steps": steps, "wall_seconds": statistics.median(walls),
                         "spread": (q[2] - q[0]) / med, "wall_over_clock": statistics.median(walls) / med,
                         "pass_medians": [r["seconds"] for r in runs]})
    if cals:
        cals.append(calibrate_now(args, "end"))
    if cals:
        calibrated = as_device(merge_calibrations(cals), args.save_profile)
        first_only = as_device(cals[0], str(Path(args.save_profile).with_suffix(".start.toml")))
    else:
        first_only = calibrated
    cal_summary = {"profile": args.profile or args.save_profile, "calibrations": len(cals),
                   "per_calibration": [{"seconds": c.seconds, "noise": c.noise, "matmul_tflops": c.matmul_tflops(),
                                        "launch_overhead_seconds": c.launch_overhead_seconds,
                                        "copy_bytes_per_second": c.bandwidth_bytes_per_second} for c in cals]}
    static = load_profile("cpu")
    peak = calibrated.calibrated.get("matmul_tflops", {})
    rows = []
    for cfg, m in zip(configs, measured):
        pred, first, stat = predict(cfg, calibrated), predict(cfg, first_only), predict(cfg, static)
        mf = model_flops(cfg.spec, cfg.setup)
        dtype = cfg.setup.compute_dtype
        row = {
            "name": cfg.name, "model": cfg.spec.to_json(), "setup": cfg.setup.to_json(), "params": cfg.spec.params,
            "measured_seconds": m["seconds"], "measured_steps": m["steps"], "measured_wall_seconds": m["wall_seconds"],
            "spread": m["spread"], "wall_over_clock": m["wall_over_clock"], "pass_medians": m["pass_medians"],
            "predicted_seconds": pred["seconds"], "error": (pred["seconds"] - m["seconds"]) / m["seconds"],
            "start_calibration_error": (first["seconds"] - m["seconds"]) / m["seconds"],
            "static_predicted_seconds": stat["seconds"],
            "static_error": (stat["seconds"] - m["seconds"]) / m["seconds"],
            "breakdown": pred["breakdown"], "bounds": pred["bounds"],
            "mfu_calibrated_peak": mf / m["seconds"] / (peak.get(dtype, peak.get("fp32", 0)) * 1e12),
            "calibrated_peak_tflops": peak.get(dtype, peak.get("fp32", 0)),
        }
        rows.append(row)
        top = max(pred["breakdown"], key=pred["breakdown"].get)
        print(f"{cfg.name:44s} measured {m['seconds'] * 1e3:9.1f} ms  calibrated {pred['seconds'] * 1e3:9.1f} ms "
              f"{row['error']:+6.1%} (start only {row['start_calibration_error']:+6.1%})  static "
              f"{stat['seconds'] * 1e3:8.1f} ms {row['static_error']:+7.1%}  MFU {row['mfu_calibrated_peak']:4.0%}  "
              f"[{top} {pred['breakdown'][top] / pred['seconds']:.0%}]", file=sys.stderr, flush=True)
    errs = [abs(r["error"]) for r in rows]
    serrs = [abs(r["static_error"]) for r in rows]
    ferrs = [abs(r["start_calibration_error"]) for r in rows]
    fp32 = [c["matmul_tflops"].get("fp32", 0) for c in cal_summary["per_calibration"]]
    result = {
        "device": calibrated.title, "threads": args.threads, "clock": args.clock, "torch": torch.__version__,
        "calibration": cal_summary,
        "rows": rows,
        "median_abs_error": statistics.median(errs), "max_abs_error": max(errs),
        "start_calibration_median_abs_error": statistics.median(ferrs),
        "start_calibration_max_abs_error": max(ferrs),
        "static_median_abs_error": statistics.median(serrs), "static_max_abs_error": max(serrs),
        "bars": {"median_abs_error": MEDIAN_BAR, "max_abs_error": WORST_BAR},
        "passed": statistics.median(errs) <= MEDIAN_BAR and max(errs) <= WORST_BAR,
        "noise": {
            "reference_probe_seconds": probes,
            "reference_probe_max_over_min": max(probes) / min(probes),
            "median_step_spread": statistics.median(r["spread"] for r in rows),
            "median_pass_to_pass": statistics.median(max(r["pass_medians"]) / min(r["pass_medians"]) for r in rows),
            "median_wall_over_clock": statistics.median(r["wall_over_clock"] for r in rows),
            "max_wall_over_clock": max(r["wall_over_clock"] for r in rows),
            "calibration_fp32_tflops": fp32,
            "calibration_fp32_max_over_min": (max(fp32) / min(fp32)) if fp32 and min(fp32) > 0 else None,
        },
        "seconds": time.perf_counter() - t_start,
    }
    return result


def write_html(result: dict, path: str) -> None:
    from memplan.reports.page import write_page
    from memplan.reports.step_time import step_time_page

    write_page(step_time_page(result, median_bar=MEDIAN_BAR, worst_bar=WORST_BAR), path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads for calibration and steps (default 1)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="cpu (default; needs --threads 1) or wall")
    p.add_argument("--calibrate-seconds", type=float, default=60.0, help="budget of each calibration")
    p.add_argument("--passes", type=int, default=2,
                   help="measure every config in this many passes, calibrating before, between and after them; "
                        "predictions use the median calibration, measurements the median of all steps")
    p.add_argument("--device", "--profile", dest="profile",
                   help="a profile TOML written by `memplan calibrate` to use instead of calibrating here "
                        "(calibrate with the same --threads and --clock)")
    p.add_argument("--save-profile", default="step_time_calibrated.toml", help="where the run's calibration goes")
    p.add_argument("--steps", type=int, default=6, help="measured steps per config, over all passes (>= 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="6 configs")
    p.add_argument("--only", nargs="*", help="configs whose name contains one of these strings")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--html", help="write the HTML report here")
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu needs --threads 1 (process CPU time sums the threads' time)")
    if args.steps < 5 and not args.only:
        p.error("--steps must be at least 5")
    if args.quick and args.calibrate_seconds == 60.0:
        args.calibrate_seconds = 20.0
    result = run(args)
    worst = max(result["rows"], key=lambda r: abs(r["error"]))
    print(f"\ncalibrated: median |error| {result['median_abs_error']:.1%} (bar {MEDIAN_BAR:.0%}), worst "
          f"{result['max_abs_error']:.1%} (bar {WORST_BAR:.0%}, {worst['name']})")
    print(f"calibrated at the start only: median |error| {result['start_calibration_median_abs_error']:.1%}, worst "
          f"{result['start_calibration_max_abs_error']:.1%}")
    print(f"static cpu profile: median |error| {result['static_median_abs_error']:.0%}, worst "
          f"{result['static_max_abs_error']:.0%}")
    n = result["noise"]
    print(f"noise: reference matmul max/min {n['reference_probe_max_over_min']:.2f}, median step spread "
          f"{n['median_step_spread']:.1%}, wall/clock median {n['median_wall_over_clock']:.2f} "
          f"(max {n['max_wall_over_clock']:.2f}); {result['seconds']:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.html:
        write_html(result, args.html)
    if args.only:
        return not_judged(f"--only measured {len(result['rows'])} chosen config(s); the bars are for the whole "
                          "set or --quick")
    return judge([Bar("calibrated step time: median |error|", result["median_abs_error"], MEDIAN_BAR),
                  Bar(f"calibrated step time: worst |error| ({worst['name']})", result["max_abs_error"], WORST_BAR)])


if __name__ == "__main__":
    sys.exit(main())

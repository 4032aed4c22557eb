"""The predicted peak against the measured peak on this machine's CPU, where memplan plans with this
machine's calibration: the quick start, `memplan train` with a model and setup given, and
`memplan autotune --verify`.

In a fresh cache (so the quick start calibrates this machine first, in a process of its own): the
whole quick start as a user types it (`memplan train`: three minutes, with its evaluations, samples,
checkpoints and report refreshes, whose memory a few seconds of it would not show), then each TRAIN
config for TRAIN_MINUTES on the embedded corpus, then one run per family memplan trains (FAMILIES: its own model
for llama, mistral, qwen2, gpt2, gpt_neox; transformers' own model class for qwen3, gemma, phi, stablelm and a
llama with llama3 rope_scaling), then each VERIFY config through `autotune --verify`.
For a run, measured = the largest steady-step peak
resident memory the trainer logged (VmHWM per step, less the token shards' mapped pages) and
predicted = the plan's peak_reserved (runtime context from the calibration + live tensors + the
allocator's overhead); for a verify trial, both as `autotune --verify --json` reports them. The bars:
predicted within ±10% of measured for every config, judged apart for the plans memplan makes (the quick
start and the verify trials: the bar of the quick start's promise) and for `train` given a model and
setup.

With --families-only in a fresh cache nothing calibrates this machine: the families plan on the bundled cpu
profile, whose runtime context and model code (memplan.memory.terms.model_code_resident_bytes, the code of
transformers' model class and of peft a CPU process keeps resident) are the build machine's measurements;
--calibrate first calibrates the cache as the quick start does (its runtime context and model code measured
here, in a process of its own), so the families plan with what this machine measured.

    python benchmarks/local_memory.py [--cache DIR] [--keep DIR] [--quick-minutes M] [--families-only] [--calibrate]
                                      [--family NAME ...] [--compiled-only]

With --compiled-only, only COMPILED: `memplan train --compile` with a given model and setup, each against its
plan (the compiled step's walk where memplan.memory.compiled models it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bars import Bar, judge  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BAR = 0.10
# name, `memplan train` arguments (model and setup), steps
TRAIN = [
    ("2x128 ctx256 b4 sdpa", ["--layers", "2", "--hidden", "128", "--heads", "2", "--ffn", "384", "--ctx", "256",
                              "--batch", "4"]),
    ("4x256 ctx256 b8 eager", ["--layers", "4", "--hidden", "256", "--heads", "4", "--ffn", "768", "--ctx", "256",
                               "--batch", "8", "--attention", "eager"]),
    ("4x256 ctx512 b4 full-ckpt", ["--layers", "4", "--hidden", "256", "--heads", "4", "--ffn", "768", "--ctx", "512",
                                   "--batch", "4", "--checkpointing", "full"]),
    ("6x384 ctx256 b8 sdpa", ["--layers", "6", "--hidden", "384", "--heads", "6", "--ffn", "1024", "--ctx", "256",
                              "--batch", "8"]),
    ("8x512 ctx256 b4 selective", ["--layers", "8", "--hidden", "512", "--heads", "8", "--ffn", "1536", "--ctx",
                                   "256", "--batch", "4", "--checkpointing", "selective"]),
]
# --compiled-only: `memplan train --compile` with a given model and setup, the compiled step planned by the walk's
# compile hook (memplan.memory.compiled): without checkpointing, under full checkpointing, and LoRA-free eager
# attention. Each runs COMPILED_STEPS steps, not minutes: its compile (a minute or more here) would take a timed
# run's whole time, and the trainer logs memory from step 2 on.
COMPILED = [
    ("2x128 ctx256 b4 sdpa compiled", ["--layers", "2", "--hidden", "128", "--heads", "2", "--ffn", "384", "--ctx",
                                       "256", "--batch", "4", "--compile"]),
    ("4x256 ctx512 b4 full-ckpt compiled", ["--layers", "4", "--hidden", "256", "--heads", "4", "--ffn", "768",
                                            "--ctx", "512", "--batch", "4", "--checkpointing", "full", "--compile"]),
    ("4x256 ctx256 b8 eager compiled", ["--layers", "4", "--hidden", "256", "--heads", "4", "--ffn", "768", "--ctx",
                                        "256", "--batch", "8", "--attention", "eager", "--compile"]),
]
COMPILED_STEPS = 30
# Each `train` config runs this long: its heap settles over tens of steps (2x128 ctx256 b4: 410 MiB measured at
# step 2, 463 MiB from step 14 on, 465 MiB at step 400), and the trainer samples memory once a second after the
# first two steps, so a run of a few steps measured only the unsettled step 2 (the +12.0% this row once showed).
TRAIN_MINUTES = 0.5
# One run per family memplan trains, each from a config.json of transformers' own config class (what a user's
# --model names), the same small shape: 2 layers, hidden 128, 4 heads, ffn 384; trained as `memplan train --model
# CONFIG` chooses (memplan's own model where it builds the family, else transformers'; --stack transformers for
# the llama with rope_scaling, which memplan's own model does not compute here).
FAMILY_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4)
FAMILY_SETUP = ["--ctx", "256", "--batch", "4"]
FAMILY_STEPS = 30  # steps, not minutes: the heap settles over tens of steps, however loaded the machine is


def family_configs() -> dict:
    """name: (a transformers config of the family, extra `memplan train` flags)."""
    from transformers import (GemmaConfig, GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig, PhiConfig,
                              Qwen2Config, Qwen3Config, StableLmConfig)

    s = FAMILY_SHAPE
    return {
        "llama": (LlamaConfig(**s, num_key_value_heads=2, tie_word_embeddings=True), []),
        "mistral": (MistralConfig(**s, num_key_value_heads=2, tie_word_embeddings=True), []),
        "qwen2": (Qwen2Config(**s, num_key_value_heads=2, tie_word_embeddings=True), []),
        "gpt2": (GPT2Config(n_embd=128, n_layer=2, n_head=4, n_inner=384, n_positions=1024), []),
        "gpt_neox": (GPTNeoXConfig(**s, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True), []),
        "qwen3": (Qwen3Config(**s, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True), []),
        "gemma": (GemmaConfig(**s, num_key_value_heads=1, head_dim=32), []),
        "phi": (PhiConfig(**s, tie_word_embeddings=True), []),
        "stablelm": (StableLmConfig(**s, num_key_value_heads=2, tie_word_embeddings=True), []),
        "llama rope llama3": (LlamaConfig(**s, num_key_value_heads=2, tie_word_embeddings=True,
                                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 256}),
                              ["--stack", "transformers"]),
    }


# name, `memplan autotune` arguments (model, context, budget)
VERIFY = [
    ("2x128 600MiB", ["--layers", "2", "--hidden", "128", "--heads", "2", "--ffn", "384", "--ctx", "256",
                      "--budget", "600MiB"]),
    ("4x256 600MiB", ["--layers", "4", "--hidden", "256", "--heads", "4", "--ffn", "768", "--ctx", "256",
                      "--budget", "600MiB"]),
    ("4x256 1GiB ctx512", ["--layers", "4", "--hidden", "256", "--heads", "4", "--ffn", "768", "--ctx", "512",
                           "--budget", "1GiB"]),
    ("6x384 800MiB", ["--layers", "6", "--hidden", "384", "--heads", "6", "--ffn", "1024", "--ctx", "256",
                      "--budget", "800MiB"]),
    ("8x512 1GiB", ["--layers", "8", "--hidden", "512", "--heads", "8", "--ffn", "1536", "--ctx", "256",
                    "--budget", "1GiB", "--global-batch-tokens", "8192"]),
]


# --calibrate: the quick start's calibration of this machine (trainer.request.local_calibration), cached; one line
CALIBRATE = """
import memplan.cli
from memplan.hardware import device_from_flags
from trainer.train_run import TrainUI, local_calibration

profile, note = local_calibration(device_from_flags(None, None), TrainUI(), measure_now=True)
mib = lambda b: "default" if b is None else f"{b / 2**20:.1f} MiB"
print(f"{note}; runtime context {profile.runtime_context_bytes / 2**20:.1f} MiB, transformers' code "
      f"{mib(profile.transformers_code_bytes)}, peft's {mib(profile.peft_code_bytes)}")
"""


def memplan(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memplan", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT)


def run_figures(run: Path) -> dict:
    """The predicted and measured peak and tokens/s of a training run, as its summary prints them."""
    from trainer.rundir import read_metrics

    lines = read_metrics(run)
    start = next(line for line in lines if line.get("event") == "start")
    train = [line for line in lines if line.get("kind") == "train"]
    steady = train[1:] or train
    return {"predicted_peak": start["predicted"]["peak_reserved"],
            "measured_peak": max(line["memory_bytes"] for line in steady if line.get("memory_bytes")),
            "baseline": start.get("baseline_memory_bytes"),
            "predicted_tps": start["predicted"]["tokens_per_second"],
            "measured_tps": statistics.median(line["tokens_per_second"] for line in steady),
            # a "cpu" prediction (the load too unsteady for wall time) is of tokens per second of CPU time
            "predicted_clock": start["predicted"].get("clock", "wall"),
            "measured_cpu_tps": statistics.median(line["tokens_per_second"] * line["step_seconds"] / line["cpu_seconds"]
                                                  for line in steady) if all(line.get("cpu_seconds") for line in steady)
            else None,
            "steps": len(train)}


def env_for(cache: Path) -> dict:
    return {**os.environ, "MEMPLAN_CACHE": str(cache),
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", help="memplan cache directory (default: a fresh temporary one)")
    ap.add_argument("--keep", help="write the runs here (default: a temporary directory)")
    ap.add_argument("--quick-minutes", type=float,
                    help="stop the quick start after this many minutes (default: its own three)")
    ap.add_argument("--families-only", action="store_true",
                    help="only the run per family (the embedded corpus prepared first, no quick start)")
    ap.add_argument("--compiled-only", action="store_true",
                    help="only the torch.compile'd `train` configs (COMPILED; the embedded corpus prepared first)")
    ap.add_argument("--calibrate", action="store_true",
                    help="with --families-only: calibrate this machine into the cache first, as the quick start does")
    ap.add_argument("--family", action="append", metavar="NAME",
                    help="only this family's run (repeatable; the names of FAMILIES, e.g. qwen3, 'llama rope llama3')")
    args = ap.parse_args()
    if args.family and not set(args.family) <= set(family_configs()):
        ap.error(f"--family: {', '.join(sorted(set(args.family) - set(family_configs())))} is not one of "
                 f"{', '.join(family_configs())}")
    if args.calibrate and not (args.families_only or args.compiled_only):
        ap.error("--calibrate goes with --families-only or --compiled-only (the quick start calibrates a fresh cache "
                 "itself)")
    cache = Path(args.cache or tempfile.mkdtemp(prefix="memplan-cache-"))
    runs = Path(args.keep or tempfile.mkdtemp(prefix="memplan-runs-"))
    env = env_for(cache)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; cache {cache}", flush=True)
    rows = []
    if args.compiled_only and (args.families_only or args.family):
        ap.error("--compiled-only runs the compiled configs alone (not with --families-only or --family)")
    if args.families_only or args.compiled_only:
        prepared = subprocess.run([sys.executable, "-c", "from trainer.train_run import ensure_embedded_data; "
                                   "ensure_embedded_data()"], capture_output=True, text=True, env=env, cwd=ROOT)
        if prepared.returncode != 0:
            sys.exit(f"preparing the embedded corpus failed: {prepared.stderr.strip()[-800:]}")
        if args.calibrate:  # from a process that loaded memplan's command line, as `memplan train`'s has
            measured = subprocess.run([sys.executable, "-c", CALIBRATE], capture_output=True, text=True, env=env,
                                      cwd=ROOT)
            if measured.returncode != 0:
                sys.exit(f"calibrating this machine failed: {measured.stderr.strip()[-800:]}")
            print(measured.stdout.strip(), flush=True)
    else:
        limit = ["--max-minutes", f"{args.quick_minutes:g}"] if args.quick_minutes else []
        quick = memplan("train", "--out", str(runs / "quickstart"), *limit, env=env)
        if quick.returncode != 0:
            sys.exit(f"the quick start failed: {quick.stderr.strip()[-800:]}")
        rates = next((ln.strip() for ln in quick.stderr.splitlines() if "rates:" in ln), "")
        print(rates, flush=True)
        rows.append(("train", "quick start", run_figures(runs / "quickstart")))
    data = next((cache / "data").iterdir())
    for name, (config, extra) in ({} if args.compiled_only else family_configs()).items():
        if args.family and name not in args.family:
            continue
        out = runs / ("family_" + name.replace(" ", "_"))
        path = out.parent / f"{out.name}.config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        config.to_json_file(str(path))
        r = memplan("train", "--data", str(data), "--out", str(out), "--model", str(path),
                    *FAMILY_SETUP, *extra, "--precision", "fp32", "--max-steps", str(FAMILY_STEPS),
                    "--eval-batches", "1", "--sample-tokens", "0", env=env)
        if r.returncode != 0:
            sys.exit(f"family {name}: {r.stderr.strip()[-800:]}")
        rows.append(("family", name, run_figures(out)))
    for name, flags in (COMPILED if args.compiled_only else [] if args.families_only else TRAIN):
        out = runs / name.replace(" ", "_")
        limit = ["--max-steps", str(COMPILED_STEPS)] if args.compiled_only else ["--max-minutes", f"{TRAIN_MINUTES:g}"]
        # a compiled run with an empty inductor cache of its own: its first compile generates the code, as the
        # plan's compiled_code term counts it (a cached graph only loads it: about 12 MiB less resident)
        run_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(out) + ".inductor"} if args.compiled_only else env
        r = memplan("train", "--data", str(data), "--out", str(out), *flags, *limit, "--sample-tokens", "0",
                    env=run_env)
        if r.returncode != 0:
            sys.exit(f"{name}: {r.stderr.strip()[-800:]}")
        rows.append(("train", name, run_figures(out)))
    for name, flags in ([] if args.families_only or args.compiled_only else VERIFY):
        r = memplan("autotune", *flags, "--vocab", "4096", "--verify", "--json", env=env)
        if r.returncode != 0:
            sys.exit(f"{name}: {r.stderr.strip()[-800:]}")
        verified = json.loads(r.stdout)["verified"]
        final = next(a for a in reversed(verified["attempts"]) if a["measured_peak"])
        rows.append(("verify", name, {"predicted_peak": final["predicted_peak"], "measured_peak": final["measured_peak"],
                                      "predicted_tps": final["predicted_tokens_per_second"],
                                      "measured_tps": final["measured_tokens_per_second"]}))
    print(f"\n{'':7}{'config':28}{'predicted':>12}{'measured':>12}{'error':>9}   tokens/s pred/meas")
    worst = {"planned": 0.0, "given": 0.0}  # the quick start's and verify's plans; train's given setups
    for kind, name, f in rows:
        err = (f["predicted_peak"] - f["measured_peak"]) / f["measured_peak"]
        group = "given" if kind in ("train", "family") and name != "quick start" else "planned"
        worst[group] = max(worst[group], abs(err))
        print(f"{kind:7}{name:28}{f['predicted_peak'] / 2**20:>9.1f} MiB{f['measured_peak'] / 2**20:>8.1f} MiB"
              f"{err:>+9.1%}   {f['predicted_tps'] / f['measured_tps']:.2f}")
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    groups = {("given" if kind in ("train", "family") and name != "quick start" else "planned") for kind, name, _ in rows}
    return judge([bar for group, bar in (
        ("planned", Bar("the quick start and autotune --verify: worst |error|", worst["planned"], BAR)),
        ("given", Bar("train with a given model and setup (and one run per family): worst |error|", worst["given"],
                      BAR))) if group in groups])


if __name__ == "__main__":
    sys.exit(main())

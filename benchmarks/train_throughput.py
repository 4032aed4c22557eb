"""Training throughput of memplan's trainer: its bookkeeping over the bare step, and its default plan against a
plain Hugging Face transformers loop, eager and under ``torch.compile``, at three model sizes, interleaved in one
process.

For each size (``--sizes``, default ``1m,12m,50m``: Llama shapes of 0.95M, 12.2M and 52.2M parameters on the
embedded corpus's 4096-token vocabulary, tied embeddings, micro-batch 8 × ctx 256, fp32, SDPA) four loops train
the same model on the same seeded TrainStream batches:

- ``bare``: ``trainer.step.train_step`` in a loop (the step ``memplan train`` runs, and ``float(loss)``), on
  memplan's default plan for the config;
- ``trainer``: ``trainer.loop.Trainer.advance()`` on the same plan, the whole loop iteration ``memplan train``
  runs (learning-rate schedule, data, the step, the memory reading, the metrics line written to
  metrics.jsonl), with the live progress line of ``memplan train`` attached (``_ProgressView`` on a terminal
  console written to /dev/null, its refresh thread running as it does for a user);
- ``transformers``: ``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` (random weights, nothing downloaded,
  ``use_cache=False``, SDPA) in the plain loop a transformers user writes: forward, ``labels=`` loss, backward,
  ``clip_grad_norm_(1.0)``, torch AdamW (its default implementation), ``zero_grad``;
- ``transformers_compiled``: the same model, weights and loop with ``model = torch.compile(model)`` as a
  transformers user writes it (default mode, inductor): the model's forward, its ``labels=`` loss included, and
  through AOTAutograd its backward are compiled; gradient clipping, AdamW and ``zero_grad`` run eager, as they do
  in memplan's compiled step (which compiles the model to its logits, its fp32 loss eager).

memplan's default plan is the one ``memplan autotune`` picks for the config (``--device``'s profile, fp32, the
global batch of the other two): with a ``memplan calibrate --compile`` profile it compiles the step where the
calibrated speedup pays back its compile time over the run, and takes fused AdamW where calibration timed it
faster. Each loop's first ``--warmup`` steps are not timed (torch.compile compiles in the first; its time is
reported as the one-off it is, for memplan's step and for transformers' compiled one alike). Then ``--rounds``
rounds of ``--steps`` steps per loop, the order of the four rotating every round, so load from other processes on a shared machine falls on all alike. Figures are medians
and ratios within this one run: the trainer's overhead is the median over rounds of (trainer ÷ bare step time) −
1, and, measured directly without the step's noise, the median time ``advance()`` spends outside its timed step
over the median step. Each step is timed by wall clock and by this process's CPU time (which also counts the
live line's refresh thread); with ``--threads 1`` the CPU-time ratio is the steadier one on a shared machine.

MFU is model FLOPs (memplan.timing.model_flops: 6·N·T plus attention) per second over the calibrated fp32
matmul peak of ``--device`` (a calibrated profile), else over the rate of a square fp32 matmul timed between the
rounds (what this core achieves now). The closing account splits the gap between memplan's step and its model
FLOPs at that peak term by term, from memplan's own step-time breakdown (``memplan.timing.step_time``) scaled to
the measured step.

    PYTHONPATH=$PWD python benchmarks/train_throughput.py [--sizes 1m,12m,50m] [--rounds 5] [--steps 3]
        [--threads N] [--device CAL.toml] [--optimizer O] [--compile yes|no] [--micro-batch M] [--json]

Goals: the trainer's overhead under 1% of the bare step at 12m; memplan's default plan ≥ 1.1× transformers'
tokens/s at every size (1.2× hoped for), against the compiled transformers loop as well. On CUDA and ROCm the same script runs unchanged (it syncs the device
before reading the clock); it prints nanoGPT's published GPT-2 124M figure beside it only where the device is
the one that figure was measured on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memplan.hardware import load_profile  # noqa: E402
from memplan.model import ModelSpec  # noqa: E402
from memplan.plan import Plan  # noqa: E402
from memplan.setup import TrainSetup  # noqa: E402
from memplan.timing import model_flops, step_time  # noqa: E402
from trainer.data import PreparedData, TrainStream  # noqa: E402
from trainer.loop import TrainConfig, Trainer  # noqa: E402
from trainer.step import param_groups, train_step  # noqa: E402

MATMUL_SIDE = 1024
LOOPS = ("bare", "trainer", "transformers", "transformers_compiled")
SIZES = {  # name -> (layers, hidden, heads, ffn): Llama shapes at vocab 4096, tied
    "1m": (2, 128, 4, 384),
    "12m": (6, 384, 6, 1024),
    "50m": (10, 640, 10, 1728),
}
LR = 6e-4
# nanoGPT's README: GPT-2 124M, 8×A100 40GB, ~135 ms per iteration of ~0.5M tokens ("about 4 days" for 600K
# iterations, 300B tokens): ~3.9M tokens/s over 8 GPUs, 0.49M per A100 (bf16, torch.compile, flash attention).
NANOGPT_124M = {"device_match": "A100", "tokens_per_second_per_gpu": 491_520 / 0.135 / 8,
                "source": "karpathy/nanoGPT README (GPT-2 124M on 8×A100 40GB, ~135 ms/iter at 491,520 tokens)"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_model(spec: ModelSpec, ctx: int, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
                      num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                      num_key_value_heads=spec.kv_heads, max_position_embeddings=max(ctx, spec.max_positions),
                      rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta, tie_word_embeddings=spec.tied,
                      attention_dropout=0.0, use_cache=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(device)
    model.train()
    return model


class HFLoop:
    """The plain PyTorch loop a transformers user writes (``labels=``: transformers' own shifted loss); with
    ``compiled``, stepping ``torch.compile(model)`` (``self.step_model``), the rest of the loop unchanged."""

    def __init__(self, spec: ModelSpec, setup: TrainSetup, data: PreparedData, seed: int, device,
                 optimizer: str = "default", compiled: bool = False):
        torch.manual_seed(seed)
        self.device = device
        self.model = hf_model(spec, setup.ctx, device)
        self.step_model = torch.compile(self.model) if compiled else self.model
        impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[optimizer]
        self.optimizer = torch.optim.AdamW(param_groups(self.model, 0.1), lr=LR, betas=(0.9, 0.95), **impl)
        self.stream = TrainStream(data, batch=setup.micro_batch * setup.grad_accum, ctx=setup.ctx, seed=seed)

    def step(self) -> float:
        x, y = (t.to(self.device) for t in next(self.stream))
        # labels= with the targets already shifted (shift_labels=): transformers' own loss over the same ctx
        # predictions as memplan's step (labels=x alone would shift them and drop the last)
        loss = self.step_model(input_ids=x, labels=y, shift_labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)


class BareLoop:
    """``train_step`` in a loop on the plan's setup: the floor the trainer's loop adds to. It steps the trainer's
    own model (compiled as the trainer compiled it) and optimizer, so that the two differ in nothing but the
    loop around the step: separate copies of the weights in other memory can differ by a few percent in speed
    (their placement), which would be counted as the loop's."""

    def __init__(self, trainer: Trainer, data: PreparedData, seed: int, device):
        s = trainer.setup
        self.setup, self.device = s, device
        self.model, self.step_model, self.optimizer = trainer.model, trainer.step_model, trainer.optimizer
        self.stream = TrainStream(data, batch=s.micro_batch, ctx=s.ctx, seed=seed + 1)
        self.data_seconds: list[float] = []  # reading each step's batches (the trainer's loop reads them too)

    def step(self) -> float:
        t0 = time.perf_counter()
        batches = [tuple(t.to(self.device) for t in next(self.stream)) for _ in range(self.setup.grad_accum)]
        self.data_seconds.append(time.perf_counter() - t0)
        return float(train_step(self.step_model, self.optimizer, batches, self.setup, self.device.type).loss)


class TrainerLoop:
    """``Trainer.advance()`` with the live line attached; keeps how long each call spent outside its step."""

    def __init__(self, run_dir: Path, plan: Plan, data: PreparedData, seed: int, profile, device):
        from rich.console import Console

        from memplan.cli.train import _ProgressView

        self.trainer = Trainer.start(run_dir, plan, data,
                                     TrainConfig(max_steps=10**9, eval_every=10**9, save_every=10**9, sample_tokens=0,
                                                 verify_data=False, lr=LR, warmup_steps=0, seed=seed), profile,
                                     device=device)
        self._null = open(os.devnull, "w")
        self.view = _ProgressView(Console(file=self._null, force_terminal=True, width=120, stderr=True), self.trainer)
        self.trainer.on_event(self.view.update)
        self.view.__enter__()
        self.trainer.open()
        self.outside: list[float] = []  # seconds of each advance() spent outside its timed step
        self.lines: list[dict] = []

    def step(self) -> float:
        t0 = time.perf_counter()
        line = self.trainer.advance()
        self.outside.append(time.perf_counter() - t0 - line.step_seconds)
        self.lines.append(line)
        return line.loss

    def close(self) -> None:
        self.view.__exit__(None, None, None)
        self.trainer.close()
        self._null.close()


def matmul_seconds(device: torch.device, reps: int = 3) -> float:
    """Seconds of one square fp32 matmul (the fastest of ``reps``), timed between the rounds: by CPU time on a
    CPU, by the wall clock around a device sync on a GPU (where it is 4× larger, to be worth timing)."""
    side = MATMUL_SIDE * (4 if device.type == "cuda" else 1)
    a = torch.randn(side, side, device=device)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    best = math.inf
    for _ in range(reps + 1):
        _sync(device)
        c0 = clock()
        a @ a
        _sync(device)
        best = min(best, clock() - c0)
    return best * (MATMUL_SIDE / side) ** 3


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def default_plan(spec: ModelSpec, ctx: int, batch: int, profile, overrides: dict,
                 run_tokens: int | None) -> tuple[Plan, list[str]]:
    """memplan's default plan: what autotune picks for this config (fp32, the benchmark's global batch; the run's
    tokens, if given, to weigh compile time against), with ``overrides`` (--optimizer, --compile) applied on top
    for ablations; and autotune's notes on compile."""
    from memplan.autotune import autotune

    result = autotune(spec, profile, ctx=ctx, global_batch=batch, precision="fp32", tokens=run_tokens)
    if result.plan is None:
        raise SystemExit(f"nothing fits {profile.name} for {spec.describe()}: {'; '.join(result.advice)}")
    plan = result.plan
    if overrides:
        plan = Plan(model=plan.model, setup=plan.setup.replace(**overrides), device=plan.device,
                    budget_bytes=plan.budget_bytes, predicted={})
    return plan, [n for n in result.notes if "compile" in n]


def gap_account(spec: ModelSpec, setup: TrainSetup, profile, measured_seconds: float, peak: float,
                clock: str = "wall") -> dict:
    """Where memplan's measured step goes beyond its model FLOPs at ``peak``, term by term.

    memplan.timing's breakdown of this step on ``profile`` (a compiled step as it models it from the calibrated
    reference) is scaled to the measured step, so the terms add up to it: the model's error is spread over them
    in proportion. A step measured by CPU time leaves out the time other processes held the core, so the
    ``contention`` term is left out too. Each term's useful part is its FLOPs at the peak (only the matmul and
    attention terms have any); the rest of it is that term's share of the gap."""
    t = step_time(spec, setup, profile)
    terms = {n: term for n, term in t.terms.items() if term.seconds > 0 and not (n == "contention" and clock == "cpu")}
    predicted = sum(term.seconds for term in terms.values())
    scale = measured_seconds / predicted
    ideal = model_flops(spec, setup) / peak
    rows = {}
    for name, term in terms.items():
        seconds = term.seconds * scale
        useful = term.flops / peak if name in ("forward", "backward", "attention") else 0.0
        rows[name] = {"seconds": seconds, "share_of_step": seconds / measured_seconds,
                      "gap_seconds": max(0.0, seconds - useful), "gap_share": max(0.0, seconds - useful) / measured_seconds,
                      "bound": term.bound}
    # the useful parts count the FLOPs the kernels do (causal attention's half, its backward's 2.5×); MFU counts
    # PaLM's model FLOPs: the difference closes the account, so the rows add up to 1 − MFU
    useful = sum(row["seconds"] - row["gap_seconds"] for row in rows.values())
    rows["flop convention"] = {"seconds": 0.0, "share_of_step": 0.0, "gap_seconds": useful - ideal,
                               "gap_share": (useful - ideal) / measured_seconds, "bound": "none"}
    note = "memplan.timing's terms" + (" (compiled, as modelled from the calibrated reference)" if t.compile_seconds
                                       else "") + ", scaled to the measured step" + \
        (", contention left out (CPU time)" if clock == "cpu" else "")
    return {"predicted_step_seconds": predicted, "scale": scale, "ideal_seconds": ideal,
            "mfu": ideal / measured_seconds, "terms": rows, "note": note}


def timed_rounds(runners: dict, rounds: int, steps: int, device) -> tuple[dict, dict, list]:
    """Wall and CPU seconds of each step, per loop; the order of the loops rotates every round."""
    times = {k: [] for k in runners}
    cpu = {k: [] for k in runners}
    mm = []
    names = list(runners)
    for r in range(rounds):
        mm.append(matmul_seconds(device))
        order = names[r % len(names):] + names[:r % len(names)]
        if (r // len(names)) % 2:
            order.reverse()
        for name in order:
            for _ in range(steps):
                _sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                runners[name]()
                _sync(device)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    return times, cpu, mm


def per_round(values: list[float], steps: int) -> list[float]:
    return [statistics.median(values[i:i + steps]) for i in range(0, len(values), steps)]


def run_size(name: str, shape: tuple, data: PreparedData, args, profile, device) -> dict:
    layers, hidden, heads, ffn = shape
    spec = ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=ffn,
                     vocab=data.vocab_size, tied=True)
    overrides = {k: v for k, v in (("optimizer", args.optimizer), ("compile", args.compile)) if v is not None}
    if args.micro_batch:
        overrides.update(micro_batch=args.micro_batch, grad_accum=args.batch // args.micro_batch)
    run_tokens = args.run_steps * args.batch * args.ctx if args.run_steps else None
    plan, notes = default_plan(spec, args.ctx, args.batch, profile, overrides, run_tokens)
    setup = plan.setup
    seed = args.seed
    with tempfile.TemporaryDirectory() as tmp:
        loops = {}
        first_seconds = {}
        t0 = time.perf_counter()
        loops["trainer"] = TrainerLoop(Path(tmp) / "run", plan, data, seed, profile, device)
        loops["bare"] = BareLoop(loops["trainer"].trainer, data, seed, device)
        loops["transformers"] = HFLoop(spec, setup, data, seed, device, args.hf_optimizer)
        loops["transformers_compiled"] = HFLoop(spec, setup, data, seed, device, args.hf_optimizer, compiled=True)
        n = {k: sum(p.numel() for p in (v.trainer.model if k == "trainer" else v.model).parameters())
             for k, v in loops.items()}
        assert len(set(n.values())) == 1 and n["bare"] == spec.params, (n, spec.params)
        first_loss = {}
        for k in ("trainer", "bare", "transformers", "transformers_compiled"):  # warm-up, not timed: compiles
            loop = loops[k]
            for i in range(args.warmup):
                _sync(device)
                t0 = time.perf_counter()
                loss = loop.step()
                _sync(device)
                if i == 0:
                    first_seconds[k], first_loss[k] = time.perf_counter() - t0, loss
        runners = {k: v.step for k, v in loops.items()}
        load_before = load_average()
        times, cpu, mm = timed_rounds(runners, args.rounds, args.steps, device)
        load_after = load_average()
        trainer = loops["trainer"]
        outside = list(trainer.outside[args.warmup:])
        bare_data = statistics.median(loops["bare"].data_seconds[args.warmup:])
        lines = trainer.lines[args.warmup:]
        trainer.close()

    tokens = setup.tokens_per_step
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    rounds = {k: per_round(v, args.steps) for k, v in times.items()}
    cpu_rounds = {k: per_round(v, args.steps) for k, v in cpu.items()}
    overhead_rounds = [t / b - 1 for t, b in zip(rounds["trainer"], rounds["bare"])]
    cpu_overhead_rounds = [t / b - 1 for t, b in zip(cpu_rounds["trainer"], cpu_rounds["bare"])]
    speed_rounds = [h / t for h, t in zip(rounds["transformers"], rounds["trainer"])]
    cpu_speed_rounds = [h / t for h, t in zip(cpu_rounds["transformers"], cpu_rounds["trainer"])]
    cspeed_rounds = [h / t for h, t in zip(rounds["transformers_compiled"], rounds["trainer"])]
    cpu_cspeed_rounds = [h / t for h, t in zip(cpu_rounds["transformers_compiled"], cpu_rounds["trainer"])]
    step_in_trainer = statistics.median(line.step_seconds for line in lines)
    flops = model_flops(spec, setup)
    cal_rate = profile.calibrated.get("matmul_tflops", {}).get("fp32", 0) * 1e12
    mm_rate = 2 * MATMUL_SIDE**3 / statistics.median(mm)
    peak, peak_source = (cal_rate, f"{profile.name}: calibrated fp32 matmul peak") if cal_rate else \
        (mm_rate, f"a square fp32 matmul timed between the rounds ({'wall clock' if device.type == 'cuda' else 'CPU time'})")
    clock = profile.calibrated.get("clock", "wall") if cal_rate else ("wall" if device.type == "cuda" else "cpu")
    measured = cpu_med if clock == "cpu" else med
    compile_one_off = first_seconds["trainer"] - med["trainer"] if setup.compile else 0.0
    return {
        "size": name,
        "model": {**spec.to_json(), "describe": spec.describe()},
        "plan": {**setup.to_json(), "compile": setup.compile},
        "plan_source": "autotune (fp32, this global batch)" + (f", overridden: {overrides}" if overrides else ""),
        "transformers_optimizer": f"torch AdamW ({args.hf_optimizer})",
        "steps_timed": {k: len(v) for k, v in times.items()},
        "first_loss": first_loss,
        "first_step_seconds": first_seconds,
        "compile_seconds_measured": compile_one_off if setup.compile else None,
        "compile_seconds_measured_transformers": first_seconds["transformers_compiled"]
        - med["transformers_compiled"],
        "transformers_compiled": "torch.compile(model) (default mode, inductor): forward with its labels= loss, "
                                 "and its backward; clipping, AdamW and zero_grad eager",
        "load_average": {"before": load_before, "after": load_after},
        "median_step_seconds": med,
        "median_step_cpu_seconds": cpu_med,
        "tokens_per_second": {k: tokens / v for k, v in med.items()},
        "tokens_per_cpu_second": {k: tokens / v for k, v in cpu_med.items()},
        "trainer_overhead": statistics.median(overhead_rounds),
        "trainer_overhead_cpu": statistics.median(cpu_overhead_rounds),
        "trainer_overhead_rounds": overhead_rounds,
        "outside_step_seconds": statistics.median(outside),
        "bare_data_seconds": bare_data,
        "bookkeeping_seconds": statistics.median(outside) - bare_data,
        "bookkeeping_share": (statistics.median(outside) - bare_data) / step_in_trainer,
        "speedup_vs_transformers": statistics.median(speed_rounds),
        "speedup_vs_transformers_cpu": statistics.median(cpu_speed_rounds),
        "speedup_rounds": speed_rounds,
        "speedup_rounds_cpu": cpu_speed_rounds,
        "speedup_vs_transformers_compiled": statistics.median(cspeed_rounds),
        "speedup_vs_transformers_compiled_cpu": statistics.median(cpu_cspeed_rounds),
        "speedup_rounds_compiled": cspeed_rounds,
        "speedup_rounds_compiled_cpu": cpu_cspeed_rounds,
        "trainer_overhead_rounds_cpu": cpu_overhead_rounds,
        "model_flops_per_step": flops,
        "peak_flops": peak, "peak_source": peak_source, "peak_clock": clock,
        "matmul_flops_per_cpu_second_measured": mm_rate,
        "mfu": {k: flops / v / peak for k, v in measured.items()},
        "gap": gap_account(spec, setup, profile, measured["trainer"], peak, clock),
        "run_steps_for_plan": args.run_steps,
        "autotune_notes": notes,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1m,12m,50m", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per loop per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per loop first (compile happens here)")
    p.add_argument("--run-steps", type=int, default=None,
                   help="a run length for autotune to weigh compile time against (default: none, as `memplan train` "
                        "plans: the fastest step, with a note of the steps compiling takes to pay back)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--data", default=None, help="a prepared corpus (default: the embedded one, from the cache)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu",
                   help="the profile autotune plans with and MFU is measured against (a `memplan calibrate` "
                        "profile for the calibrated matmul peak and the compile/fused choices; calibrate with the "
                        "same --threads)")
    p.add_argument("--optimizer", default=None, help="override the plan's optimizer (an ablation)")
    p.add_argument("--compile", default=None, choices=("yes", "no"), help="override the plan's compile (an ablation)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="override the plan's micro-batch, accumulating to --batch (an ablation; a divisor of --batch)")
    p.add_argument("--hf-optimizer", default="default", choices=("default", "foreach", "fused"),
                   help="transformers' loop's AdamW: torch's default implementation (single-tensor on a CPU, what a "
                        "plain loop gets), or foreach / fused (a stronger baseline)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.compile = None if args.compile is None else args.compile == "yes"
    if args.micro_batch is not None and (args.micro_batch < 1 or args.batch % args.micro_batch):
        print(f"--micro-batch: {args.micro_batch} does not divide --batch {args.batch} "
              f"(accepted: {', '.join(str(d) for d in range(1, args.batch + 1) if args.batch % d == 0)})", file=sys.stderr)
        raise SystemExit(2)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown {', '.join(unknown)} (accepted: {', '.join(SIZES)})")
    if args.data:
        data_dir = Path(args.data)
    else:
        from rich.console import Console

        from memplan.cli.train import RichUI
        from trainer.train_run import ensure_embedded_data

        data_dir = ensure_embedded_data(RichUI(Console(stderr=True)))
    data = PreparedData(data_dir)
    profile = load_profile(args.device)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    started = time.time()
    results = [run_size(s, SIZES[s], data, args, profile, device) for s in sizes]
    out = {"command": "python benchmarks/train_throughput.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "device": str(device),
           "device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else platform_name(),
           "profile": args.device, "uptime": uptime(), "seconds": time.time() - started, "sizes": results}
    if device.type == "cuda" and NANOGPT_124M["device_match"] in out["device_name"]:
        out["nanogpt_124m"] = NANOGPT_124M
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print(out)
    return out


def platform_name() -> str:
    import platform

    return platform.processor() or platform.machine()


def uptime() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    return None


def _print(out: dict) -> None:
    print(f"{out['command']}\ntorch {out['torch']}, {out['threads']} thread(s), {out['device']} ({out['device_name']}), "
          f"profile {out['profile']}; uptime at the end: {out['uptime']}")
    for r in out["sizes"]:
        s = r["plan"]
        print(f"\n== {r['size']}: {r['model']['describe']}")
        print(f"   plan ({r['plan_source']}): micro-batch {s['micro_batch']} × {s['grad_accum']}, {s['precision']}, "
              f"{s['attention']}, {s['optimizer']}, checkpointing {s['checkpointing']}"
              + (", torch.compile" if s["compile"] else ", eager"))
        print(f"   load average before/after the timed rounds: {r['load_average']['before']} / "
              f"{r['load_average']['after']}; {r['steps_timed']['bare']} steps per loop, interleaved")
        t, m = r["tokens_per_second"], r["mfu"]
        for note in r["autotune_notes"]:
            print(f"   autotune: {note}")
        print(f"   transformers: LlamaForCausalLM, labels= loss, {r['transformers_optimizer']}, clip 1.0; "
              f"compiled: {r['transformers_compiled']}")
        cols = (("bare", 12), ("trainer", 12), ("transformers", 14), ("transformers_compiled", 12))
        print(f"   {'':13}{'bare':>12}{'trainer':>12}{'transformers':>14}{'compiled':>12}")
        c = r["tokens_per_cpu_second"]
        print(f"   {'tokens/s':13}" + "".join(f"{t[k]:>{w},.0f}" for k, w in cols) + "   (wall clock)")
        print(f"   {'tokens/cpu-s':13}" + "".join(f"{c[k]:>{w},.0f}" for k, w in cols)
              + "   (this process's CPU time: the steady figure with one thread on a shared machine)")
        print(f"   {'MFU':13}" + "".join(f"{m[k]:>{w}.1%}" for k, w in cols)
              + f"   of {r['peak_flops'] / 1e9:,.1f} GFLOP/s ({r['peak_source']})")
        print(f"   {'first step':13}" + "".join(f"{r['first_step_seconds'][k]:>{w}.2f}" for k, w in cols) + " s"
              + "   (compile one-off ≈ " + (f"{r['compile_seconds_measured']:.1f} s memplan, " if r["plan"]["compile"]
                                            else "")
              + f"{r['compile_seconds_measured_transformers']:.1f} s transformers)")
        print(f"   trainer overhead over the bare step: {r['trainer_overhead']:+.2%} wall, "
              f"{r['trainer_overhead_cpu']:+.2%} CPU time (median of per-round ratios; rounds, wall: "
              + ", ".join(f"{x:+.1%}" for x in r["trainer_overhead_rounds"]) + "; CPU: "
              + ", ".join(f"{x:+.1%}" for x in r["trainer_overhead_rounds_cpu"]) + ")")
        print(f"   bookkeeping measured directly: {r['outside_step_seconds'] * 1e3:.2f} ms per advance() outside its "
              f"step, less the {r['bare_data_seconds'] * 1e3:.2f} ms the bare loop also spends reading its batch = "
              f"{r['bookkeeping_seconds'] * 1e3:.2f} ms, {r['bookkeeping_share']:.2%} of the step (goal < 1%)")
        print(f"   memplan's plan vs transformers: {r['speedup_vs_transformers']:.3f}× wall, "
              f"{r['speedup_vs_transformers_cpu']:.3f}× CPU time (goal ≥ 1.1×; rounds, wall: "
              + ", ".join(f"{x:.3f}" for x in r["speedup_rounds"]) + "; CPU: "
              + ", ".join(f"{x:.3f}" for x in r["speedup_rounds_cpu"]) + ")")
        print(f"   memplan's plan vs compiled transformers: {r['speedup_vs_transformers_compiled']:.3f}× wall, "
              f"{r['speedup_vs_transformers_compiled_cpu']:.3f}× CPU time (goal ≥ 1.1×; rounds, wall: "
              + ", ".join(f"{x:.3f}" for x in r["speedup_rounds_compiled"]) + "; CPU: "
              + ", ".join(f"{x:.3f}" for x in r["speedup_rounds_compiled_cpu"]) + ")")
        g = r["gap"]
        print(f"   where the trainer's step goes (MFU {g['mfu']:.1%}; {g['note']}; predicted "
              f"{g['predicted_step_seconds']:.3f} s, measured ×{g['scale']:.2f}):")
        print(f"     model FLOPs at the peak: {g['ideal_seconds'] * 1e3:.1f} ms")
        for name, row in sorted(g["terms"].items(), key=lambda kv: -kv[1]["gap_seconds"]):
            print(f"     {name:15} {row['seconds'] * 1e3:9.1f} ms ({row['share_of_step']:5.1%} of the step, "
                  f"{row['bound']}), beyond its FLOPs at the peak: {row['gap_share']:5.1%}")
    if "nanogpt_124m" in out:
        n = out["nanogpt_124m"]
        print(f"\nnanoGPT GPT-2 124M on {n['device_match']}: {n['tokens_per_second_per_gpu']:,.0f} tokens/s per GPU "
              f"({n['source']})")


if __name__ == "__main__":
    main()

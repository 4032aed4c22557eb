"""Training throughput and memory of memplan's trainer against Hugging Face transformers, on this CPU.

The same Llama shape (default: 6 layers, hidden 384, 6 heads, SwiGLU 1024, tied embeddings, the
embedded corpus's 4096-token vocabulary: 12.2M parameters), the same data (the same seeded
TrainStream batches) and the same batch (micro-batch 8 × ctx 256, fp32, SDPA attention, AdamW
foreach with the same decay groups, clipping at 1.0) are trained

- by memplan's trainer: ``trainer.loop.Trainer.advance()``, the whole loop iteration ``memplan train``
  runs (learning-rate schedule, data, the step, the memory reading, the metrics line);
- by ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (random weights, nothing
  downloaded, ``use_cache=False``, SDPA) in a plain PyTorch loop: forward, fp32 cross-entropy,
  backward, clipping, ``optimizer.step()``, ``zero_grad``.

Both run in this one process, interleaved: ``--rounds`` rounds of ``--steps`` steps each, the
order alternating every round, so load from other processes on a shared machine falls on both
alike; tokens/s is from the median step time of each. Each step is timed twice: wall-clock, and
by the CPU time of this process (``time.process_time``). With one thread (``--threads 1``) the
CPU time does not count the time other processes hold the core, so its ratio is the steadier one
on a shared machine; with more threads it also counts threads spinning at barriers, and the
wall-clock ratio is the one to read. Peak memory is the live-tensor peak of a
steady-state step (MemTracker, as ``memplan validate`` measures it on the CPU) for each, beside
what memplan's memory model predicts for its own model. MFU is model FLOPs (memplan.timing's
6·N·T plus attention) per second over the CPU profile's nominal fp32 peak; over the rate of a
square fp32 matmul timed between the rounds by CPU time (what this core achieves now); and, with
``--device CAL.toml`` (a ``memplan calibrate`` profile), over its calibrated fp32 matmul peak, by
the clock it was calibrated with, beside memplan's step time predicted from that profile.

    PYTHONPATH=$PWD python benchmarks/train_throughput.py [--rounds 7] [--steps 3] [--threads N]
        [--device CAL.toml] [--json]

Targets: tokens/s ratio memplan ÷ transformers ≥ 1.0 and peak memory ratio ≤ 1.0. memplan's trainer runs the
same model as the reference library; it has no reason to be slower or to hold more memory, and a user who
trains with memplan should give up nothing against training with transformers.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memplan.hardware import load_profile  # noqa: E402
from memplan.memory import peak_memory  # noqa: E402
from memplan.model import ModelSpec  # noqa: E402
from memplan.plan import Plan  # noqa: E402
from memplan.setup import TrainSetup  # noqa: E402
from memplan.timing import model_flops  # noqa: E402
from trainer.data import PreparedData, TrainStream  # noqa: E402
from trainer.loop import TrainConfig, Trainer  # noqa: E402
from trainer.step import param_groups, train_step  # noqa: E402

MATMUL_SIDE = 1024


def hf_model(spec: ModelSpec, ctx: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
                      num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                      num_key_value_heads=spec.kv_heads, max_position_embeddings=max(ctx, spec.max_positions),
                      rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta, tie_word_embeddings=spec.tied,
                      attention_dropout=0.0, use_cache=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    model.train()
    return model


class HFLoop:
    """The plain PyTorch loop a transformers user writes."""

    def __init__(self, spec: ModelSpec, setup: TrainSetup, data: PreparedData, seed: int, lr: float):
        torch.manual_seed(seed)
        self.model = hf_model(spec, setup.ctx)
        self.optimizer = torch.optim.AdamW(param_groups(self.model, 0.1), lr=lr, betas=(0.9, 0.95), foreach=True)
        self.stream = TrainStream(data, batch=setup.micro_batch, ctx=setup.ctx, seed=seed)
        self.vocab = spec.vocab

    def loss(self, x, y):
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.float().view(-1, self.vocab), y.view(-1))

    def step(self) -> float:
        x, y = next(self.stream)
        loss = self.loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)


def live_tensor_peak(step_fn, model, optimizer) -> int:
    """The largest total of live tensor bytes over two steps (MemTracker), optimizer state already present."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for _ in range(2):
            tracker.reset_mod_stats()  # per-module stats cover one forward; the global peak is kept
            step_fn()
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return int(snapshot.get("Total", sum(snapshot.values())))


def matmul_seconds(reps: int = 3) -> float:
    """CPU seconds of one square fp32 matmul (the fastest of ``reps``), timed between the rounds so
    that it sees the same machine as the steps."""
    a = torch.randn(MATMUL_SIDE, MATMUL_SIDE)
    best = math.inf
    for _ in range(reps):
        c0 = time.process_time()
        a @ a
        best = min(best, time.process_time() - c0)
    return best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3, help="steps per framework per round")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--data", default=None, help="a prepared corpus (default: the embedded one, from the cache)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None,
                   help="a memplan calibrate profile: MFU against its calibrated fp32 matmul peak, and its step-time "
                        "prediction (calibrate with the same --threads)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.data:
        data_dir = Path(args.data)
    else:
        from rich.console import Console

        from memplan.cli.train import ensure_embedded_data

        data_dir = ensure_embedded_data(Console(stderr=True))
    data = PreparedData(data_dir)
    spec = ModelSpec(arch="llama", layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.heads,
                     ffn=args.ffn, vocab=data.vocab_size, tied=True)
    setup = TrainSetup(ctx=args.ctx, micro_batch=args.batch, precision="fp32", attention="sdpa")
    profile = load_profile("cpu")
    lr = 6e-4

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer.start(Path(tmp) / "run", Plan(model=spec, setup=setup, device="cpu"), data,
                                TrainConfig(max_steps=10**9, eval_every=10**9, save_every=10**9, sample_tokens=0,
                                            verify_data=False, lr=lr, warmup_steps=0, seed=args.seed), profile)
        trainer.open()
        hf = HFLoop(spec, setup, data, args.seed, lr)
        n_hf = sum(p.numel() for p in hf.model.parameters())
        assert n_hf == spec.params == sum(p.numel() for p in trainer.model.parameters()), (n_hf, spec.params)

        first = {"memplan": trainer.advance()["loss"], "transformers": hf.step()}  # warm-up, not timed
        times = {"memplan": [], "transformers": []}
        cpu_times = {"memplan": [], "transformers": []}
        runners = {"memplan": lambda: trainer.advance(), "transformers": hf.step}
        mm_seconds = []
        for r in range(args.rounds):
            mm_seconds.append(matmul_seconds())
            for name in (("memplan", "transformers") if r % 2 == 0 else ("transformers", "memplan")):
                for _ in range(args.steps):
                    t0, c0 = time.perf_counter(), time.process_time()
                    runners[name]()
                    times[name].append(time.perf_counter() - t0)
                    cpu_times[name].append(time.process_time() - c0)

        # memory: live-tensor peak of steady-state steps, the same tool for both
        batches = lambda: [next(trainer.stream) for _ in range(setup.grad_accum)]  # noqa: E731
        mp_peak = live_tensor_peak(lambda: train_step(trainer.model, trainer.optimizer, batches(), setup, "cpu",
                                                      check_finite=False), trainer.model, trainer.optimizer)
        hf_peak = live_tensor_peak(hf.step, hf.model, hf.optimizer)
        trainer.close()

    predicted = peak_memory(spec, setup).peak_allocated
    rate = 2 * MATMUL_SIDE**3 / statistics.median(mm_seconds)
    tokens = setup.tokens_per_step
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens / v for k, v in med.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_times.items()}
    cpu_tps = {k: tokens / v for k, v in cpu_med.items()}
    flops = model_flops(spec, setup)
    peak = profile.peak_tflops["fp32"] * 1e12
    result = {
        "model": {**spec.to_json(), "describe": spec.describe()},
        "setup": setup.to_json(),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "steps_timed": {k: len(v) for k, v in times.items()},
        "first_loss": first,
        "median_step_seconds": med,
        "tokens_per_second": tps,
        "tokens_per_second_ratio": tps["memplan"] / tps["transformers"],
        "median_step_cpu_seconds": cpu_med,
        "tokens_per_cpu_second": cpu_tps,
        "tokens_per_cpu_second_ratio": cpu_tps["memplan"] / cpu_tps["transformers"],
        "round_ratios": [statistics.median(times["transformers"][i * args.steps:(i + 1) * args.steps])
                         / statistics.median(times["memplan"][i * args.steps:(i + 1) * args.steps])
                         for i in range(args.rounds)],
        "peak_live_tensor_bytes": {"memplan": mp_peak, "transformers": hf_peak},
        "peak_memory_ratio": mp_peak / hf_peak,
        "memplan_predicted_peak_allocated": predicted,
        "memplan_prediction_error": (predicted - mp_peak) / mp_peak,
        "model_flops_per_step": flops,
        "mfu_vs_profile_peak": {k: flops / v / peak for k, v in med.items()},
        "profile_peak_flops": peak, "peak_source": "memplan/profiles/cpu.toml peak_tflops.fp32, nominal; --device CAL.toml "
                                                   "for the calibrated peak",
        "matmul_flops_per_cpu_second_measured": rate,
        "mfu_vs_measured_matmul": {k: flops / v / rate for k, v in cpu_med.items()},
    }
    if args.device:
        from memplan.timing import step_time

        cal = load_profile(args.device)
        measured = cpu_med if cal.calibrated.get("clock") == "cpu" else med
        cal_rate = cal.calibrated.get("matmul_tflops", {}).get("fp32", 0) * 1e12
        predicted_seconds = step_time(spec, setup, cal).step_seconds
        result["calibrated"] = {
            "profile": args.device, "clock": cal.calibrated.get("clock", "wall"),
            "threads": cal.calibrated.get("threads"), "matmul_fp32_flops": cal_rate,
            "mfu": {k: flops / v / cal_rate for k, v in measured.items()} if cal_rate else None,
            "predicted_step_seconds": predicted_seconds,
            "prediction_error": (predicted_seconds - measured["memplan"]) / measured["memplan"],
        }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return result


def _print(r: dict) -> None:
    from memplan.units import format_bytes

    print(f"model: {r['model']['describe']} ({r['model']['params']:,} parameters); ctx {r['setup']['ctx']}, "
          f"micro-batch {r['setup']['micro_batch']}, fp32, sdpa; torch {r['torch']}, {r['threads']} thread(s)")
    print(f"steps timed: {r['steps_timed']['memplan']} each, interleaved; first losses {r['first_loss']}")
    print(f"{'':14}{'memplan':>14}{'transformers':>14}{'ratio':>10}")
    t, m = r["tokens_per_second"], r["peak_live_tensor_bytes"]
    print(f"{'tokens/s':14}{t['memplan']:>14,.0f}{t['transformers']:>14,.0f}{r['tokens_per_second_ratio']:>10.3f}"
          "   (wall clock; memplan ÷ transformers, target ≥ 1.0)")
    c = r["tokens_per_cpu_second"]
    print(f"{'tokens/cpu-s':14}{c['memplan']:>14,.0f}{c['transformers']:>14,.0f}"
          f"{r['tokens_per_cpu_second_ratio']:>10.3f}   (process CPU time; the steady figure with 1 thread)")
    print(f"{'peak memory':14}{format_bytes(m['memplan']):>14}{format_bytes(m['transformers']):>14}"
          f"{r['peak_memory_ratio']:>10.3f}   (live tensors, MemTracker; target ≤ 1.0)")
    mfu, mfu2 = r["mfu_vs_profile_peak"], r["mfu_vs_measured_matmul"]
    print(f"{'MFU (profile)':14}{mfu['memplan']:>14.1%}{mfu['transformers']:>14.1%}"
          f"   of {r['profile_peak_flops'] / 1e9:,.0f} GFLOP/s ({r['peak_source']})")
    print(f"{'MFU (matmul)':14}{mfu2['memplan']:>14.1%}{mfu2['transformers']:>14.1%}"
          f"   of {r['matmul_flops_per_cpu_second_measured'] / 1e9:,.0f} GFLOP per CPU-second (a {MATMUL_SIDE}² fp32 "
          "matmul timed between rounds; both by CPU time)")
    if "calibrated" in r:
        c = r["calibrated"]
        if c["mfu"]:
            print(f"{'MFU (calib.)':14}{c['mfu']['memplan']:>14.1%}{c['mfu']['transformers']:>14.1%}"
                  f"   of {c['matmul_fp32_flops'] / 1e9:,.1f} GFLOP/s ({c['profile']}: calibrated fp32 matmul peak, "
                  f"{c['threads']} thread(s), clock {c['clock']})")
        print(f"memplan's step time from {c['profile']}: predicted {c['predicted_step_seconds']:.3f} s, "
              f"measured {r['median_step_seconds']['memplan'] if c['clock'] == 'wall' else r['median_step_cpu_seconds']['memplan']:.3f} s "
              f"({c['prediction_error']:+.1%})")
    print(f"per-round tokens/s ratios: {', '.join(f'{x:.3f}' for x in r['round_ratios'])}")
    print(f"memplan's memory model for its own step: predicted {format_bytes(r['memplan_predicted_peak_allocated'])}, "
          f"measured {format_bytes(m['memplan'])} ({r['memplan_prediction_error']:+.2%})")


if __name__ == "__main__":
    main()

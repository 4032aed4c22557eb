"""Decode speed of trainer/generate.py on this CPU against memplan's bandwidth roofline.

For each shape, a prompt is prefilled into a KV cache and ``--steps`` single-token decode steps
(``trainer.generate.forward_cached``, the step ``memplan generate`` runs, plus a greedy arg-max)
are timed; tokens/s is from the median step, by wall clock and by this process's CPU time
(steadier on a shared machine with ``--threads 1``). The roofline is
``memplan.inference.inference_time``: each step reads every weight and the KV cache, so
tokens/s ≤ batch × bandwidth / bytes per step. It is computed twice: with the CPU profile's
nominal bandwidth, and with the bandwidth this machine reaches now (a large fp32 ``sum`` timed
between the shapes: a read-only stream, like a decode step's weight reads). The ratio measured ÷
roofline says how close decoding gets to the memory bound (small models are dominated by Python
and per-op overhead instead). "predicted" adds that overhead, memplan.inference's dispatch term (aten
ops per decode step × the profile's per-op launch cost without autograd), to the roofline at the
measured bandwidth; "÷pred" is measured tokens/s over it. Also the measured prefill tokens/s against
the compute estimate.

    PYTHONPATH=$PWD python benchmarks/inference.py [--steps 32] [--threads N] [--json]

This benchmark reports; it has no bar (it says so on its last line) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memplan.hardware import load_profile  # noqa: E402
from memplan.inference import InferenceSetup, decode_bytes_per_step, inference_time  # noqa: E402
from memplan.model import ModelSpec, from_size  # noqa: E402
from trainer.generate import KVCache, forward_cached  # noqa: E402
from trainer.model import build_model  # noqa: E402

SHAPES = [
    ("12m-llama fp32", ModelSpec(arch="llama", layers=6, hidden=384, heads=6, kv_heads=6, ffn=1024, vocab=4096,
                                 tied=True), "fp32"),
    ("22m fp32", from_size("22m"), "fp32"),
    ("124m fp32", from_size("124m"), "fp32"),
    ("124m-gpt2 fp32", ModelSpec(arch="gpt2", layers=12, hidden=768, heads=12, kv_heads=12, ffn=3072, vocab=50257,
                                 tied=True), "fp32"),
]


def read_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes per second of ``x.sum()`` over a large fp32 tensor (median of ``repeats``)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def run_shape(name: str, spec: ModelSpec, dtype: str, prompt: int, ctx: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = build_model(spec, "sdpa", "none", getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])).eval()
    cache = KVCache(model, 1, ctx)
    ids = torch.randint(0, spec.vocab, (1, prompt))
    wall, cpu = [], []
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = forward_cached(model, ids, cache, 0)
        prefill_s = time.perf_counter() - t0
        for _ in range(steps):
            nxt = logits.argmax(-1)[:, None]
            w0, c0 = time.perf_counter(), time.process_time()
            logits = forward_cached(model, nxt, cache, cache.length)
            logits.argmax(-1)
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
    setup = InferenceSetup(ctx=prompt + steps, prompt=prompt, weights_dtype=dtype, sampling="greedy")
    return {"name": name, "params": spec.params, "weights_dtype": dtype, "prompt": prompt, "steps": steps,
            "decode_step_bytes": decode_bytes_per_step(spec, setup, prompt + steps // 2),
            "decode_tokens_per_second_wall": 1 / statistics.median(wall),
            "decode_tokens_per_second_cpu": 1 / statistics.median(cpu) if statistics.median(cpu) > 0 else None,
            "prefill_tokens_per_second": prompt / prefill_s, "setup": setup}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = load_profile("cpu")
    rows = []
    for name, spec, dtype in SHAPES:
        bandwidth = read_bandwidth()
        row = run_shape(name, spec, dtype, args.prompt, args.prompt + args.steps, args.steps)
        setup = row.pop("setup")
        nominal = inference_time(spec, setup, device)
        here = inference_time(spec, setup, device.replace(bandwidth_bytes_per_second=bandwidth))
        row.update({
            "measured_read_bandwidth": bandwidth,
            "roofline_tokens_per_second_nominal": nominal.decode_tokens_per_second,
            "roofline_tokens_per_second_measured_bandwidth": here.decode_tokens_per_second,
            "ratio_to_roofline_measured_bandwidth": row["decode_tokens_per_second_wall"] / here.decode_tokens_per_second,
            "predicted_tokens_per_second_with_dispatch": 1 / here.decode_step_seconds_with_dispatch,
            "ratio_to_predicted_with_dispatch":
                row["decode_tokens_per_second_wall"] * here.decode_step_seconds_with_dispatch,
            "predicted_prefill_tokens_per_second": nominal.prefill_tokens_per_second,
        })
        rows.append(row)
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))
        return
    print(f"threads {torch.get_num_threads()}; prompt {args.prompt}, {args.steps} decode steps (median)")
    print(f"{'shape':16s} {'params':>8s} {'MB/step':>8s} {'read GB/s':>9s} {'tok/s wall':>10s} {'tok/s cpu':>9s} "
          f"{'roofline':>9s} {'ratio':>6s} {'predicted':>9s} {'÷pred':>6s} {'prefill tok/s':>13s} {'predicted':>9s}")
    for r in rows:
        cpu = f"{r['decode_tokens_per_second_cpu']:.1f}" if r["decode_tokens_per_second_cpu"] else "-"
        print(f"{r['name']:16s} {r['params'] / 1e6:7.1f}M {r['decode_step_bytes'] / 1e6:8.1f} "
              f"{r['measured_read_bandwidth'] / 1e9:9.1f} {r['decode_tokens_per_second_wall']:10.1f} {cpu:>9s} "
              f"{r['roofline_tokens_per_second_measured_bandwidth']:9.1f} "
              f"{r['ratio_to_roofline_measured_bandwidth']:6.2f} {r['predicted_tokens_per_second_with_dispatch']:9.1f} "
              f"{r['ratio_to_predicted_with_dispatch']:6.2f} {r['prefill_tokens_per_second']:13.0f} "
              f"{r['predicted_prefill_tokens_per_second']:9.0f}")
    print("bars not judged: this benchmark reports decode and prefill speed; the bars on generation are "
          "memory's (memplan validate --mode inference)")


if __name__ == "__main__":
    main()

"""The quick start's choice of model and training settings, old against new, on this machine and corpus.

``memplan train`` with no arguments trains for 3 minutes on the embedded corpus (CPython's
documentation). This benchmark trains, in this one process and one after the other,

- **old**: the quick start as it was before issue 13 (commit a79fa58): a ``bpe:4096`` corpus, the
  largest rung of the ladder hidden = 64·layers (2…12 layers) predicted to train on 20 tokens per
  parameter (else the smallest), a global batch sized for 200 steps, ctx 256, learning rate 3e-3,
  the final sample from the first default prompt at temperature 0.8, top-k 40;
- **new**: the quick start as it is now: the corpus prepared with ``DEFAULT_TOKENIZER_EMBEDDED``,
  ``quickstart_model`` and the global batch, ctx and learning rate of ``memplan/planning.py``,
  the final sample as ``memplan train`` prints it (``trainer.sample.final_sample``);

each for ``--minutes`` (default 3) of training, with memplan's own calibration of this machine and
memplan's autotune choosing the setup of each model, exactly as the quick start does. It reports
for each: the held-out loss over the *whole* validation split (every held-out token once, in
windows of the run's ctx; the trainer's own evaluation reads a few batches only), bits per byte
(the loss in bits over the UTF-8 bytes of that held-out text: comparable across tokenizers, where
loss per token is not), perplexity, the trainer's last held-out loss as the run printed it, the
median tokens/s and MFU of its steps, the steps and tokens trained, and the final sample.

    PYTHONPATH=$PWD python benchmarks/quickstart.py [--minutes 3] [--threads N] [--only old|new] [--json]
    python benchmarks/quickstart.py --render FIGURES.json   # a saved --json output, as text

Everything (corpora, calibration, runs) goes to a temporary cache ($MEMPLAN_CACHE is set to it, and
it is removed at the end), so neither the user's cache nor another benchmark's is read or written.
The machine is shared: the figures come with the load average (``os.getloadavg``) before and after
each run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OLD_VOCAB = 4096  # trainer.data.DEFAULT_TOKENIZER_EMBEDDED before issue 13
OLD_CTX = 256
OLD_LR = 3e-3
OLD_TOKENS_PER_PARAM = 20
OLD_MIN_STEPS = 200
OLD_LAYERS = (2, 3, 4, 6, 8, 10, 12)
OLD_SAMPLE = dict(temperature=0.8, top_k=40, tokens=96)


def old_choice(vocab: int, profile, minutes: float):
    """The quick start's model and global batch before issue 13 (memplan/cli/train.py at a79fa58):
    the largest rung of hidden = 64·layers whose predicted tokens/s (micro-batch 8) trains on 20 tokens
    per parameter in ``minutes``, else the smallest rung; a global batch of ctx · 2^k tokens for about
    200 steps. Returns (spec, predicted tokens/s, global batch tokens)."""
    from memplan.planning import best_precision
    from memplan.model import ModelSpec, _round_up
    from memplan.setup import TrainSetup
    from memplan.timing import step_time

    chosen = None
    for layers in OLD_LAYERS:
        hidden = 64 * layers
        spec = ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=hidden // 64, kv_heads=hidden // 64,
                         ffn=_round_up(8 * hidden / 3, 256), vocab=vocab, tied=True,
                         name=f"quickstart-{layers}x{hidden}", source="the old quick start's ladder")
        tps = step_time(spec, TrainSetup(ctx=OLD_CTX, micro_batch=8, precision=best_precision(profile)),
                        profile).tokens_per_second
        if chosen is None or tps * minutes * 60 >= OLD_TOKENS_PER_PARAM * spec.params:
            chosen = (spec, tps)
    spec, tps = chosen
    steps_tokens = tps * minutes * 60 / OLD_MIN_STEPS
    gbt = max(OLD_CTX, min(1 << 19, OLD_CTX * 2 ** max(0, int(math.log2(max(1, steps_tokens / OLD_CTX))))))
    return spec, tps, gbt


def full_eval(model, data, tokenizer, ctx: int) -> dict:
    """Loss over every held-out token of every source once (windows of ``ctx`` + 1 tokens, stride
    ``ctx``), and bits per UTF-8 byte of the held-out text (end-of-text ids are predicted, not counted
    as bytes)."""
    import torch
    import torch.nn.functional as F

    model.eval()
    nats, tokens, nbytes = 0.0, 0, 0
    with torch.no_grad():
        for s in data.sources:
            ids = torch.as_tensor(data.val.read(s.val_offset, s.val_tokens).astype("int64"))
            nbytes += len(tokenizer.decode(ids.tolist(), skip_eot=True).encode("utf-8"))
            for i in range(0, len(ids) - 1, ctx):
                w = ids[i:i + ctx + 1]
                logits = model(w[:-1][None]).float()
                nats += float(F.cross_entropy(logits[0], w[1:], reduction="sum"))
                tokens += len(w) - 1
    model.train()
    loss = nats / tokens
    return {"loss": loss, "bits_per_byte": nats / math.log(2) / nbytes, "perplexity": math.exp(loss),
            "tokens": tokens, "bytes": nbytes}


def train_one(name: str, prepared, plan, lr: float, minutes: float, profile, run_dir: Path, sample) -> dict:
    """Train ``plan`` for ``minutes`` as the quick start does; the figures of the run."""
    from trainer.loop import TrainConfig, Trainer
    from trainer.rundir import read_metrics

    load_before = os.getloadavg()[0]
    trainer = Trainer.start(run_dir, plan, prepared, TrainConfig(max_minutes=minutes, lr=lr), profile)
    t0 = time.perf_counter()
    summary = trainer.run()
    wall = time.perf_counter() - t0
    steady = [l for l in read_metrics(run_dir, latest=True) if l.get("kind") == "train"][1:]
    ev = full_eval(trainer.model, prepared, trainer.tokenizer, plan.setup.ctx)
    prompt, text = sample(trainer)
    s = plan.setup
    return {
        "name": name, "model": plan.model.describe(), "params": plan.model.params, "vocab": plan.model.vocab,
        "ctx": s.ctx, "micro_batch": s.micro_batch, "grad_accum": s.grad_accum, "precision": s.precision,
        "compile": s.compile, "lr": lr, "tokens_per_step": s.tokens_per_step, "steps": summary.step,
        "tokens": summary.tokens, "tokens_per_param": summary.tokens / plan.model.params,
        "wall_seconds": wall, "held_out_loss": ev["loss"], "bits_per_byte": ev["bits_per_byte"],
        "perplexity": ev["perplexity"], "held_out_tokens": ev["tokens"], "held_out_bytes": ev["bytes"],
        "trainer_eval_loss": summary.last_eval.eval_loss if summary.last_eval else None,
        "tokens_per_second": statistics.median(l["tokens_per_second"] for l in steady) if steady else None,
        "mfu": statistics.median(l["mfu"] for l in steady) if steady else None,
        "load_before": load_before, "load_after": os.getloadavg()[0],
        "sample_prompt": prompt, "sample": text,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="training time of each run (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--only", choices=("old", "new"), help="train one of the two only")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--render", metavar="FILE", help="print a saved --json output as text, and train nothing")
    args = ap.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return 0

    cache = tempfile.mkdtemp(prefix="memplan-quickstart-")
    os.environ["MEMPLAN_CACHE"] = cache  # before memplan reads it: nobody else's cache is touched
    try:
        return run(args, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run(args, cache: str) -> int:
    """Calibrate, then train old and new (or the one of ``--only``) with ``cache`` as $MEMPLAN_CACHE."""
    import torch
    from rich.console import Console

    from memplan.cli.train import RichUI
    from memplan import planning as qs
    from trainer.train_run import ensure_embedded_data, local_calibration, measured_matmul_rate
    from memplan.cli.options import device_from
    from trainer import data
    from trainer.data import PreparedData
    from trainer.sample import final_sample, sample_text

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(stderr=True, highlight=False)
    profile, rates = local_calibration(device_from(None, None), RichUI(console), measure_now=True)
    console.print(f"threads {torch.get_num_threads()}; {rates}; load {os.getloadavg()[0]:.2f}", soft_wrap=True)

    results = []
    if args.only in (None, "old"):
        out = Path(cache) / "data" / f"embedded-bpe{OLD_VOCAB}"
        data.prepare(data.embedded_sources(), out, data.PrepareConfig(tokenizer=f"bpe:{OLD_VOCAB}"))
        prepared = PreparedData(out)
        spec, tps, gbt = old_choice(prepared.vocab_size, profile, args.minutes)
        plan = qs.autotuned_plan(spec, OLD_CTX, prepared, profile, minutes=args.minutes, global_batch_tokens=gbt,
                                 budget_bytes=None, margin=0.1, say=RichUI(console).say)

        def old_sample(trainer):
            prompt = trainer.sample_prompts()[0]
            return prompt, sample_text(trainer.model, trainer.tokenizer, prompt, OLD_SAMPLE["tokens"],
                                       ctx=trainer.setup.ctx, seed=trainer.config.seed,
                                       temperature=OLD_SAMPLE["temperature"], top_k=OLD_SAMPLE["top_k"],
                                       precision=trainer.setup.precision)

        console.print(f"old: {spec.describe()}, predicted {tps:,.0f} tokens/s, global batch {gbt:,} tokens")
        results.append(train_one("old", prepared, plan, OLD_LR, args.minutes, profile, Path(cache) / "run-old",
                                 old_sample))
    if args.only in (None, "new"):
        prepared = PreparedData(ensure_embedded_data(RichUI(console)))
        plan = qs.autotuned_plan(None, qs.QUICKSTART_CTX, prepared, profile, minutes=args.minutes,
                                 global_batch_tokens=None, budget_bytes=None, margin=0.1, say=RichUI(console).say,
                                 matmul_rate=measured_matmul_rate)
        results.append(train_one("new", prepared, plan, qs.QUICKSTART_LR, args.minutes, profile,
                                 Path(cache) / "run-new", final_sample))

    figures = {"threads": torch.get_num_threads(), "minutes": args.minutes, "runs": results}
    print(json.dumps(figures, indent=2) if args.json else render(figures))
    return 0


def render(figures: dict) -> str:
    """The figures as text (``--render FILE`` prints a saved ``--json`` output this way)."""
    lines = [f"memplan quick start, old vs new: {figures['minutes']:g} minutes of training each, "
             f"{figures['threads']} torch thread(s), one process"]
    for r in figures["runs"]:
        lines += [
            f"\n[{r['name']}] {r['model']}",
            f"  setup: ctx {r['ctx']}, micro-batch {r['micro_batch']} x {r['grad_accum']} ({r['tokens_per_step']:,} "
            f"tokens/step), {r['precision']}{', compiled' if r['compile'] else ''}, lr {r['lr']:g}",
            f"  trained: {r['steps']:,} steps, {r['tokens']:,} tokens ({r['tokens_per_param']:.1f} per parameter) in "
            f"{r['wall_seconds']:.0f} s; load average {r['load_before']:.2f} -> {r['load_after']:.2f}",
            f"  held-out (all {r['held_out_tokens']:,} tokens): loss {r['held_out_loss']:.3f}, perplexity "
            f"{r['perplexity']:,.1f}, {r['bits_per_byte']:.3f} bits/byte (trainer's last eval: "
            f"{r['trainer_eval_loss']:.3f})",
            f"  speed: {r['tokens_per_second']:,.0f} tokens/s (median step), MFU {r['mfu']:.1%}",
            f"  sample: {json.dumps(r['sample_prompt'] + r['sample'])}",
        ]
    if len(figures["runs"]) == 2:
        old, new = figures["runs"]
        lines.append(f"\nnew vs old: held-out loss {new['held_out_loss']:.3f} vs {old['held_out_loss']:.3f}, bits/byte "
                     f"{new['bits_per_byte']:.3f} vs {old['bits_per_byte']:.3f} "
                     f"({new['bits_per_byte'] / old['bits_per_byte'] - 1:+.1%}); tokens/s "
                     f"{new['tokens_per_second'] / old['tokens_per_second']:.2f}x; "
                     f"MFU {new['mfu']:.1%} vs {old['mfu']:.1%}")
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())

"""Where the time goes in memplan's compiled step and in transformers' compiled loop: CPU time per phase.

The two compiled loops of ``benchmarks/train_throughput.py`` at one size (memplan's default plan through its
trainer's compiled model and optimizer; ``torch.compile(model)`` of transformers' LlamaForCausalLM in the plain
loop), stepped alternately, each phase timed by this process's CPU time (one thread: the figure that leaves out
other processes on a shared machine). memplan's phases are those of ``trainer.step.train_step`` (its compiled
model to the logits, the fp32 loss eager, backward per micro-batch; clipping, AdamW, ``zero_grad``);
transformers' forward includes its loss, compiled with it. Medians over ``--rounds`` steps after two untimed
ones (the compiles).

    PYTHONPATH=$PWD python benchmarks/compiled_phases.py --size 1m --device CAL.toml [--rounds 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_throughput as tt  # noqa: E402

from memplan.hardware import load_profile  # noqa: E402
from memplan.model import ModelSpec  # noqa: E402
from trainer.data import PreparedData, TrainStream  # noqa: E402
from trainer.model import lm_loss  # noqa: E402

clock = time.process_time


def memplan_step(trainer, stream, t: dict) -> None:
    """``train_step``'s phases on the trainer's own compiled model and optimizer (no finite check: no values read)."""
    s = trainer.setup
    c = clock()
    batches = [next(stream) for _ in range(s.grad_accum)]
    t["data"] += clock() - c
    for x, y in batches:
        c = clock()
        logits = trainer.step_model(x)
        t["forward"] += clock() - c
        c = clock()
        loss = lm_loss(logits, y) / s.grad_accum
        t["loss"] += clock() - c
        del logits
        c = clock()
        loss.backward()
        t["backward"] += clock() - c
    c = clock()
    torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0, foreach=True)
    t["clip"] += clock() - c
    c = clock()
    trainer.optimizer.step()
    t["optimizer"] += clock() - c
    c = clock()
    trainer.optimizer.zero_grad(set_to_none=True)
    t["zero_grad"] += clock() - c


def transformers_step(hf: tt.HFLoop, t: dict) -> None:
    """``HFLoop.step``'s phases (compiled: the forward includes the loss)."""
    c = clock()
    x, y = next(hf.stream)
    t["data"] += clock() - c
    c = clock()
    loss = hf.step_model(input_ids=x, labels=y, shift_labels=y).loss
    t["forward"] += clock() - c
    c = clock()
    loss.backward()
    t["backward"] += clock() - c
    c = clock()
    torch.nn.utils.clip_grad_norm_(hf.model.parameters(), 1.0)
    t["clip"] += clock() - c
    c = clock()
    hf.optimizer.step()
    t["optimizer"] += clock() - c
    c = clock()
    hf.optimizer.zero_grad(set_to_none=True)
    t["zero_grad"] += clock() - c


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1m", help=f"one of {', '.join(tt.SIZES)}")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--device", default="cpu", help="the profile autotune plans with (a `memplan calibrate --compile` "
                                                   "profile, for the plan to compile)")
    p.add_argument("--hf-optimizer", default="default", choices=("default", "foreach", "fused"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.size not in tt.SIZES:
        raise SystemExit(f"--size: unknown {args.size} (accepted: {', '.join(tt.SIZES)})")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from rich.console import Console

    from memplan.cli.train import RichUI
    from trainer.train_run import ensure_embedded_data

    data = PreparedData(ensure_embedded_data(RichUI(Console(stderr=True))))
    profile = load_profile(args.device)
    layers, hidden, heads, ffn = tt.SIZES[args.size]
    spec = ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=ffn,
                     vocab=data.vocab_size, tied=True)
    plan, _ = tt.default_plan(spec, 256, 8, profile, {"compile": True}, None)
    s, device = plan.setup, torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        loop = tt.TrainerLoop(Path(tmp) / "run", plan, data, 0, profile, device)
        hf = tt.HFLoop(spec, s, data, 0, device, args.hf_optimizer, compiled=True)
        stream = TrainStream(data, batch=s.micro_batch, ctx=s.ctx, seed=1)
        steps = {"memplan": lambda t: memplan_step(loop.trainer, stream, t),
                 "transformers_compiled": lambda t: transformers_step(hf, t)}
        rows = {k: [] for k in steps}
        for r in range(args.rounds + 2):
            for name in (list(steps) if r % 2 else list(steps)[::-1]):
                t = defaultdict(float)
                c = clock()
                steps[name](t)
                t["total"] = clock() - c
                rows[name].append(t)
        loop.close()
    med = {k: {phase: statistics.median(row[phase] for row in v[2:]) for phase in v[0]} for k, v in rows.items()}
    out = {"command": "python benchmarks/compiled_phases.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "size": args.size, "plan": s.to_json(), "transformers_optimizer": f"torch AdamW ({args.hf_optimizer})",
           "median_cpu_seconds": med}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{out['command']}\n{spec.describe()}; memplan: micro-batch {s.micro_batch} × {s.grad_accum}, "
              f"{s.optimizer}; transformers: micro-batch {s.micro_batch * s.grad_accum}, {out['transformers_optimizer']}")
        print(f"{'ms CPU (median)':16}{'memplan':>10}{'transformers':>14}{'ratio':>8}")
        m, h = med["memplan"], med["transformers_compiled"]
        for phase in ("data", "forward", "loss", "backward", "clip", "optimizer", "zero_grad", "total"):
            a, b = m.get(phase, 0.0), h.get(phase, 0.0)
            print(f"{phase:16}{a * 1e3:>10.1f}{b * 1e3:>14.1f}" + (f"{b / a:>8.2f}" if a and b else ""))
    return out


if __name__ == "__main__":
    main()

"""What torch.compile (inductor) does to the peak of a training step, on this CPU, with real tensors; for
memplan's own step, against ``memplan trace --compile`` and ``estimate --compile``'s walk.

For memplan's own model and step and for transformers' (``trainer/stacks/transformers.py``), the same small
llama shape, eager and ``torch.compile``d, in fp32 and bf16-mixed, without and with full
checkpointing. The peak of a step is the bytes live at its start (parameters, buffers, optimizer
state, ``.grad``) plus the largest running sum of the CPU allocator's allocations and frees over one
steady-state step (after two warm-up steps, the first of which compiles), read from
``torch.profiler``'s memory events (``profile_memory=True``): they see inductor's own buffers, which
a TorchDispatchMode (``MemTracker``) does not. On the eager step this method agrees with
``MemTracker`` to within a few KiB (``tests/walk/test_families.py``, slow).

    python benchmarks/compile_memory.py [--arch llama] [--stacks memplan,transformers]
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from memplan.model import ModelSpec  # noqa: E402
from memplan.memory.stacks import stack_class  # noqa: E402
from memplan.setup import TrainSetup  # noqa: E402


def _live_at_start(model, optimizer) -> int:
    from trainer.measure import _tensor_bytes

    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return _tensor_bytes(tensors)


def _allocator_peak(step) -> int:
    """The largest running sum of the CPU allocator's allocations and frees while ``step()`` runs."""
    from trainer.measure import allocator_peak

    return allocator_peak(step)


def step_peak(stack: str, spec: ModelSpec, setup: TrainSetup, compiled: bool, seed: int = 0) -> int:
    """Peak live bytes of a steady-state step of ``stack``'s model and step, eager or compiled."""
    from trainer.step import make_optimizer, param_dtype, set_matmul_precision

    torch.manual_seed(seed)
    set_matmul_precision(setup.precision)
    if not stack_class(stack).library:  # memplan's own model and step
        from trainer.model import build_model
        from trainer.step import train_step

        net = build_model(spec, setup.attention, setup.checkpointing, param_dtype(setup.precision))

        def take(model, optimizer, batches):
            train_step(model, optimizer, batches, setup, "cpu", check_finite=False)

        def batches():
            ids = torch.randint(0, spec.vocab, (setup.micro_batch, setup.ctx))
            return [(ids, ids)]
    else:
        from trainer.stacks import StackModel
        from trainer.stacks.transformers import build_model, train_step

        net = build_model(StackModel(spec=spec), setup)

        def take(model, optimizer, batches):
            train_step(model, optimizer, batches, setup, "cpu")

        def batches():
            return [(torch.randint(0, spec.vocab, (setup.micro_batch, setup.ctx)), None)]
    optimizer = make_optimizer(net, setup.optimizer)
    model = torch.compile(net) if compiled else net  # shares net's parameters with the optimizer
    for _ in range(2):  # compilation, then the optimizer's state
        take(model, optimizer, batches())
    gc.collect()
    b = batches()
    return _live_at_start(net, optimizer) + _allocator_peak(lambda: take(model, optimizer, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--stacks", default="memplan,transformers")
    parser.add_argument("--precisions", default="fp32,bf16-mixed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = ModelSpec(arch=args.arch, layers=2, hidden=256, heads=4, kv_heads=4,
                     ffn=688 if args.arch == "llama" else 1024, vocab=2048, tied=False)
    print(f"{spec.describe()}; ctx 256, micro-batch 4, sdpa, adamw, CPU, 1 thread")
    print(f"{'stack':12s} {'precision':10s} {'ckpt':5s} {'eager':>12s} {'compiled':>12s} {'change':>7s}"
          "   memplan: compiled trace (trace --compile), compiled walk (estimate --compile), each against compiled")
    for stack in args.stacks.split(","):
        for precision in args.precisions.split(","):
            for checkpointing in ("none", "full"):
                setup = TrainSetup(ctx=256, micro_batch=4, precision=precision, checkpointing=checkpointing)
                started = time.time()
                eager = step_peak(stack, spec, setup, False)
                compiled = step_peak(stack, spec, setup, True)
                line = (f"{stack:12s} {precision:10s} {checkpointing:5s} {eager:>12,} {compiled:>12,} "
                        f"{(compiled - eager) / eager:>+7.1%}")
                if not stack_class(stack).library:  # memplan's: its compiled trace and walk too
                    from memplan.memory import peak_memory
                    from trainer.compiled_trace import trace_compiled_step

                    traced = trace_compiled_step(spec, setup.replace(compile=True)).peak_allocated
                    walked = peak_memory(spec, setup.replace(compile=True)).peak_allocated
                    line += (f"   trace {traced:,} ({(traced - compiled) / compiled:+.2%}), "
                             f"walk {walked:,} ({(walked - compiled) / compiled:+.2%})")
                print(f"{line}  ({time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

"""torch.compile of memplan's rotary model compiles its graph once: a training step, the next (which used to fail
dynamo's guard ``not hasattr(self, 'rope_cos')`` when the first forward registered the rotary tables, and compiled
the whole graph again), an eager forward in between (which keeps its own tables as buffers) and a third step all
run the first step's graph; ``memplan.timing.trainer_recompiles`` (0) predicts it. The tables the compiled graph
computes are the eager forward's own, bit for bit, with every RoPE scaling (tests/unit/test_rope_tables.py)."""

from __future__ import annotations

import pytest
import torch

from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.timing import trainer_recompiles

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def test_two_compiled_training_steps_of_a_rotary_model_compile_once():
    from torch._dynamo.utils import counters

    from trainer.compile_guard import compile_unavailable
    from trainer.model import build_model
    from trainer.step import make_optimizer, train_step

    if compile_unavailable("cpu"):
        pytest.skip(compile_unavailable("cpu"))
    spec = ModelSpec(arch="llama", layers=1, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=128, tied=True)
    setup = TrainSetup(ctx=16, micro_batch=2, precision="fp32", attention="sdpa", optimizer="adamw", compile=True)
    assert spec.pos == "rope" and trainer_recompiles(spec, setup) == 0
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(spec)
    optimizer = make_optimizer(model, "adamw")
    compiled = torch.compile(model)
    gen = torch.Generator().manual_seed(0)
    batch = [(torch.randint(spec.vocab, (2, 16), generator=gen), torch.randint(spec.vocab, (2, 16), generator=gen))]
    before = counters["stats"]["unique_graphs"]
    try:
        train_step(compiled, optimizer, batch, setup, "cpu", check_finite=False)
        assert counters["stats"]["unique_graphs"] - before == 1  # the whole model, one graph
        assert not any(n.startswith("rope_") for n, _ in model.named_buffers())  # computed in the graph, not kept
        train_step(compiled, optimizer, batch, setup, "cpu", check_finite=False)
        assert counters["stats"]["unique_graphs"] - before == 1, "the second compiled step compiled the graph again"
        with torch.no_grad():  # an eager forward keeps its tables as buffers, as before
            model(batch[0][0])
        assert {n for n, _ in model.named_buffers()} == {"rope_cos", "rope_sin"}
        train_step(compiled, optimizer, batch, setup, "cpu", check_finite=False)
        assert counters["stats"]["unique_graphs"] - before == 1, "the eager forward's buffers made it compile again"
    finally:
        torch._dynamo.reset()

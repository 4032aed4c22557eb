"""benchmarks/train_throughput.py's transformers loops (issue 25): the compiled one is the same model and loop
stepped through ``torch.compile(model)``, as a transformers user writes it. Mechanism only: nothing is timed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from trainer.data import PreparedData

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from runs_helper import pydoc_corpus

    return pydoc_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.slow
def test_the_compiled_transformers_loop_steps_the_compiled_model_and_matches_the_eager_loop(corpus, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("train_throughput", None)
    import train_throughput as tt
    from torch._dynamo.eval_frame import OptimizedModule

    data = PreparedData(corpus)
    spec = ModelSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=data.vocab_size, tied=True)
    setup = TrainSetup(ctx=16, micro_batch=2, precision="fp32")
    eager = tt.HFLoop(spec, setup, data, 0, torch.device("cpu"))
    compiled = tt.HFLoop(spec, setup, data, 0, torch.device("cpu"), compiled=True)
    assert eager.step_model is eager.model
    assert isinstance(compiled.step_model, OptimizedModule) and compiled.step_model._orig_mod is compiled.model
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    before = [p.detach().clone() for p in compiled.model.parameters()]
    losses = [(eager.step(), compiled.step()) for _ in range(2)]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the compiled loop went through dynamo
    assert all(not torch.equal(a, p) for a, p in zip(before, compiled.model.parameters()))  # AdamW stepped it
    # the same weights and batches: the compiled step's losses are the eager loop's, to float rounding
    for e, c in losses:
        assert c == pytest.approx(e, rel=1e-4)


def test_a_micro_batch_that_does_not_divide_the_batch_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("train_throughput", None)
    import train_throughput as tt

    with pytest.raises(SystemExit) as e:
        tt.main(["--sizes", "1m", "--micro-batch", "3"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "--micro-batch: 3 does not divide --batch 8 (accepted: 1, 2, 4, 8)\n"

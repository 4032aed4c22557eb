"""The trace's tracker frees what a plain step frees: MemTracker's module hooks
(``register_multi_grad_hook`` in ModTracker) form a cycle through each hooked input's grad_fn, which
kept leaf activations and their gradients alive across steps (trainer/measure.py ``_releasing_leaves``)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from trainer.measure import PeakTracker


class _Net(torch.nn.Module):
    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.a, self.b, self.reentrant = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), reentrant

    def forward(self, x):
        y = self.a(x) if self.reentrant is None else checkpoint(self.a, x, use_reentrant=self.reentrant)
        return self.b(y)


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["plain", "checkpoint", "reentrant-checkpoint"])
def test_a_leaf_activation_dies_with_its_step_under_the_tracker(reentrant):
    net = _Net(reentrant)
    tracker = PeakTracker()
    tracker.track_external(net)
    alive = []
    with tracker:
        for _ in range(2):
            tracker.reset_mod_stats()
            x = torch.randn(4, 8).requires_grad_(True)  # a leaf that needs a gradient, as the embedding output is
            alive.append(weakref.ref(x))
            net(x).sum().backward()
            del x
            gc.collect()
            assert [r() is not None for r in alive] == [False] * len(alive)


def test_transformers_lora_under_checkpointing_frees_its_input_leaf_each_step():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from memplan.model import ModelSpec
    from memplan.setup import TrainSetup
    from trainer.lora import frozen_params_tracked
    from trainer.stacks import StackModel, transformers as hf

    spec = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=320, tied=False)
    setup = TrainSetup(ctx=32, micro_batch=2, precision="fp32", checkpointing="full", lora_rank=4)
    net = hf.build_model(StackModel(spec=spec), setup, lora_dropout=0.0)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad])
    alive = []
    net.get_input_embeddings().register_forward_hook(lambda m, i, out: alive.append(weakref.ref(out)))
    tracker = PeakTracker()
    tracker.track_external(net, optimizer)
    with frozen_params_tracked(), tracker:
        for _ in range(2):
            hf.train_step(net, optimizer, [(torch.randint(0, 320, (2, 32)), None)], setup, "cpu",
                          before_forward=lambda i: tracker.reset_mod_stats())
            gc.collect()
    assert len(alive) == 2 and not any(r() is not None for r in alive)

"""The rotary tables ``Transformer.rope`` gives a compiled forward (computed in the graph, registered nowhere: a
buffer registered by the first compiled forward failed dynamo's guard at the second and compiled the whole graph
again; tests/runs/test_compile_recompiles.py compiles it) are the eager forward's, bit for bit, for every RoPE
scaling, dynamic NTK's length rule included; the eager forward keeps and grows its non-persistent buffers as
before, which state_dict leaves out."""

from __future__ import annotations

import pytest
import torch

from memplan.model import ModelSpec
from trainer.model import build_model

SCALINGS = {
    "plain": (),
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("kind", list(SCALINGS))
def test_compiled_forward_tables_are_the_eager_ones_and_register_nothing(monkeypatch, kind, arch):
    spec = ModelSpec(arch=arch, layers=1, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=64, tied=arch == "llama",
                     max_positions=32, rope_theta=500.0, rotary_pct=1.0 if arch == "llama" else 0.25,
                     rope_scaling=SCALINGS[kind])
    for T in (8, 32, 48):  # dynamic NTK: plain up to max_positions (32), scaled by the length beyond it
        fresh = build_model(spec)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        compiled_cos, compiled_sin = fresh.rope(T, "cpu")
        monkeypatch.undo()
        assert not list(fresh.named_buffers()), "a compiled forward registered the tables"
        grown = build_model(spec)
        grown.rope(64, "cpu")  # an eager forward of a longer sequence first: its tables, sliced
        for model in (fresh, grown):
            cos, sin = model.rope(T, "cpu")
            assert cos.shape == (T, spec.rotary_dim // 2) and cos.dtype == torch.float32
            assert torch.equal(cos, compiled_cos) and torch.equal(sin, compiled_sin), (kind, T)
        assert {n for n, _ in fresh.named_buffers()} == {"rope_cos", "rope_sin"}  # the eager forward keeps them
        assert not any(k.startswith("rope_") for k in fresh.state_dict())  # non-persistent: checkpoints unchanged

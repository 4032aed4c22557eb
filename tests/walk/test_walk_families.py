"""qwen3 under ``--stack transformers``: the walk (memplan/memory/stacks/transformers.py hooks) held to the exact trace of
transformers' own model (trainer/stacks, ``trace_stack``), over precision × attention × checkpointing ×
LoRA × tying, with the bars of tests/walk/test_walk_stacks.py (median |error| ≤ 3%, worst ≤ 10%).

Each hook's test takes a config where its tensor is at the peak: with the hook the walk is within the
median bar of the trace, without it (the function returning 0) it misses by more than twice that bar and
by more than twice as much as with it (the eager softmax's: by more than the bar, 5 times as much).

The shape: qwen3 with wide heads (head_size 64 on hidden 64: q and k are 4·H wide) and a narrow MLP, at
ctx 256 × batch 8, where the per-head q/k norms and the rotary on their fp32 output are most of a block.
"""

from __future__ import annotations

import itertools
import statistics

import pytest

import memplan.memory.stacks.transformers as stacks
from memplan.memory import peak_memory
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.memory.stacks import stack_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MEDIAN_BAR, WORST_BAR = 0.03, 0.10
QWEN3 = dict(arch="qwen3", layers=4, hidden=64, heads=4, kv_heads=4, head_size=64, ffn=16, vocab=64, tied=False)
QWEN3_WIDE = {**QWEN3, "layers": 2, "head_size": 128}
STEP = dict(ctx=256, micro_batch=8)


def _trace(spec, setup, dropout=0.0) -> int:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from runs_helper import traced_peak

    return traced_peak("transformers", spec, setup, lora_dropout=dropout)


def _walk(spec, setup, dropout=0.0) -> int:
    """The walk as the trace runs it: transformers' step on the CPU."""
    return peak_memory(spec, setup, stack=stack_for("transformers", lora_dropout=dropout, cpu=True)).peak_allocated


def _error(spec, setup, dropout=0.0, traced=None) -> float:
    traced = traced or _trace(spec, setup, dropout)
    return (_walk(spec, setup, dropout) - traced) / traced


HOOK_CASES = [
    ("hf_qk_rotary_transient_bytes", QWEN3_WIDE, dict(precision="bf16-mixed", checkpointing="full"), 0.0),
    ("Stack.qk_norm_saved_bytes", QWEN3_WIDE, dict(precision="bf16-mixed", checkpointing="full"), 0.0),
    ("hf_qk_rotary_held_bytes", QWEN3, dict(precision="bf16-mixed", checkpointing="full", lora_rank=4), 0.05),
    ("hf_lora_input_cast_transient_bytes", QWEN3, dict(precision="bf16-mixed", checkpointing="full", lora_rank=4),
     0.05),
    ("hf_qk_norm_backward_bytes", QWEN3_WIDE, dict(precision="bf16"), 0.0),
    ("hf_softmax_backward_bytes", QWEN3, dict(precision="bf16", attention="eager"), 0.0),
]
MISS = {"hf_softmax_backward_bytes": MEDIAN_BAR}  # a term of 2·B·heads·T² at 2 bytes: more than 3%, 5x the rest
HOOK_IDS = ["qk-norm-and-rotary-at-once", "qk-norm-saved-where-attention-runs", "fp32-rotary-outputs-held",
            "peft-fp32-input-cast-and-dropout", "qk-norms-backward", "fp32-softmax-backward"]


def _without(monkeypatch, hook: str) -> None:
    """The walk with ``hook`` taken out: the function returning 0 (for ``Stack.qk_norm_saved_bytes``: the qk
    norms' saved tensors made where the block's other stack tensors are, after the MLP, as before it)."""
    if hook.startswith("Stack."):
        monkeypatch.setattr(stacks.TransformersStack, hook.split(".", 1)[1], lambda self, *a, **k: 0)
    else:
        monkeypatch.setattr(stacks, hook, lambda *a, **k: 0)


def _hook_case(monkeypatch, hook, spec, setup, dropout):
    spec, setup = ModelSpec(**spec), TrainSetup(**STEP, **setup)
    traced = _trace(spec, setup, dropout)
    with_hook = _error(spec, setup, dropout, traced)
    _without(monkeypatch, hook)
    without = _error(spec, setup, dropout, traced)
    assert abs(with_hook) <= MEDIAN_BAR, with_hook
    miss = MISS.get(hook)
    if miss:
        assert abs(without) > miss and abs(without) > 5 * abs(with_hook), (with_hook, without)
    else:
        assert abs(without) > 2 * MEDIAN_BAR and abs(without) > 2 * abs(with_hook), (with_hook, without)


def test_the_qk_norms_and_rotary_held_at_once_bring_the_walk_to_the_trace(monkeypatch):
    """bf16-mixed under full checkpointing peaks in the recomputation, while k is rotated: the fp32
    outputs of q_norm and k_norm, q_embed and k's three rotary temporaries (fast: 2 layers)."""
    _hook_case(monkeypatch, *HOOK_CASES[0])


def test_the_hooks_add_nothing_without_qk_norms_or_where_their_tensors_are_not_made():
    """Pure functions of the shape: 0 for a family without qk norms, the held rotary outputs only under
    autocast, the eager softmax's only for a 16-bit eager step, peft's input cast only where one is made."""
    llama = ModelSpec(**{**QWEN3, "arch": "llama", "head_size": None})
    qwen3 = ModelSpec(**QWEN3)
    mixed, bf16 = TrainSetup(**STEP, precision="bf16-mixed"), TrainSetup(**STEP, precision="bf16")
    for hook in (stacks.hf_qk_rotary_held_bytes, stacks.hf_qk_rotary_transient_bytes,
                 stacks.hf_qk_norm_backward_bytes):
        assert hook(llama, mixed) == hook(llama, bf16) == 0
    n = 256 * 8
    assert stacks.hf_qk_rotary_held_bytes(qwen3, mixed) == n * (qwen3.q_dim + qwen3.kv_dim) * 4
    assert stacks.hf_qk_rotary_held_bytes(qwen3, bf16) == 0
    assert stacks.hf_softmax_backward_bytes(qwen3, bf16) == 0  # sdpa
    eager = bf16.replace(attention="eager")
    assert stacks.hf_softmax_backward_bytes(qwen3, eager) == 2 * 8 * 4 * 256 * 256
    assert stacks.hf_softmax_backward_bytes(qwen3, TrainSetup(**STEP, precision="fp32", attention="eager")) == 0
    fp32_lora = TrainSetup(**STEP, precision="fp32", lora_rank=4)
    assert stacks.hf_lora_input_cast_transient_bytes(qwen3, fp32_lora, "qkv", 0.05) == 0
    assert stacks.hf_lora_input_cast_transient_bytes(qwen3, bf16.replace(lora_rank=4), "up", 0.0) == 0  # saved
    assert stacks.hf_lora_input_cast_transient_bytes(qwen3, bf16.replace(lora_rank=4), "up", 0.05) == n * 64 * 4


# ---- the matrix ------------------------------------------------------------------------------

LORAS = {"none": (0, 0.0), "r4": (4, 0.0), "r4-dropout": (4, 0.05)}


def _matrix(spec=QWEN3, step=STEP, precisions=("fp32", "bf16", "bf16-mixed"), attentions=("eager", "sdpa"),
            checkpointings=("none", "full"), loras=tuple(LORAS), ties=(True, False)):
    for precision, attention, ckpt, lora, tied in itertools.product(precisions, attentions, checkpointings, loras,
                                                                     ties):
        rank, dropout = LORAS[lora]
        yield (f"{spec['arch']}-{precision}-{attention}-{ckpt}-{lora}-{'tied' if tied else 'untied'}",
               ModelSpec(**{**spec, "tied": tied}),
               TrainSetup(**step, precision=precision, attention=attention, checkpointing=ckpt, lora_rank=rank),
               dropout)


def _errors(cases) -> dict[str, float]:
    return {name: _error(spec, setup, dropout) for name, spec, setup, dropout in cases}


def _assert_bars(errors: dict[str, float]) -> None:
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert statistics.median(abs(e) for e in errors.values()) <= MEDIAN_BAR, errors
    assert abs(errors[worst]) <= WORST_BAR, (worst, errors[worst])


def test_qwen3_meets_the_bars_a_fast_subset():
    """The steps that missed most before the qk-norm hooks (at 4 layers, bf16-mixed: -18.2% and -25.8%;
    bf16: -12.2% and -9.5%), at 2 layers: each within the worst bar (the matrix's median is the slow test's)."""
    spec = {**QWEN3, "layers": 2}
    cases = [c for c in _matrix(spec, ties=(False,))
             if c[0].split("-", 1)[1] in ("bf16-mixed-sdpa-full-none-untied", "bf16-mixed-sdpa-full-r4-untied",
                                          "bf16-eager-full-none-untied", "bf16-sdpa-full-none-untied")]
    assert len(cases) == 4
    errors = _errors(cases)
    assert max(abs(e) for e in errors.values()) <= WORST_BAR, errors


if __name__ == "__main__":  # walk vs trace tables: python tests/walk/test_walk_families.py [qwen3] [phi gemma stablelm llama]
    import sys

    import torch

    from test_families import FAMILIES as SMALL  # tests/walk/test_families.py's tiny shapes, at ctx 64 × batch 2
    from test_walk_stacks import LLAMA

    torch.set_num_threads(1)
    shapes = {"qwen3": (QWEN3, STEP), "llama": (LLAMA, dict(ctx=64, micro_batch=2)),
              **{f: (SMALL[f], dict(ctx=64, micro_batch=2)) for f in ("phi", "gemma", "stablelm")}}
    for family in sys.argv[1:] or ["qwen3"]:
        spec, step = shapes[family]
        table = _errors(_matrix(spec, step))
        for name, error in table.items():
            print(f"{name:45s} {error:+.2%}")
        print(f"{family}: median |error| {statistics.median(abs(e) for e in table.values()):.2%}, "
              f"worst {max(abs(e) for e in table.values()):.2%}")

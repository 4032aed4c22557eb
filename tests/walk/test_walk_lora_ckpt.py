"""LoRA under full checkpointing with --stack transformers: the walk's recomputation as torch.utils.checkpoint
(non-reentrant) and peft run it, held to the exact trace (issue 15).

transformers checkpoints each layer with ``use_reentrant=False``: a block's recomputation starts when its
backward first unpacks a saved tensor and stops once the last one is saved again, lora_B's input in
down_proj's peft adapter. The traced peak of these steps is inside that recomputation. Each hook's test takes a
config where its tensors decide the peak: with the hook the walk is within the median bar (3%) of the trace;
with the hook taken out (returning 0) it misses by several times more.
"""

from __future__ import annotations

import statistics

import pytest

import memplan.memory.stacks.transformers as stacks
from memplan.memory import peak_memory
from memplan.memory.walk import walk_step
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.memory.stacks import stack_for
from test_walk_stacks import GPT2, LLAMA, MEDIAN_BAR, NEOX, WORST_BAR, _errors, _matrix, _trace, _walk

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FULL = dict(ctx=64, micro_batch=2, checkpointing="full", lora_rank=4)


def _with_and_without(monkeypatch, remove, spec, setup, dropout):
    traced = _trace(spec, setup, dropout)
    with_hook = (_walk(spec, setup, dropout) - traced) / traced
    remove()
    without = (_walk(spec, setup, dropout) - traced) / traced
    return with_hook, without


@pytest.mark.parametrize("hook,spec,precision,dropout,miss", [
    # down_proj's base output, peft's fp32 cast of its input and the dropout's output, at lora_A's output
    ("hf_recompute_down_adapter_bytes", NEOX, "bf16-mixed", 0.05, WORST_BAR),
    # the MLP's input and down's input, Python locals of the interrupted forward
    ("hf_recompute_locals_bytes", NEOX, "bf16-mixed", 0.0, 0.06),
    # the base output's bf16 gradient and lora_B's scaled fp32 gradient, made before the recomputation
    ("hf_recompute_gradient_bytes", NEOX, "bf16", 0.0, 0.045),
], ids=["down-adapter-until-lora-A", "mlp-locals", "gradients-before-recompute"])
def test_each_recompute_hook_brings_the_walk_to_the_trace(monkeypatch, hook, spec, precision, dropout, miss):
    setup = TrainSetup(precision=precision, **FULL)
    with_hook, without = _with_and_without(monkeypatch, lambda: monkeypatch.setattr(stacks, hook, lambda *a, **k: 0),
                                           ModelSpec(**spec), setup, dropout)
    assert abs(with_hook) <= MEDIAN_BAR, with_hook
    assert abs(without) > miss and abs(without) > 3 * abs(with_hook), (with_hook, without)


@pytest.mark.parametrize("method,attention", [
    # Under pure bf16 the recomputation peaks inside up_proj's adapter (lora_B's fp32 output and its scaled
    # copy): the casts q, k, v, o and gate_proj's adapters saved before it are alive then.
    ("adapter_saved_bytes", "sdpa"),
    # Eager attention: the recomputation peaks in the MLP's adapters, when the attention's fp32 softmax
    # (B·heads·T²·4, ``hf_attention_saved_bytes``) is saved already.
    ("attention_saved_bytes", "eager"),
], ids=["peft-saves-where-its-adapters-run", "eager-softmax-saved-where-attention-runs"])
def test_transformers_saves_where_its_modules_run(monkeypatch, method, attention):
    """gpt_neox under pure bf16: what peft's adapters and transformers' attention save, made where they run.
    Counted in one lump at the end of the MLP (the ``Stack`` method returning 0), it is missing at the
    recomputation's peak."""
    setup = TrainSetup(precision="bf16", attention=attention, **FULL)
    with_hook, without = _with_and_without(
        monkeypatch, lambda: monkeypatch.setattr(stacks.TransformersStack, method, lambda *a, **k: 0), ModelSpec(**NEOX), setup,
        0.0)
    assert abs(with_hook) <= MEDIAN_BAR, with_hook
    assert abs(without) > 0.045 and abs(without) > 3 * abs(with_hook), (with_hook, without)


def test_transformers_rmsnorm_copies_are_saved_where_the_norms_run(monkeypatch):
    """llama under pure bf16: each LlamaRMSNorm's fp32 copy of its input (``hf_norm_saved_bytes``) is saved by
    the time the recomputation peaks in up_proj's adapter. Counted in one lump after the MLP
    (``Stack.norm_saved_bytes`` returning 0) the walk misses by 1.4 points more. (What it still misses here,
    about 3%, is not modelled: the bf16 inputs the checkpoint and ``residual`` keep beside those copies.)"""
    setup = TrainSetup(precision="bf16", **FULL)
    with_hook, without = _with_and_without(
        monkeypatch, lambda: monkeypatch.setattr(stacks.TransformersStack, "norm_saved_bytes", lambda *a, **k: 0),
        ModelSpec(**LLAMA), setup, 0.0)
    assert abs(with_hook) <= WORST_BAR / 2, with_hook
    assert abs(without) > abs(with_hook) + 0.01, (with_hook, without)


def test_the_walk_peaks_in_the_last_blocks_recomputation_as_the_trace_does():
    """llama, autocast, dropout 0.05: the traced peak is at lora_A's output in the last block's recomputed
    down_proj; the walk's peak is there too, and within 1% of the trace (before issue 15: −12.8%, at the
    last block's backward)."""
    spec, setup = ModelSpec(**LLAMA), TrainSetup(precision="bf16-mixed", **FULL)
    stack = stack_for("transformers", lora_dropout=0.05, cpu=True)
    w = walk_step(spec, setup, stack=stack)
    marks = {m.name: m for m in w.marks}
    assert w.peak.phase == "backward"
    assert w.peak.total > marks["start of the last block's backward"].total  # inside the recomputation
    traced = _trace(spec, setup, 0.05)
    assert abs(peak_memory(spec, setup, stack=stack).peak_allocated - traced) / traced <= 0.01


def test_the_hooks_add_nothing_without_a_down_adapter_or_checkpointing():
    spec = ModelSpec(**LLAMA)
    hf = stack_for("transformers", lora_dropout=0.05, cpu=True)
    for setup in (TrainSetup(precision="bf16-mixed", **{**FULL, "checkpointing": "none"}),
                  TrainSetup(precision="bf16-mixed", **FULL, lora_targets="qkv,proj,up")):
        assert hf.recompute_gradient_bytes(spec, setup) == hf.recompute_stop_bytes(spec, setup) == 0
        assert not hf.recompute_reaches_down_adapter(setup)
    setup = TrainSetup(precision="bf16-mixed", **FULL)
    assert stack_for("memplan").recompute_stop_bytes(spec, setup) == 0
    assert not stack_for("memplan").recompute_reaches_down_adapter(setup)


def test_lora_under_checkpointing_meets_the_bars_a_fast_subset():
    """One case per family and precision of LoRA under full checkpointing (the whole of it is in
    ``test_the_walk_meets_the_bars_over_the_matrix``, slow): before issue 15 these missed by 3-19%."""
    cases = []
    for (fam, spec), precision, dropout in ((("llama", LLAMA), "bf16-mixed", 0.05), (("gpt2", GPT2), "bf16", 0.0),
                                            (("neox", NEOX), "bf16-mixed", 0.05), (("llama", LLAMA), "fp32", 0.05)):
        cases.append((f"{fam}-{precision}-{dropout}", ModelSpec(**spec), TrainSetup(precision=precision, **FULL),
                      dropout))
    errors = _errors(cases)
    assert statistics.median(abs(e) for e in errors.values()) <= MEDIAN_BAR, errors
    assert max(abs(e) for e in errors.values()) <= WORST_BAR, errors


def test_the_ledger_balances_over_a_checkpointed_lora_step():
    """What the walk allocates for transformers' LoRA under full checkpointing it frees by the end of the
    backward, category by category: down's adapter casts and x·Aᵀ, recomputed before the stop, are the ones
    its backward releases (``lora.adapter_recompute_stop``), and qkv's peft inputs are released once, by
    their own lora_A (``_block_backward``'s ``released``), not twice."""
    for name, spec, setup, dropout in _matrix(checkpointing=("full",), loras=("r4", "r4-dropout")):
        w = walk_step(spec, setup, stack=stack_for("transformers", lora_dropout=dropout, cpu=True))
        marks = {m.name: m.bytes for m in w.marks}
        start, end = marks["start of forward"], marks["end of backward"]
        assert (end["activations"], end["weights"], end["temporaries"]) == \
            (start["activations"], start["weights"], 0), name

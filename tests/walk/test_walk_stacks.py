"""memplan estimate --stack transformers: the analytic walk with transformers' and peft's hooks
(memplan/memory/stacks/), held to the exact trace of the same step (trainer/stacks, ``trace_stack``).

Each mechanism's test takes a config where that mechanism dominates: with its hook the walk is
within the issue's median bar (3%) of the trace; with the hook taken out (the function returning
0) it misses by more than the worst bar (10%) or, for the rotary term, by more than 3%. The
matrix test holds the walk to the bars over families × precisions × attention × checkpointing ×
LoRA × tying.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: runs_helper, run as a script

import pytest
from typer.testing import CliRunner

import memplan.memory.stacks.transformers as stacks
from memplan.cli import app
from memplan.memory import fp32_logits_bytes, logits_bytes, peak_memory
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.memory.stacks import stack_for
from runs_helper import one_line_error

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MEDIAN_BAR, WORST_BAR = 0.03, 0.10
LLAMA = dict(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=320, tied=False)
GPT2 = dict(arch="gpt2", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=320, tied=True)
NEOX = dict(arch="gpt_neox", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=320, tied=False)


def _trace(spec, setup, dropout=None) -> int:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from runs_helper import traced_peak

    return traced_peak("transformers", spec, setup, lora_dropout=dropout)


def _walk(spec, setup, dropout=None) -> int:
    """The walk as the trace runs it: transformers' step on the CPU (dropout noise in fp32)."""
    return peak_memory(spec, setup, stack=stack_for("transformers", lora_dropout=dropout or 0.0, cpu=True)).peak_allocated


def _errors_with_and_without(monkeypatch, hook, spec, setup, dropout=None):
    traced = _trace(spec, setup, dropout)
    with_hook = (_walk(spec, setup, dropout) - traced) / traced
    monkeypatch.setattr(stacks, hook, lambda *a, **k: 0)
    without = (_walk(spec, setup, dropout) - traced) / traced
    return with_hook, without


@pytest.mark.parametrize("hook,spec,setup,dropout,miss", [
    ("hf_norm_saved_bytes", LLAMA, TrainSetup(ctx=128, micro_batch=4, precision="bf16"), None, WORST_BAR),
    ("hf_attention_saved_bytes", GPT2, TrainSetup(ctx=128, micro_batch=4, precision="bf16-mixed", attention="eager"),
     None, WORST_BAR),
    ("hf_attention_saved_bytes", NEOX, TrainSetup(ctx=128, micro_batch=4, precision="bf16", attention="eager"),
     None, WORST_BAR),
    ("hf_attention_saved_bytes", {**LLAMA, "layers": 4, "vocab": 64}, TrainSetup(ctx=256, micro_batch=4, precision="fp32"),
     None, MEDIAN_BAR),
    ("hf_lora_saved_bytes", LLAMA, TrainSetup(ctx=128, micro_batch=4, precision="fp32", lora_rank=4), 0.05, WORST_BAR),
    ("hf_lora_bytes_delta", LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="bf16", lora_rank=16), 0.0, WORST_BAR),
], ids=["rmsnorm-fp32-copy", "gpt2-fp32-softmax", "neox-fp32-softmax", "llama-rotary-saves-no-qkv",
        "peft-dropout-mask-and-copy", "peft-fp32-separate-adapters"])
def test_each_hook_brings_the_walk_to_the_trace_and_its_absence_misses_it(monkeypatch, hook, spec, setup, dropout,
                                                                          miss):
    with_hook, without = _errors_with_and_without(monkeypatch, hook, ModelSpec(**spec), setup, dropout)
    assert abs(with_hook) <= MEDIAN_BAR, with_hook
    assert abs(without) > miss, without


def test_peft_casts_its_input_per_module_under_autocast(monkeypatch):
    """LoRA rank 4 without dropout under bf16-mixed: each of q, k, v, gate and up's lora_A casts
    the fp32 norm output to bf16 and saves its own copy."""
    spec = ModelSpec(**LLAMA)
    setup = TrainSetup(ctx=128, micro_batch=4, precision="bf16-mixed", lora_rank=4)
    with_hook, without = _errors_with_and_without(monkeypatch, "hf_lora_saved_bytes", spec, setup, 0.0)
    assert abs(with_hook) <= MEDIAN_BAR, with_hook
    assert abs(without) > 3 * abs(with_hook) and abs(without) > 0.05, (with_hook, without)


# ---- the matrix ------------------------------------------------------------------------------

FAMILIES = {"llama": LLAMA, "gpt2": GPT2, "neox": NEOX}
LORAS = {"none": (0, None), "r4": (4, 0.0), "r4-dropout": (4, 0.05)}


def _matrix(checkpointing=("none", "full"), loras=tuple(LORAS)):
    for fam, precision, attention, ckpt, lora, tied in itertools.product(
            FAMILIES, ("fp32", "bf16-mixed", "bf16"), ("eager", "sdpa"), checkpointing, loras, (True, False)):
        rank, dropout = LORAS[lora]
        spec = ModelSpec(**{**FAMILIES[fam], "tied": tied})
        setup = TrainSetup(ctx=64, micro_batch=2, precision=precision, attention=attention, checkpointing=ckpt,
                           lora_rank=rank)
        yield f"{fam}-{precision}-{attention}-{ckpt}-{lora}-{'tied' if tied else 'untied'}", spec, setup, dropout


def _errors(cases) -> dict[str, float]:
    out = {}
    for name, spec, setup, dropout in cases:
        traced = _trace(spec, setup, dropout)
        out[name] = (_walk(spec, setup, dropout) - traced) / traced
    return out


def test_the_walk_meets_the_bars_without_checkpointing_a_fast_subset():
    """llama × precisions × attention × LoRA (none, rank 4 with and without dropout), untied, no checkpointing."""
    cases = [c for c in _matrix(checkpointing=("none",)) if c[0].startswith("llama") and c[0].endswith("untied")]
    errors = _errors(cases)
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert statistics.median(abs(e) for e in errors.values()) <= MEDIAN_BAR, errors
    assert abs(errors[worst]) <= WORST_BAR, (worst, errors[worst])


# ---- loss dtype, DDP's buckets, memplan's own walk ----------------------------------------------

def test_loss_dtype_logits_takes_cross_entropy_in_the_logits_dtype():
    """A vocabulary-heavy step peaks at the loss: with --loss-dtype logits the fp32 copy is never
    made and the log-probabilities and their gradients are bf16, so the peak drops by exactly
    the difference of the live loss tensors: fp32 copy's absence, and two (n, V) tensors at 2
    bytes in place of 4."""
    spec = ModelSpec(arch="llama", layers=1, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=32000, tied=False)
    setup = TrainSetup(ctx=256, micro_batch=2, precision="bf16-mixed")
    fp32 = peak_memory(spec, setup, stack=stack_for("memplan", "fp32"))
    own = peak_memory(spec, setup, stack=stack_for("memplan", "logits"))
    assert fp32.peak_moment == own.peak_moment == "backward: loss"
    # at the loss's backward: logits (bf16), log-probs, their gradient, the logits' gradient
    assert fp32.peak_allocated - own.peak_allocated == 3 * (fp32_logits_bytes(spec, setup) - logits_bytes(spec, setup))
    assert peak_memory(spec, setup).peak_allocated == fp32.peak_allocated


def test_ddp_under_transformers_keeps_buckets_beside_the_gradients():
    """transformers' Trainer wraps the model in DDP with gradient_as_bucket_view=False: the buckets
    are a second gradient-sized buffer beside the .grad the backward makes as in one process. A
    weights-heavy step peaks in the optimizer step with 2·N·p of gradients: the single-process
    peak plus N·p. (memplan's trainer makes .grad views into the buckets: N·p at most.)"""
    spec = ModelSpec(arch="gpt2", layers=2, hidden=256, heads=4, kv_heads=4, ffn=1024, vocab=8000, tied=True)
    setup = TrainSetup(ctx=16, micro_batch=1, precision="fp32", world_size=2, sharding="ddp")
    hf = stack_for("transformers")
    ddp = peak_memory(spec, setup, stack=hf)
    single = peak_memory(spec, setup.replace(world_size=1, sharding="none"), stack=hf)
    assert ddp.peak_moment == single.peak_moment == "optimizer step"
    assert ddp.gradients == 2 * spec.params * 4
    assert ddp.peak_allocated == single.peak_allocated + spec.params * 4
    assert peak_memory(spec, setup).gradients < ddp.gradients


@pytest.mark.parametrize("setup", [
    TrainSetup(ctx=64, micro_batch=2), TrainSetup(ctx=64, micro_batch=2, precision="bf16", attention="eager"),
    TrainSetup(ctx=64, micro_batch=2, checkpointing="full", lora_rank=4), TrainSetup(ctx=64, world_size=2, sharding="ddp"),
])
def test_stack_memplan_is_the_walk_without_a_stack(setup):
    spec = ModelSpec(**LLAMA)
    plain = peak_memory(spec, setup)
    named = peak_memory(spec, setup, stack=stack_for("memplan"))
    assert (plain.peak_allocated, plain.peak_moment) == (named.peak_allocated, named.peak_moment)
    assert peak_memory(spec, setup, stack=stack_for("transformers")).peak_allocated != plain.peak_allocated


# ---- the CLI ---------------------------------------------------------------------------------------

ARGS = ["estimate", "--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
        "--ffn", "128", "--vocab", "320", "--untied", "--ctx", "64", "--batch", "2", "--device", "cpu"]


def test_estimate_json_names_its_stack_and_follows_it():
    runner = CliRunner()
    own = runner.invoke(app, [*ARGS, "--json"])
    hf = runner.invoke(app, [*ARGS, "--json", "--stack", "transformers", "--lora-rank", "4", "--lora-dropout", "0.05"])
    assert own.exit_code == 0 and hf.exit_code == 0, (own.output, hf.output)
    own, hf = json.loads(own.stdout), json.loads(hf.stdout)
    assert own["stack"] == "memplan" and hf["stack"] == "transformers"
    spec = ModelSpec(**LLAMA)
    # estimate without --precision takes the device's best (the cpu profile's: fp32), as train and autotune do
    setup = TrainSetup(ctx=64, micro_batch=2, lora_rank=4, precision=hf["setup"]["precision"])
    walked = peak_memory(spec, setup, stack=stack_for("transformers", lora_dropout=0.05, cpu=True)).peak_allocated
    assert hf["memory"]["peak_allocated"] == walked


@pytest.mark.parametrize("extra,needles", [
    (["--stack", "nanogpt"], ["--stack", "memplan, transformers, litgpt, torchtune"]),
    (["--loss-dtype", "fp16"], ["--loss-dtype", "fp32, logits"]),
    (["--stack", "transformers", "--checkpointing", "selective"], ["selective", "none, full"]),
    (["--stack", "transformers", "--world-size", "2", "--sharding", "fsdp"], ["fsdp", "none, ddp"]),
    (["--lora-dropout", "0.1"], ["--lora-dropout", "[0, 1)"]),
    (["--stack", "transformers", "--lora-rank", "4", "--lora-dropout", "1.5"], ["--lora-dropout", "[0, 1)"]),
    (["--stack", "transformers", "--mode", "inference"], ["--stack", "--mode training"]),
])
def test_bad_stack_options_are_one_line_errors(extra, needles):
    result = CliRunner().invoke(app, [*ARGS, *extra])
    one_line_error(result, *needles)


if __name__ == "__main__":  # the table of walk vs trace over the whole matrix: python tests/walk/test_walk_stacks.py
    import torch

    torch.set_num_threads(1)
    table = _errors(_matrix())
    for name, error in table.items():
        print(f"{name:45s} {error:+.2%}")
    print(f"median |error| {statistics.median(abs(e) for e in table.values()):.2%}, "
          f"worst {max(abs(e) for e in table.values()):.2%}")

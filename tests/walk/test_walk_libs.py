"""memplan estimate --stack litgpt | torchtune: the analytic walk with litgpt's and torchtune's hooks
(memplan/memory/stacks/), held to the exact trace of the same step (trainer/stacks, ``trace_stack``).

litgpt and torchtune each live in an environment of their own (pyproject.toml says why); each test
skips where its library is not importable. As tests/walk/test_walk_stacks.py does for transformers: each
mechanism's test takes a config where that mechanism weighs, and checks that with its hook the walk
is within the median bar (3%) of the trace and that with the hook taken out (returning 0, or the
spec / setup unchanged) it misses by more than the worst bar (10%) or, for the smaller terms, by more
than 3%. The matrix tests hold the walk to the bars (median ≤ 3%, worst ≤ 10%) over precisions ×
checkpointing × LoRA (none, rank 4 with and without dropout) × tying × grouped heads.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: runs_helper, run as a script

import pytest
from typer.testing import CliRunner

import memplan.memory.stacks.litgpt as litgpt_hooks
import memplan.memory.stacks.torchtune as torchtune_hooks
from memplan.cli import app
from memplan.memory import peak_memory
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.memory.stacks import stack_for
from runs_helper import one_line_error

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.libs]  # litgpt's and torchtune's

MEDIAN_BAR, WORST_BAR = 0.03, 0.10
LLAMA = dict(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=320, tied=False)


def _setup(**kw) -> TrainSetup:
    return TrainSetup(**{"ctx": 128, "micro_batch": 4, **kw})


def _trace(lib, spec, setup, dropout=None) -> int:
    pytest.importorskip(lib)
    from runs_helper import traced_peak

    return traced_peak(lib, spec, setup, lora_dropout=dropout)


def _walk(lib, spec, setup, dropout=None) -> int:
    """The walk as the trace runs it: the library's step on the CPU (dropout masks in the input's dtype)."""
    return peak_memory(spec, setup, stack=stack_for(lib, lora_dropout=dropout, cpu=True)).peak_allocated


def _errors_with_and_without(monkeypatch, lib, hook, spec, setup, dropout, removed):
    traced = _trace(lib, spec, setup, dropout)
    with_hook = (_walk(lib, spec, setup, dropout) - traced) / traced
    monkeypatch.setattr({"litgpt": litgpt_hooks, "torchtune": torchtune_hooks}[lib], hook, removed)
    without = (_walk(lib, spec, setup, dropout) - traced) / traced
    return with_hook, without


def _zero(*args, **kwargs):
    return 0


def _unchanged(first, *args, **kwargs):
    return first


LIT_CASES = [
    ("lit_norm_saved_bytes", LLAMA, _setup(precision="bf16"), None, _zero, WORST_BAR),
    ("lit_attention_saved_bytes", {**LLAMA, "vocab": 64, "kv_heads": 1}, _setup(precision="fp32"), None, _zero,
     MEDIAN_BAR),
    ("lit_held_logits_bytes", {**LLAMA, "vocab": 8000}, _setup(ctx=64, micro_batch=2, precision="bf16-mixed",
                                                              lora_rank=4), 0.0, _zero, WORST_BAR),
    ("lit_chunked_loss_backward_bytes", {**LLAMA, "vocab": 8000}, _setup(ctx=64, precision="fp32"), None, _zero,
     WORST_BAR),
    ("lit_walked_spec", {**LLAMA, "tied": True, "vocab": 2048}, _setup(ctx=64, micro_batch=2, precision="bf16"),
     None, _unchanged, WORST_BAR),
    ("lit_lora_saved_bytes", LLAMA, _setup(precision="fp32", lora_rank=4), 0.05, _zero, WORST_BAR),
    ("lit_lora_bytes_delta", {**LLAMA, "vocab": 64}, _setup(ctx=32, micro_batch=2, precision="bf16", lora_rank=32),
     0.0, _zero, MEDIAN_BAR),
    ("lit_optimizer_scratch_bytes", {**LLAMA, "layers": 1, "kv_heads": 4, "ffn": 256, "vocab": 256, "tied": True},
     _setup(ctx=32, micro_batch=1, precision="fp32"), None, _zero, WORST_BAR),
    ("lit_head_weight_casts_bytes", {**LLAMA, "vocab": 8000}, _setup(ctx=2048, micro_batch=1, precision="bf16-mixed",
                                                                    lora_rank=4), 0.0, _zero, MEDIAN_BAR),
]
LIT_IDS = ["rmsnorm-fp32-copies", "repeated-kv-and-reshape-copy", "logits-held-to-the-step-end",
           "chunked-loss-frees-log-probs", "no-tied-head", "lora-dropout-mask-and-output", "lora-qkv-3r-and-fc1-fc2",
           "for-loop-adamw-on-the-cpu", "chunked-head-casts-its-weight-per-chunk"]

TT_CASES = [
    ("tt_norm_saved_bytes", LLAMA, _setup(precision="bf16"), None, _zero, WORST_BAR),
    ("tt_attention_saved_bytes", {**LLAMA, "kv_heads": 4, "layers": 4}, _setup(precision="fp32"), None, _zero,
     MEDIAN_BAR),
    ("tt_chunked_loss_backward_bytes", {**LLAMA, "vocab": 8000}, _setup(ctx=64, precision="fp32"), None, _zero,
     WORST_BAR),
    ("tt_chunked_upcast_bytes", {**LLAMA, "vocab": 8000}, _setup(ctx=64, precision="bf16"), None, _zero, WORST_BAR),
    ("tt_rope_cache_bytes", {**LLAMA, "layers": 4}, _setup(ctx=32, micro_batch=1, precision="bf16", lora_rank=4),
     0.0, _zero, WORST_BAR),
    ("tt_chunked_head_grad_bytes", {**LLAMA, "layers": 1, "vocab": 2048}, _setup(ctx=32, micro_batch=1,
                                                                                 precision="bf16"), None, _zero,
     WORST_BAR),
    ("tt_walked_setup", {**LLAMA, "layers": 1}, _setup(ctx=32, micro_batch=1, precision="fp32"), None, _unchanged,
     WORST_BAR),
    ("tt_lora_saved_bytes", LLAMA, _setup(precision="fp32", lora_rank=4), 0.05, _zero, WORST_BAR),
    ("tt_lora_bytes_delta", {**LLAMA, "vocab": 64, "hidden": 256, "ffn": 256},
     _setup(ctx=32, micro_batch=2, precision="fp32", lora_rank=64), 0.0, _zero, MEDIAN_BAR),
    ("lib_first_block_saved_bytes", LLAMA, _setup(precision="fp32", lora_rank=4), 0.05, _zero, MEDIAN_BAR),
]
TT_IDS = ["rms-norm-fp32-copies", "unfused-qkv-expanded-kv", "chunked-loss-backward", "chunk-by-chunk-upcast",
          "rope-cache-per-lora-layer", "chunked-head-weight-grad-sums", "fused-adamw",
          "lora-dropout-per-module", "lora-separate-q-k-v-w1-w3", "first-lora-block-keeps-no-masks"]


@pytest.mark.parametrize("lib,hook,spec,setup,dropout,removed,miss",
                         [("litgpt", *c) for c in LIT_CASES] + [("torchtune", *c) for c in TT_CASES],
                         ids=[f"litgpt-{i}" for i in LIT_IDS] + [f"torchtune-{i}" for i in TT_IDS])
def test_each_hook_brings_the_walk_to_the_trace(monkeypatch, lib, hook, spec, setup, dropout, removed, miss):
    with_hook, without = _errors_with_and_without(monkeypatch, lib, hook, ModelSpec(**spec), setup, dropout, removed)
    assert abs(with_hook) <= MEDIAN_BAR, with_hook
    assert abs(without) > miss, without


def test_litgpt_autocast_casts_the_mlp_input_twice(monkeypatch):
    """bf16-mixed without LoRA: fc_1 and fc_2 each cast the fp32 norm output and save their copy. A small
    term (n·H·2 per block): with it the walk is exact to 0.1%; without it, 30 times further off."""
    spec = ModelSpec(**{**LLAMA, "vocab": 64, "ffn": 64})
    with_hook, without = _errors_with_and_without(monkeypatch, "litgpt", "lit_autocast_mlp_cast_bytes", spec,
                                                  _setup(precision="bf16-mixed"), None, _zero)
    assert abs(with_hook) <= 0.001, with_hook
    assert abs(without) > 0.02, without


@pytest.mark.parametrize("removed", ["upcasts_output", "logits_grad_chunks"])
def test_litgpt_lora_never_holds_the_bf16_logits_beside_their_fp32_copy(monkeypatch, removed):
    """finetune/lora.py under bf16, the head in 16 chunks (ctx 2048): Fabric's ``convert_output`` frees the
    model's bf16 logits before the loss (``upcasts_output``), and each chunk's gradient is cast back on its own
    (``logits_grad_chunks``). Each moment alone, taken back to the whole logits, puts the walk 16% over."""
    from memplan.memory.stacks.litgpt import LitgptStack

    spec, setup = ModelSpec(**{**LLAMA, "vocab": 8000}), _setup(ctx=2048, micro_batch=1, precision="bf16", lora_rank=4)
    traced = _trace("litgpt", spec, setup, 0.0)
    with_hooks = (_walk("litgpt", spec, setup, 0.0) - traced) / traced
    monkeypatch.setattr(LitgptStack, removed, False if removed == "upcasts_output" else (lambda self, spec, setup: 1))
    without = (_walk("litgpt", spec, setup, 0.0) - traced) / traced
    assert abs(with_hooks) <= 0.01, with_hooks
    assert without > WORST_BAR, without


def test_litgpt_rotary_tables_cover_the_whole_head(monkeypatch):
    """litgpt's cos and sin are ctx × head_size each (memplan's: ctx × head_size/2): 8 KiB here, the
    walk's whole gap to the trace without the hook, none with it."""
    with_hook, without = _errors_with_and_without(monkeypatch, "litgpt", "lit_rope_cache_bytes", ModelSpec(**LLAMA),
                                                  _setup(precision="fp32"), None, _zero)
    assert abs(with_hook) <= 0.0001, with_hook
    assert abs(without) > 0.0005, without


# ---- the matrices ------------------------------------------------------------------------------

LORAS = {"none": (0, None), "r4": (4, 0.0), "r4-dropout": (4, 0.05)}
LIB_MATRIX = {
    "litgpt": dict(precisions=("fp32", "bf16-mixed", "bf16"), checkpointings=("none",)),
    "torchtune": dict(precisions=("fp32", "bf16"), checkpointings=("none", "full")),
}


def _matrix(lib, kv_heads=(2, 4), tied=(False, True)):
    m = LIB_MATRIX[lib]
    for precision, ckpt, lora, tie, kv in itertools.product(m["precisions"], m["checkpointings"], LORAS, tied,
                                                             kv_heads):
        rank, dropout = LORAS[lora]
        spec = ModelSpec(**{**LLAMA, "tied": tie, "kv_heads": kv})
        setup = _setup(precision=precision, checkpointing=ckpt, lora_rank=rank)
        yield f"{precision}-{ckpt}-{lora}-{'tied' if tie else 'untied'}-kv{kv}", spec, setup, dropout


def _errors(lib, cases) -> dict[str, float]:
    out = {}
    for name, spec, setup, dropout in cases:
        traced = _trace(lib, spec, setup, dropout)
        out[name] = (_walk(lib, spec, setup, dropout) - traced) / traced
    return out


def _assert_bars(errors):
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert statistics.median(abs(e) for e in errors.values()) <= MEDIAN_BAR, errors
    assert abs(errors[worst]) <= WORST_BAR, (worst, errors[worst])


@pytest.mark.parametrize("lib", ["litgpt", "torchtune"])
def test_the_walk_meets_the_bars_a_fast_subset(lib):
    """Untied, two kv heads: every precision, checkpointing and LoRA the library takes."""
    _assert_bars(_errors(lib, _matrix(lib, kv_heads=(2,), tied=(False,))))


# ---- torch-free: the hooks' choices, the CLI ----------------------------------------------------

def test_the_libraries_default_dropouts():
    assert stack_for("litgpt").lora_dropout == 0.05  # finetune/lora.py
    assert stack_for("torchtune").lora_dropout == 0.0  # the recipes' configs
    assert stack_for("transformers").lora_dropout == 0.0  # peft


def test_litgpt_walks_a_tied_shape_untied():
    """litgpt's GPT has its own lm_head always: the tied shape's walk is the untied shape's."""
    tied, untied = ModelSpec(**{**LLAMA, "tied": True}), ModelSpec(**LLAMA)
    setup = _setup(precision="bf16-mixed")
    walk = stack_for("litgpt", cpu=True)
    assert peak_memory(tied, setup, stack=walk).peak_allocated == peak_memory(untied, setup, stack=walk).peak_allocated
    assert peak_memory(tied, setup).peak_allocated < peak_memory(untied, setup).peak_allocated


ARGS = ["estimate", "--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
        "--ffn", "128", "--vocab", "320", "--untied", "--ctx", "128", "--batch", "4", "--device", "cpu", "--json"]


@pytest.mark.parametrize("lib,extra", [("litgpt", ["--precision", "bf16-mixed"]),
                                       ("torchtune", ["--precision", "bf16", "--lora-rank", "4"])])
def test_estimate_walks_the_library(lib, extra):
    import json

    result = CliRunner().invoke(app, [*ARGS, *extra, "--stack", lib])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["stack"] == lib
    setup = _setup(precision=extra[1], lora_rank=4 if "--lora-rank" in extra else 0)
    walked = peak_memory(ModelSpec(**LLAMA), setup, stack=stack_for(lib, cpu=True)).peak_allocated
    assert data["memory"]["peak_allocated"] == walked


@pytest.mark.parametrize("extra,needles", [
    (["--stack", "litgpt", "--checkpointing", "full"], ["--stack litgpt", "--checkpointing full", "none"]),
    (["--stack", "torchtune", "--precision", "bf16-mixed"], ["--stack torchtune", "fp32, tf32, bf16"]),
    (["--stack", "torchtune", "--precision", "bf16", "--attention", "eager"], ["--stack torchtune", "sdpa"]),
    (["--stack", "litgpt", "--lora-rank", "4", "--lora-targets", "qkv,up"], ["--lora-targets", "up with down"]),
    (["--stack", "torchtune", "--arch", "gpt2"], ["--stack torchtune", "gpt2"]),
])
def test_what_the_libraries_do_not_run_is_a_one_line_error(extra, needles):
    result = CliRunner().invoke(app, [*ARGS, *extra])
    one_line_error(result, *needles)


def test_autotune_searches_only_what_the_library_runs():
    """autotune --stack torchtune: SDPA only, no autocast precision, checkpointing none or full, one process;
    litgpt: SDPA, no checkpointing."""
    import json

    args = ["autotune", "--arch", "llama", "--layers", "4", "--hidden", "256", "--heads", "4", "--kv-heads", "4",
            "--ffn", "256", "--vocab", "512", "--untied", "--ctx", "2k", "--device", "a100-80gb", "--budget", "2GiB",
            "--json"]
    tt = CliRunner().invoke(app, [*args, "--stack", "torchtune"])
    lit = CliRunner().invoke(app, [*args, "--stack", "litgpt"])
    assert tt.exit_code == 0 and lit.exit_code == 0, (tt.output, lit.output)
    tt, lit = json.loads(tt.stdout)["space"], json.loads(lit.stdout)["space"]
    assert tt["attention"] == lit["attention"] == ["sdpa"]
    assert "bf16-mixed" not in tt["precision"] and "bf16-mixed" in lit["precision"]
    assert tt["checkpointing"] == ["none", "full"] and lit["checkpointing"] == ["none"]


if __name__ == "__main__":  # the walk-vs-trace table of one library: python tests/walk/test_walk_libs.py litgpt
    import sys

    import torch

    torch.set_num_threads(1)
    table = _errors(sys.argv[1], _matrix(sys.argv[1]))
    for name, error in table.items():
        print(f"{name:36s} {error:+.2%}")
    print(f"median |error| {statistics.median(abs(e) for e in table.values()):.2%}, "
          f"worst {max(abs(e) for e in table.values()):.2%}")

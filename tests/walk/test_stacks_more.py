"""memplan trace --stack litgpt | torchtune: those libraries' models and training steps, traced on fake tensors.

As for transformers (tests/walk/test_stacks.py), a trace is held to the same two steps on real tensors
(``measure_stack``): the live-tensor peak must be equal to the byte. The fake-tensor run needs two
accommodations, each with a test that fails without it: litgpt's model (built and converted by
Fabric's precision plugin) only within ``converting_fake_parameters``, and torchtune's Llama 3.2
RoPE, whose scaling reads values, only within ``torchtune.as_on_real_tensors``.

litgpt and torchtune are optional, each in an extra of its own (``memplan[litgpt]``,
``memplan[torchtune]``: their pins conflict with transformers 5's and peft's); without one, its
tests are skipped.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from runs_helper import one_line_error

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.libs]  # litgpt's and torchtune's

LLAMA = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=320, tied=False)
TIED = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=320, tied=True)
NEOX = ModelSpec(arch="gpt_neox", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=320, tied=False)
SHAPE = ["--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
         "--vocab", "320", "--ctx", "64", "--device", "cpu"]


def _needs(library: str):
    if library == "torchtune":
        pytest.importorskip("torchao")  # torchtune without it raises a plain ImportError, which is no skip
    pytest.importorskip(library)


def _both(stack, spec, setup, lora_dropout=None):
    from trainer.stacks import StackModel, measure_stack, trace_stack

    traced = trace_stack(stack, StackModel(spec=spec), setup, lora_dropout=lora_dropout)
    measured = measure_stack(stack, StackModel(spec=spec), setup, lora_dropout=lora_dropout)
    return traced, measured


@pytest.mark.parametrize("spec,setup,dropout", [
    (LLAMA, TrainSetup(ctx=64, micro_batch=2, precision="fp32", attention="sdpa"), None),
    (LLAMA, TrainSetup(ctx=64, micro_batch=2, precision="bf16-mixed", grad_accum=2), None),
    (LLAMA, TrainSetup(ctx=64, micro_batch=2, precision="bf16"), None),
    (NEOX, TrainSetup(ctx=64, micro_batch=2, precision="fp32"), None),
    (LLAMA, TrainSetup(ctx=64, micro_batch=2, precision="bf16-mixed", lora_rank=4), None),  # finetune_lora's 0.05
    (LLAMA, TrainSetup(ctx=256, micro_batch=2, precision="bf16", lora_rank=4, lora_targets="qkv,proj"), 0.1),
], ids=["llama-fp32-sdpa", "llama-bf16mixed-accum2", "llama-bf16", "neox-fp32", "llama-bf16mixed-lora",
        "llama-bf16-lora-qkv-proj-dropout-ctx256"])
def test_the_trace_of_litgpt_is_its_real_peak_to_the_byte(spec, setup, dropout):
    _needs("litgpt")
    traced, measured = _both("litgpt", spec, setup, dropout)
    assert traced.peak_allocated == measured.peak_allocated
    assert traced.params == measured.params


@pytest.mark.parametrize("spec,setup,dropout", [
    (LLAMA, TrainSetup(ctx=64, micro_batch=2, precision="fp32", attention="sdpa"), None),
    (LLAMA, TrainSetup(ctx=64, micro_batch=2, precision="bf16"), None),
    (LLAMA, TrainSetup(ctx=64, micro_batch=2, precision="fp32", checkpointing="full", grad_accum=2), None),
    (LLAMA, TrainSetup(ctx=64, micro_batch=2, precision="bf16", lora_rank=4), 0.1),
    (TIED, TrainSetup(ctx=64, micro_batch=2, precision="bf16", lora_rank=4, lora_targets="qkv",
                      checkpointing="full"), 0.05),
], ids=["llama3-fp32-sdpa", "llama3-bf16", "llama3-full-ckpt-accum2", "llama3-bf16-lora-dropout",
        "llama3_2-tied-lora-ckpt"])
def test_the_trace_of_torchtune_is_its_real_peak_to_the_byte(spec, setup, dropout):
    _needs("torchtune")
    traced, measured = _both("torchtune", spec, setup, dropout)
    assert traced.peak_allocated == measured.peak_allocated
    assert traced.params == measured.params


def test_litgpt_cannot_convert_its_model_on_fake_tensors_outside_the_block():
    """Fabric's HalfPrecision converts the model (``module.to(bf16)``); on fake tensors a
    parameter FakeTensorMode's memo holds cannot be swapped.

    In a process of its own: after an earlier trace in the same process (this file's byte tests) the
    swap goes through even with FakeTensorMode's dispatch cache cleared (litgpt 0.5.13, torch 2.13), so
    in the file's order the refusal would not show."""
    import subprocess

    _needs("litgpt")
    probe = "\n".join([
        "import contextlib",
        "from memplan.model import ModelSpec",
        "from memplan.setup import TrainSetup",
        "from trainer import stacks",
        "from trainer.stacks import StackModel, trace_stack",
        "stacks.converting_fake_parameters = contextlib.nullcontext",
        "spec = ModelSpec(arch='llama', layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=320, tied=False)",
        "trace_stack('litgpt', StackModel(spec=spec), TrainSetup(ctx=32, precision='bf16'))",
    ])
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env,
                          cwd=root)
    assert done.returncode != 0 and "RuntimeError" in done.stderr and "swap" in done.stderr, done.stderr[-2000:]


def test_torchtune_llama3_2_rope_reads_values_without_the_real_tensor_path(monkeypatch):
    import contextlib

    _needs("torchtune")
    from trainer import stacks
    from trainer.stacks import StackModel, trace_stack

    monkeypatch.setattr(stacks, "_as_on_real_tensors", lambda stack: contextlib.nullcontext())
    with pytest.raises(Exception) as info:
        trace_stack("torchtune", StackModel(spec=TIED), TrainSetup(ctx=32, precision="bf16"))
    assert "DataDependent" in type(info.value).__name__


def test_litgpt_lora_takes_finetune_loras_dropout_when_none_is_given():
    """finetune/lora.py's lora_dropout is 0.05: no --lora-dropout traces as 0.05, not as 0."""
    _needs("litgpt")
    from trainer.stacks import StackModel, trace_stack

    setup = TrainSetup(ctx=64, micro_batch=2, precision="fp32", lora_rank=4, lora_targets="qkv")
    default = trace_stack("litgpt", StackModel(spec=LLAMA), setup).peak_allocated
    assert default == trace_stack("litgpt", StackModel(spec=LLAMA), setup, lora_dropout=0.05).peak_allocated
    assert default > trace_stack("litgpt", StackModel(spec=LLAMA), setup, lora_dropout=0.0).peak_allocated


def test_torchtune_checkpointing_wraps_its_layers_and_lowers_the_peak():
    _needs("torchtune")
    from trainer.stacks import StackModel, trace_stack

    plain = TrainSetup(ctx=128, micro_batch=2, precision="fp32")
    full = plain.replace(checkpointing="full")
    assert trace_stack("torchtune", StackModel(spec=LLAMA), full).peak_allocated < \
        trace_stack("torchtune", StackModel(spec=LLAMA), plain).peak_allocated


@pytest.mark.parametrize("stack", ["litgpt", "torchtune"])
def test_trace_cli_json_for_the_stack(stack):
    _needs(stack)
    done = CliRunner().invoke(app, ["trace", "--stack", stack, *SHAPE, "--batch", "2", "--precision", "bf16",
                                    "--lora-rank", "4", "--lora-dropout", "0.1", "--json"])
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    assert data["stack"] == stack and data["trace"]["stack"] == stack
    assert data["memory"]["peak_allocated"] > 0 and data["setup"]["lora_rank"] == 4
    assert stack in data["trace"]["method"]
    assert done.stderr.strip() == ""


@pytest.mark.parametrize("stack,library,extra", [("torchtune", "torchtune", "memplan[torchtune]"),
                                                 ("litgpt", "litgpt", "memplan[litgpt]")])
def test_a_missing_library_is_one_line_naming_its_extra(monkeypatch, stack, library, extra):
    monkeypatch.setitem(sys.modules, library, None)  # import raises ImportError
    done = CliRunner().invoke(app, ["trace", "--stack", stack, *SHAPE])
    one_line_error(done, f"--stack {stack}", library, extra)


@pytest.mark.parametrize("stack,args,needles", [
    ("megatron", [], ["--stack", "memplan, transformers, litgpt, torchtune"]),
    ("litgpt", ["--checkpointing", "full"], ["--checkpointing full", "litgpt", "accepted: none"]),
    ("litgpt", ["--attention", "eager"], ["scaled_dot_product_attention", "sdpa"]),
    ("litgpt", ["--precision", "fp16-mixed"], ["fp16-mixed", "bf16-mixed"]),
    ("litgpt", ["--lora-rank", "4", "--lora-targets", "qkv,up"], ["qkv,up", "up+down"]),
    ("torchtune", ["--precision", "bf16-mixed"], ["bf16-mixed", "fp32, tf32, bf16"]),
    ("torchtune", ["--precision", "bf16", "--checkpointing", "selective"], ["selective", "none, full"]),
    ("torchtune", ["--precision", "bf16", "--lora-rank", "4", "--lora-targets", "down"], ["down", "up+down"]),
    ("torchtune", ["--precision", "bf16", "--lora-rank", "4", "--lora-dropout", "1.0"], ["--lora-dropout", "[0, 1)"]),
])
def test_trace_stack_bad_combinations_are_one_line(stack, args, needles):
    if stack != "megatron":
        _needs(stack)
    done = CliRunner().invoke(app, ["trace", "--stack", stack, *SHAPE, *args])
    one_line_error(done, *needles)


@pytest.mark.parametrize("stack,shape,needle", [
    ("litgpt", ["--arch", "gpt2"], "rotary positions only"),
    ("torchtune", ["--arch", "gpt_neox"], "--arch gpt_neox"),
])
def test_families_a_stack_does_not_build_are_one_line(stack, shape, needle):
    _needs(stack)
    done = CliRunner().invoke(app, ["trace", "--stack", stack, *shape, "--layers", "2", "--hidden", "64",
                                    "--heads", "4", "--ffn", "256", "--vocab", "320", "--ctx", "64",
                                    "--device", "cpu"])
    one_line_error(done, needle, "accepted")


def test_peft_refusing_an_old_torchao_is_one_line(monkeypatch):
    """torchtune's extra installs a torchao older than 0.15, which peft 0.19+ refuses with an
    ImportError from get_peft_model: --stack transformers --lora-rank says so in one line."""
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    def refuse(*args, **kwargs):
        raise ImportError("Found an incompatible version of torchao. Found version 0.14.1, but only versions "
                          "above 0.16.0 are supported")

    monkeypatch.setattr(peft, "get_peft_model", refuse)
    done = CliRunner().invoke(app, ["trace", "--stack", "transformers", *SHAPE, "--lora-rank", "4"])
    one_line_error(done, "peft", "torchao", "memplan[torchtune]")

"""memplan trace --stack: other people's training code (transformers with peft), traced on fake tensors.

The trace of a stack is held to the same two steps run on real tensors (``measure_stack``): the
live-tensor peak must be equal to the byte. The fake-tensor run takes transformers' eager paths
(no explicit causal mask, SDPA's own GQA) only because ``hf.as_on_real_tensors`` says so, and peft
can cast its adapters only within ``converting_fake_parameters``; each has a test that fails
without it.
"""

from __future__ import annotations

import json

import pytest

from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from runs_helper import one_line_error
from typer.testing import CliRunner

from memplan.cli import app

pytest.importorskip("transformers")
pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LLAMA = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=320, tied=False)
GPT2 = ModelSpec(arch="gpt2", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=320, tied=True)
NEOX = ModelSpec(arch="gpt_neox", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=320, tied=False)
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=320, max_position_embeddings=256)


def _both(model, setup, lora_dropout=None):
    from trainer.stacks import measure_stack, trace_stack

    traced = trace_stack("transformers", model, setup, lora_dropout=lora_dropout)
    measured = measure_stack("transformers", model, setup, lora_dropout=lora_dropout)
    return traced, measured


@pytest.mark.parametrize("spec,setup", [
    (LLAMA, TrainSetup(ctx=64, micro_batch=2, precision="fp32", attention="sdpa")),
    (LLAMA, TrainSetup(ctx=64, micro_batch=2, precision="bf16-mixed", attention="eager")),
    (LLAMA, TrainSetup(ctx=64, micro_batch=2, precision="fp32", checkpointing="full", grad_accum=2)),
    (GPT2, TrainSetup(ctx=64, micro_batch=2, precision="bf16", lora_rank=4)),
    (NEOX, TrainSetup(ctx=64, micro_batch=2, precision="fp32", attention="sdpa")),
], ids=["llama-fp32-sdpa", "llama-bf16mixed-eager", "llama-full-ckpt-accum2", "gpt2-bf16-lora", "neox-fp32-sdpa"])
def test_the_trace_of_transformers_is_its_real_peak_to_the_byte(spec, setup):
    from trainer.stacks import StackModel

    traced, measured = _both(StackModel(spec=spec), setup)
    assert traced.peak_allocated == measured.peak_allocated
    assert traced.params == measured.params


@pytest.mark.parametrize("model_type", ["phi", "gemma", "stablelm", "qwen3"])
def test_families_memplan_does_not_walk_are_traced_exactly_with_peft_lora_and_dropout(model_type):
    """A config.json of a family memplan's analytic model does not cover, LoRA with dropout on q, k, v."""
    from trainer.stacks import StackModel

    cfg = {"model_type": model_type, **BASE, **({"head_dim": 16} if model_type in ("gemma", "qwen3") else {})}
    setup = TrainSetup(ctx=64, micro_batch=2, precision="bf16-mixed", lora_rank=4, lora_targets="qkv")
    traced, measured = _both(StackModel(hf_config=cfg), setup, lora_dropout=0.1)
    assert traced.peak_allocated == measured.peak_allocated


@pytest.mark.parametrize("ctx", [32, 64], ids=["within-max-positions", "beyond-max-positions"])
def test_dynamic_ntk_rope_is_traced_exactly(ctx):
    """rope_scaling dynamic: transformers' rotary reads ``max(position_ids) + 1`` at every forward
    (``dynamic_rope_update``), which a fake tensor cannot answer (the trace raised DataDependentOutputException);
    ``for_fake_tensors`` settles it with the trace's length, as the first real forward does, within and beyond
    max_position_embeddings (32)."""
    from trainer.stacks import StackModel

    cfg = {"model_type": "llama", **BASE, "max_position_embeddings": 32,
           "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    traced, measured = _both(StackModel(hf_config=cfg), TrainSetup(ctx=ctx, micro_batch=2, precision="fp32"))
    assert traced.peak_allocated == measured.peak_allocated


def test_trace_stack_of_a_dynamic_ntk_config_answers(tmp_path):
    """``memplan trace --stack transformers --model config.json`` with dynamic NTK RoPE prints its peak."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **BASE, "max_position_embeddings": 32,
                                "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}))
    result = CliRunner().invoke(app, ["trace", "--stack", "transformers", "--model", str(path), "--ctx", "64",
                                      "--batch", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["memory"]["peak_allocated"] > 0


def test_without_the_eager_paths_a_trace_keeps_a_mask_transformers_does_not_keep(monkeypatch):
    """Take away ``as_on_real_tensors`` and transformers reads the fake tensors as a graph being
    traced: it builds an explicit mask (and cannot tell packed sequences apart), so the trace is
    no longer the real peak."""
    import contextlib

    from trainer import stacks
    from trainer.stacks import StackModel

    monkeypatch.setattr(stacks, "_as_on_real_tensors", lambda stack: contextlib.nullcontext())
    setup = TrainSetup(ctx=64, micro_batch=2, precision="fp32", attention="sdpa")
    try:
        traced, measured = _both(StackModel(spec=LLAMA), setup)
    except Exception as e:  # the packed-sequence check reads a value of a fake tensor
        assert "DataDependent" in type(e).__name__ or "data-dependent" in str(e).lower()
    else:
        assert traced.peak_allocated != measured.peak_allocated


def test_peft_cannot_cast_its_adapters_on_fake_tensors_without_leave(monkeypatch):
    import contextlib

    from trainer.stacks import StackModel, trace_stack
    from trainer.stacks import transformers as transformers_twin

    monkeypatch.setattr(transformers_twin, "converting_fake_parameters", contextlib.nullcontext)
    with pytest.raises(RuntimeError, match="swap"):
        trace_stack("transformers", StackModel(spec=LLAMA), TrainSetup(ctx=32, precision="bf16", lora_rank=2))


def test_lora_dropout_saves_a_mask_and_a_copy_before_each_adapter():
    """peft's dropout (p > 0) keeps its output for lora_A and a mask; p = 0 is an Identity: a trace
    with dropout is larger, by at least one bool mask of the adapter inputs per adapted matrix."""
    from trainer.stacks import StackModel, trace_stack

    setup = TrainSetup(ctx=64, micro_batch=2, precision="fp32", lora_rank=4, lora_targets="qkv")
    without = trace_stack("transformers", StackModel(spec=LLAMA), setup, lora_dropout=0.0).peak_allocated
    with_dropout = trace_stack("transformers", StackModel(spec=LLAMA), setup, lora_dropout=0.1).peak_allocated
    inputs = setup.micro_batch * setup.ctx * LLAMA.hidden  # q, k and v read one input
    assert with_dropout - without >= inputs * 1


def test_transformers_keeps_more_than_memplans_own_model_of_the_same_shape():
    """The mechanism issue 15 names: transformers' RMSNorm upcasts its input to fp32 and autograd
    keeps that copy; memplan's own norm does not. Under bf16-mixed the same llama shape peaks higher."""
    from trainer.stacks import StackModel, trace_stack

    setup = TrainSetup(ctx=64, micro_batch=2, precision="bf16-mixed", attention="sdpa")
    ours = trace_stack("memplan", StackModel(spec=LLAMA), setup).peak_allocated
    theirs = trace_stack("transformers", StackModel(spec=LLAMA), setup).peak_allocated
    assert theirs > ours


def test_trace_cli_traces_a_config_json_of_another_family(tmp_path, memplan_cli):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "phi", **BASE}))
    done = memplan_cli("trace", "--stack", "transformers", "--model", str(cfg), "--ctx", "64", "--batch", "2",
                       "--precision", "fp32", "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["stack"] == "transformers" and data["model"]["model_type"] == "phi"
    assert data["memory"]["peak_allocated"] > 0 and data["model"]["params"] > 0
    assert data["trace"]["stack"] == "transformers"
    assert "Warning" not in done.stderr and "warn" not in done.stderr.lower()


def test_trace_cli_compares_transformers_with_the_transformers_walk_of_a_shape(memplan_cli):
    done = memplan_cli("trace", "--stack", "transformers", "--arch", "llama", "--layers", "2", "--hidden", "64",
                       "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "320", "--ctx", "64",
                       "--device", "cpu", "--lora-rank", "4", "--lora-dropout", "0.05")
    assert done.returncode == 0, done.stderr
    assert "Stack" in done.stdout and "transformers" in done.stdout and "LoRA rank 4" in done.stdout
    assert "estimate --stack transformers" in done.stdout  # the walk of the same stack (issue 28.1)
    assert done.stderr.strip() == ""


@pytest.mark.parametrize("args,needles", [
    (["--stack", "megatron"], ["--stack", "megatron", "memplan, transformers"]),
    (["--stack", "memplan", "--lora-rank", "4", "--lora-dropout", "0.1"], ["--lora-dropout", "[0, 1)"]),
    (["--stack", "transformers", "--lora-rank", "4", "--lora-dropout", "1.5"], ["--lora-dropout", "[0, 1)"]),
    (["--stack", "transformers", "--checkpointing", "selective"], ["selective", "none, full"]),
    (["--stack", "transformers", "--world-size", "2", "--sharding", "fsdp"],
     ["--world-size 1", "--stack memplan|litgpt|torchtune with --sharding fsdp"]),
    (["--stack", "litgpt", "--world-size", "2", "--sharding", "ddp"], ["DDP's C++ reducer", "fake tensors",
                                                                        "--sharding fsdp"]),
])
def test_trace_stack_bad_input_is_one_line(args, needles):
    done = CliRunner().invoke(app, ["trace", "--params", "22m", "--ctx", "64", "--device", "cpu", *args])
    one_line_error(done, *needles)


@pytest.mark.parametrize("content,needle", [
    (b"\xff\xfe not utf-8", "UTF-8"),
    (b"[1, 2]", "model_type"),
    (b'{"model_type": "no-such-family", "vocab_size": 10}', "no-such-family"),
    (b'{"model_type": "phi", "hidden_size": "wide", "num_hidden_layers": 2, "num_attention_heads": 4, '
     b'"vocab_size": 300}', "phi"),
])
def test_trace_stack_hostile_config_is_one_line(tmp_path, content, needle):
    cfg = tmp_path / "config.json"
    cfg.write_bytes(content)
    done = CliRunner().invoke(app, ["trace", "--stack", "transformers", "--model", str(cfg), "--ctx", "64",
                                    "--device", "cpu"])
    one_line_error(done, needle)


def test_a_missing_library_names_the_extra(monkeypatch):
    from memplan.errors import InputError
    from trainer.stacks import require

    with pytest.raises(InputError, match=r"memplan\[stacks\]"):
        require("a_library_that_is_not_installed", "transformers")

"""Hostile checkpoint weights (issue 29, items 1 and 2): integer, bool and float8 weights are refused at import
in one line naming the tensor and its dtype; float weights of another width than config.json says are converted,
with a note; NaN or inf weights are refused naming the tensor; sampling survives non-finite logits; a figure that
is missing (a held-out loss whose perplexity overflows) is "not measured" in the summary and the report."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import InputError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runs_helper import one_line_error, tiny_spec  # noqa: E402
from test_hf_import import configs, tokenizer, write_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "llama"
    write_checkpoint(out, configs()["llama"], tokenizer())
    return out


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sft") / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Which animal is {i}?", "response": f"The cat is {i}."}) + "\n"
                            for i in range(20)))
    return path


def variant(base: Path, dst: Path, change) -> Path:
    """A copy of the checkpoint ``base`` with its tensors changed by ``change(dict)``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def finetune(directory: Path, sft: Path, out: Path):
    return runner.invoke(app, ["finetune", "--device", "cpu", "--from", str(directory), "--data", str(sft),
                               "--out", str(out), "--batch", "2", "--max-steps", "1"])


NOT_FLOAT = {"int32": (torch.int32, "I32"), "int8": (torch.int8, "I8"), "uint8": (torch.uint8, "U8"),
             "bool": (torch.bool, "BOOL"), "float8": (torch.float8_e4m3fn, "F8_E4M3")}


@pytest.mark.parametrize("kind", list(NOT_FLOAT))
def test_integer_bool_and_float8_weights_are_refused_naming_the_tensor_and_dtype(base, sft, tmp_path, kind):
    dtype, stored = NOT_FLOAT[kind]
    name = "model.layers.1.mlp.up_proj.weight"
    d = variant(base, tmp_path / "ck", lambda t: t.update({name: t[name].to(dtype)}))
    out = tmp_path / "out"
    line = one_line_error(finetune(d, sft, out), f"tensor {name} is stored as {stored}", "float weights only")
    assert "F32" in line  # the accepted dtypes
    assert not out.exists()


@pytest.mark.parametrize("kind", ["float16", "bfloat16", "float64"])
def test_float_weights_of_another_width_are_converted_with_a_note(base, tmp_path, kind):
    from trainer.hf_import import import_hf

    dtype = getattr(torch, kind)
    d = variant(base, tmp_path / "ck", lambda t: t.update({k: v.to(dtype) for k, v in t.items()}))
    imported = import_hf(d)
    assert {t.dtype for t in imported.tensors.values()} == {torch.float32}  # config.json says float32
    assert imported.dtype == "float32"
    assert any(f"stored as {kind}" in n and "converted to float32" in n for n in imported.notes), imported.notes


def test_mixed_float_widths_are_converted_to_the_configs_dtype(base, tmp_path):
    from trainer.hf_import import import_hf

    d = variant(base, tmp_path / "ck", lambda t: t.update({"lm_head.weight": t["lm_head.weight"].half()}))
    imported = import_hf(d)
    assert imported.dtype == "float32" and any("float16, float32" in n for n in imported.notes)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(base, sft, tmp_path, value):
    name = "model.layers.0.self_attn.v_proj.weight"

    def poison(t):
        t[name][3, 5] = value

    d = variant(base, tmp_path / "ck", poison)
    out = tmp_path / "out"
    one_line_error(finetune(d, sft, out), f"tensor {name} holds 1 non-finite value")
    assert not out.exists()


def test_train_from_non_finite_weights_is_refused_when_they_are_read(base, tmp_path):
    """``memplan train --from``: the same check where its weights are read (while the model is built)."""
    from trainer.hf_import import read_spec
    from trainer.task import starting_from_hf

    name = "model.norm.weight"
    d = variant(base, tmp_path / "ck", lambda t: t[name].fill_(float("nan")))
    model_type, spec, *_ = read_spec(d)
    starting = starting_from_hf(d, spec, model_type=model_type)
    with pytest.raises(InputError, match=f"tensor {name} holds 64 non-finite values"):
        starting.load()


def test_integer_weights_are_refused_from_the_headers_before_train_from_reads_them(base, tmp_path):
    from trainer.hf_import import read_spec
    from trainer.task import starting_from_hf

    name = "model.embed_tokens.weight"
    d = variant(base, tmp_path / "ck", lambda t: t.update({name: t[name].to(torch.int64)}))
    model_type, spec, *_ = read_spec(d)
    with pytest.raises(InputError, match=f"tensor {name} is stored as I64"):
        starting_from_hf(d, spec, model_type=model_type)


# ---- sampling guards against non-finite logits ----------------------------------------------------------

@pytest.fixture
def nan_model():
    from trainer.model import build_model

    torch.manual_seed(0)
    model = build_model(tiny_spec("llama", 50), "sdpa", "none", torch.float32)
    with torch.no_grad():
        model.embed.weight[7].fill_(float("nan"))  # token 7's embedding: every logit after it is NaN
    return model.eval()


def test_the_sampler_ends_a_sample_at_nan_logits_instead_of_raising(nan_model):
    from trainer.sample import sample_ids

    gen = torch.Generator().manual_seed(0)
    assert sample_ids(nan_model, [1, 7], 5, ctx=32, generator=gen) == []
    assert sample_ids(nan_model, [1, 7], 5, ctx=32, greedy=True) == []
    assert len(sample_ids(nan_model, [1, 2], 5, ctx=32, generator=gen)) == 5  # finite logits: as before


@pytest.mark.parametrize("greedy", [False, True])
def test_generate_stops_at_nan_logits_and_says_why(nan_model, greedy):
    from trainer.generate import GenerationStats, SamplingConfig, generate_ids

    stats = GenerationStats()
    config = SamplingConfig(max_new_tokens=5, greedy=greedy, stop_at_eot=False)
    assert list(generate_ids(nan_model, [1, 7], config, window=32, stats=stats)) == []
    assert stats.stopped == "nonfinite"


def test_finite_logits_keeps_finite_rows_drops_nan_and_keeps_only_the_plus_inf_entries():
    from trainer.sample import NonFiniteLogits, finite_logits

    inf, nan = float("inf"), float("nan")
    row = torch.tensor([[1.0, nan, 3.0, -inf], [0.0, inf, 2.0, inf]])
    got = finite_logits(row)
    assert got[0].tolist() == [1.0, -inf, 3.0, -inf]
    assert got[1].tolist() == [-inf, 0.0, -inf, 0.0]  # the +inf entries, equally likely
    probs = got.softmax(-1)
    assert torch.isfinite(probs).all()
    with pytest.raises(NonFiniteLogits):
        finite_logits(torch.tensor([[nan, -inf, nan]]))


# ---- a missing figure is "not measured" -------------------------------------------------------------

@pytest.mark.slow
def test_a_held_out_loss_beyond_exp_says_perplexity_not_measured_in_summary_and_report(base, sft, tmp_path):
    """Weights of float32, finite but large: the held-out loss is so large exp() overflows, so the perplexity
    is missing (None in metrics.jsonl). The summary used to crash formatting it."""
    d = variant(base, tmp_path / "ck", lambda t: t["lm_head.weight"].mul_(1e4))
    out = tmp_path / "out"
    result = finetune(d, sft, out)
    assert result.exit_code == 0, result.output
    held = [line for line in result.stdout.splitlines() if "held-out loss" in line and "perplexity" in line]
    assert held and "perplexity not measured" in held[-1], result.stdout
    assert "perplexity not measured" in (out / "report.html").read_text(encoding="utf-8")


def test_measured_formats_a_figure_or_says_not_measured():
    from memplan.units import measured

    assert measured(1234.5, ",.1f") == "1,234.5"
    assert measured(0.25, ".1%") == "25.0%"
    for missing in (None, float("nan"), float("inf"), "x"):
        assert measured(missing, ".4f") == "not measured"

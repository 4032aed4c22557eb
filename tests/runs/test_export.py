"""memplan export --format hf|onnx: transformers and ONNX Runtime compute the trainer's logits (within 1e-4 on
CPU) from what the export wrote, with no custom code; outputs are never overwritten without --force, and a
missing run, an unsupported model or a bad flag is a one-line error. GGUF: tests/runs/test_export_gguf.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app
from runs_helper import one_line_error, tiny_corpus, tiny_run
from trainer.loop import load_trained

TEXT = "Story 7. Once upon a time a fox walked to the river. It met an owl."
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    corpus = tiny_corpus(root)
    return {
        "llama": tiny_run(root / "llama", corpus, arch="llama", steps=8),  # GQA (4 heads, 2 kv), tied
        "llama-untied": tiny_run(root / "llama-untied", corpus, arch="llama", steps=8, tied=False, kv_heads=4),
        "qwen2": tiny_run(root / "qwen2", corpus, arch="llama", steps=8, qkv_bias=True, rope_theta=500.0),
        "gpt2": tiny_run(root / "gpt2", corpus, arch="gpt2", steps=8),
        "gpt2-untied": tiny_run(root / "gpt2-untied", corpus, arch="gpt2", steps=8, tied=False),
        "gpt_neox": tiny_run(root / "gpt_neox", corpus, arch="gpt_neox", steps=8, rotary_pct=0.25, tied=False,
                             rope_theta=500.0),  # a non-default base must reach the runtime
        "llama-mixed": tiny_run(root / "llama-mixed", corpus, arch="llama", steps=2, norm="layernorm"),
    }


def cli(*args):
    return CliRunner().invoke(app, ["export", *args])



def trainer_logits(run, ids):
    model, tok, _ = load_trained(run)
    with torch.no_grad():
        return model(ids).float()


def batch_of(run):
    """Two sequences of different content (one the other reversed), as a (2, T) batch."""
    _, tok, _ = load_trained(run)
    ids = tok.encode(TEXT)
    return torch.tensor([ids, ids[::-1]])


# ---- hf ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,cls", [("llama", "LlamaForCausalLM"), ("llama-untied", "LlamaForCausalLM"),
                                      ("qwen2", "Qwen2ForCausalLM"), ("gpt2", "GPT2LMHeadModel"), ("gpt2-untied", "GPT2LMHeadModel"),
                                      ("gpt_neox", "GPTNeoXForCausalLM")])
def test_transformers_loads_the_hf_export_with_no_custom_code_and_computes_the_trainers_logits(runs, name, cls,
                                                                                               tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    result = cli("--run", str(runs[name]), "--format", "hf", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["arch"] == cls and report["format"] == "hf"
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(
        f["name"] for f in report["files"])
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)
    assert type(model).__name__ == cls
    model.eval()
    ids = batch_of(runs[name])
    with torch.no_grad():
        got = model(ids).logits.float()
    want = trainer_logits(runs[name], ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < TOL


def test_the_hf_export_has_every_weight_once_and_the_trainers_parameter_count(runs, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "hf"
    assert cli("--run", str(runs["llama-untied"]), "--format", "hf", "--out", str(out)).exit_code == 0
    model, _, _ = load_trained(runs["llama-untied"])
    with safe_open(out / "model.safetensors", "pt") as f:
        total = sum(f.get_slice(k).get_shape()[0] * (f.get_slice(k).get_shape() + [1])[1] for k in f.keys())
        assert "lm_head.weight" in f.keys()
    assert total == model.spec.params == sum(p.numel() for p in model.parameters())


def test_the_hf_tokenizer_encodes_and_decodes_as_the_runs_tokenizer(runs, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "hf"
    assert cli("--run", str(runs["llama"]), "--format", "hf", "--out", str(out)).exit_code == 0
    hf_tok = AutoTokenizer.from_pretrained(out)
    _, tok, _ = load_trained(runs["llama"])
    for text in (TEXT, "  two spaces, ünïcödé and <|endoftext|> inside", ""):
        assert hf_tok(text)["input_ids"] == tok.encode(text)
        assert hf_tok.decode(tok.encode(text)) == text
    assert hf_tok.eos_token_id == tok.eot_id


def test_transformers_generate_greedy_continues_as_memplan_generate(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.generate import SamplingConfig, context_window, generate_text

    out = tmp_path / "hf"
    assert cli("--run", str(runs["gpt2"]), "--format", "hf", "--out", str(out)).exit_code == 0
    model, tok, meta = load_trained(runs["gpt2"])
    text, stats = generate_text(model, tok, "Story 3. Once", SamplingConfig(greedy=True, max_new_tokens=12,
                                                                            stop_at_eot=False),
                                window=context_window(model, meta))
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = torch.tensor([tok.encode("Story 3. Once")])
    got = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, min_new_tokens=12)
    assert got[0, prompt.shape[1]:].tolist() == stats.output_ids


def test_dtype_bfloat16_stores_bfloat16_weights(runs, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "hf"
    result = cli("--run", str(runs["llama"]), "--format", "hf", "--out", str(out), "--dtype", "bfloat16", "--json")
    assert result.exit_code == 0, result.output
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ---- onnx -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_onnx_runtime_computes_the_trainers_logits_for_any_batch_and_length(runs, name, tmp_path):
    import numpy as np
    import onnxruntime as ort

    out = tmp_path / "model.onnx"
    result = cli("--run", str(runs[name]), "--format", "onnx", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input_ids"]
    model, tok, _ = load_trained(runs[name])
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 1), (1, 7), (3, 40), (2, 64)]:  # batch and sequence are dynamic
        ids = torch.randint(0, model.spec.vocab, shape, generator=g)
        got = session.run(["logits"], {"input_ids": ids.numpy()})[0]
        with torch.no_grad():
            want = model(ids).float().numpy()
        assert got.shape == want.shape
        assert np.abs(got - want).max() < TOL, shape


# ---- never overwrite, never leave half a file ---------------------------------------------------------

def test_an_existing_output_is_kept_unless_force(runs, tmp_path):
    out = tmp_path / "hf"
    assert cli("--run", str(runs["llama"]), "--format", "hf", "--out", str(out)).exit_code == 0
    before = (out / "model.safetensors").read_bytes()
    one_line_error(cli("--run", str(runs["gpt2"]), "--format", "hf", "--out", str(out)), "exists", "--force")
    assert (out / "model.safetensors").read_bytes() == before
    assert cli("--run", str(runs["gpt2"]), "--format", "hf", "--out", str(out), "--force").exit_code == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary or old copies left beside it

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"precious")
    one_line_error(cli("--run", str(runs["llama"]), "--format", "gguf", "--out", str(gguf)), "exists", "--force")
    assert gguf.read_bytes() == b"precious"


def test_leftovers_of_a_killed_export_are_cleaned_up_and_others_kept(runs, tmp_path):
    dead = tmp_path / ".model.gguf.tmp-999999999-1"  # no such process
    dead.mkdir()
    (dead / "model.gguf").write_bytes(b"half")
    unrelated = tmp_path / ".model.gguf.backup"
    unrelated.write_bytes(b"mine")
    assert cli("--run", str(runs["llama"]), "--format", "gguf", "--out", str(tmp_path / "model.gguf")).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.gguf.backup", "model.gguf"]


def test_checkpoint_exports_an_older_step(runs, tmp_path):
    older = sorted((runs["llama"] / "checkpoints").iterdir())[0]
    result = cli("--run", str(runs["llama"]), "--checkpoint", str(older), "--format", "hf", "--out",
                 str(tmp_path / "hf"), "--json")
    assert result.exit_code == 0, result.output
    step = json.loads((older / "meta.json").read_text())["step"]
    assert json.loads(result.stdout)["step"] == step < json.loads(
        (sorted((runs["llama"] / "checkpoints").iterdir())[-1] / "meta.json").read_text())["step"]


def test_force_never_replaces_a_directory_an_export_did_not_write(runs, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    one_line_error(cli("--run", str(runs["llama"]), "--format", "hf", "--out", str(mine), "--force"),
                   "refusing to replace")
    assert (mine / "notes.txt").read_text() == "keep me"
    one_line_error(cli("--run", str(runs["llama"]), "--format", "onnx", "--out", str(mine), "--force"),
                   "is a directory")


def test_a_failed_export_leaves_nothing_behind(runs, tmp_path):
    """A model no format takes fails before writing; the output directory gets no temporary files."""
    one_line_error(cli("--run", str(runs["llama-mixed"]), "--format", "hf", "--out", str(tmp_path / "x")),
                   "norm='layernorm'", "exportable families", "llama (RMSNorm")
    assert list(tmp_path.iterdir()) == []


# ---- bad input ----------------------------------------------------------------------------------------

def test_a_missing_or_incomplete_run_is_a_clear_error(runs, tmp_path):
    import shutil

    one_line_error(cli("--run", str(tmp_path / "nowhere"), "--format", "hf", "--out", str(tmp_path / "o")),
                   "no such directory")
    (tmp_path / "empty").mkdir()
    one_line_error(cli("--run", str(tmp_path / "empty"), "--format", "gguf", "--out", str(tmp_path / "o.gguf")),
                   "no checkpoint")
    broken = tmp_path / "broken"
    shutil.copytree(runs["llama"], broken)
    newest = sorted((broken / "checkpoints").iterdir())[-1]
    (newest / "tokenizer.json").unlink()
    one_line_error(cli("--run", str(broken), "--format", "hf", "--out", str(tmp_path / "o")), "tokenizer.json",
                   "missing")
    (newest / "model.safetensors").write_bytes(b"truncated")
    one_line_error(cli("--run", str(broken), "--format", "hf", "--out", str(tmp_path / "o")), "model.safetensors")
    assert not (tmp_path / "o").exists()


def test_a_missing_optional_package_names_what_to_install(runs, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    one_line_error(cli("--run", str(runs["llama"]), "--format", "gguf", "--out", str(tmp_path / "m.gguf")),
                   "pip install gguf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,needle", [(["--format", "safetensors"], "hf, gguf, onnx"),
                                         (["--format", "hf", "--dtype", "fp8"], "float32, float16, bfloat16"),
                                         (["--format", "onnx", "--dtype", "float16"], "onnx"),
                                         (["--format", "hf", "--dtype", "q8_0"], "only in GGUF")])
def test_bad_flags_are_one_line_errors(runs, tmp_path, args, needle):
    one_line_error(cli("--run", str(runs["llama"]), "--out", str(tmp_path / "o"), *args), needle)

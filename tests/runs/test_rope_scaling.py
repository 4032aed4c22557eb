"""RoPE scaling (llama3, linear, dynamic NTK, yarn) in memplan's own model: a tiny LlamaForCausalLM that
transformers writes with each scaling imports with transformers' logits (within 1e-4, fp32) at a length beyond
the scaling's original context, exports back to a config.json transformers computes the same logits from, and
finetunes with LoRA; GGUF carries what llama.cpp can compute and refuses the rest in one line; an unsupported
rope type is one line, exit 2. The shipped config.json presets (SmolLM2-135M, Qwen2.5-0.5B, Llama-3.2-1B)
estimate, autotune, and train from a tiny random checkpoint with their own RoPE settings."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runs_helper import one_line_error  # noqa: E402
from test_hf_import import SHAPE, TOL, VOCAB, tokenizer, write_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()
THETA = 500.0  # a small base: 16-wide heads then have wavelengths on both sides of llama3's and yarn's bounds
T = 48  # the compared length: beyond dynamic's 32 positions and llama3's and yarn's original 16

# rope_parameters as transformers 5 takes them, and the max_position_embeddings of each
ROPES = {
    "plain": (64, None),
    "linear": (64, {"rope_type": "linear", "factor": 4.0}),
    "dynamic": (32, {"rope_type": "dynamic", "factor": 2.0}),
    "yarn": (64, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "llama3": (128, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 16}),
}
# written into config.json the way older checkpoints (Llama 3.2's own) carry it: ``rope_scaling`` with
# ``type`` or ``rope_type``, rope_theta at the top level; the others as transformers 5 writes them
LEGACY = {"yarn": "type", "llama3": "rope_type"}


def rope_config(kind: str):
    from transformers import LlamaConfig

    max_pos, params = ROPES[kind]
    rope = {"rope_type": "default", "rope_theta": THETA} if params is None else {**params, "rope_theta": THETA}
    return LlamaConfig(**SHAPE, num_key_value_heads=2, vocab_size=VOCAB, eos_token_id=0, bos_token_id=0,
                       max_position_embeddings=max_pos, rope_parameters=rope)


def legacy_config_json(directory: Path, type_key: str) -> None:
    """config.json's rope_parameters rewritten as an older transformers (and Llama 3.2's Hub config) has it."""
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    cfg["rope_scaling"] = {**rope, type_key: kind}
    path.write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    tok = tokenizer()
    out = {}
    for kind in ROPES:
        out[kind] = (root / kind, write_checkpoint(root / kind, rope_config(kind), tok))
        if kind in LEGACY:
            legacy_config_json(root / kind, LEGACY[kind])
    return out


def ids(n: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def memplan_model(directory: Path, **spec_changes):
    from trainer import checkpoint_format as ckpt
    from trainer.hf_import import import_hf
    from trainer.model import build_model

    imported = import_hf(directory)
    spec = dataclasses.replace(imported.spec, **spec_changes)
    model = build_model(spec, "sdpa", "none", torch.float32)
    ckpt.load_weights(model, imported.tensors, str(directory))
    return model.eval(), imported


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ---- the imported model computes transformers' logits ----------------------------------------------------

@pytest.mark.parametrize("kind", list(ROPES))
def test_imported_model_computes_transformers_logits_with_each_rope_scaling(checkpoints, kind):
    directory, hf_model = checkpoints[kind]
    model, imported = memplan_model(directory)
    assert imported.spec.rope_type == ("default" if kind == "plain" else kind)
    with torch.no_grad():
        want = hf_model(ids()).logits
        got = model(ids())
    assert want.abs().max() > 1
    diff = max_diff(got, want)
    print(f"{kind}: logits max|diff| {diff:.3g} at T={T}")
    assert diff <= TOL
    if kind != "plain":  # the scaling changes these logits: plain RoPE on the same weights is far off
        plain, _ = memplan_model(directory, rope_scaling=())
        with torch.no_grad():
            assert max_diff(plain(ids()), want) > 1e-2


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2,
     "mscale": 0.707, "mscale_all_dim": 1.414, "truncate": False},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "attention_factor": 1.3},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "dynamic", "factor": 4.0},
])
def test_frequencies_are_transformers_own_bit_for_bit(params):
    """At a real head width (64) and bases, every scaling's inverse frequencies and cos/sin factor equal what
    transformers' ROPE_INIT_FUNCTIONS return, exactly; dynamic's at lengths up to and beyond max positions."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from memplan.model import rope_scaling_pairs
    from trainer.model import rope_frequencies

    for theta in (10000.0, 500000.0):
        config = LlamaConfig(hidden_size=512, num_attention_heads=8, intermediate_size=64, num_hidden_layers=1,
                             max_position_embeddings=2048, rope_parameters={**params, "rope_theta": theta})
        for length in ((1000, 2048, 2049, 5000) if params["rope_type"] == "dynamic" else (None,)):
            seq = torch.tensor(length) if length and length > 2048 else None  # transformers' growth path
            want, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", seq_len=seq)
            got, got_factor = rope_frequencies(64, theta, rope_scaling_pairs(params, "test"), length, 2048)
            assert torch.equal(got, want) and got_factor == want_factor, (params, theta, length)


def test_dynamic_scaling_follows_the_sequence_length(checkpoints):
    """dynamic NTK is plain RoPE up to max_position_embeddings (32) and scales by the sequence's length past it:
    one model, forwards of 24, 48 and 24 tokens again, each as a fresh transformers forward computes it."""
    from transformers import AutoModelForCausalLM

    directory, _ = checkpoints["dynamic"]
    model, _ = memplan_model(directory)
    plain, _ = memplan_model(directory, rope_scaling=())
    for n in (24, T, 24, 40):
        hf_model = AutoModelForCausalLM.from_pretrained(directory).eval()  # fresh: transformers' cache is stateful
        with torch.no_grad():
            want = hf_model(ids(n)).logits
            assert max_diff(model(ids(n)), want) <= TOL
            assert (max_diff(plain(ids(n)), want) <= TOL) == (n <= 32)


def test_the_spec_keeps_the_scaling_hashable_and_round_trips_it(checkpoints):
    from memplan.model import ModelSpec, from_hf_config

    spec = from_hf_config(checkpoints["llama3"][0] / "config.json")
    assert dict(spec.rope_scaling) == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    assert hash(spec) == hash(ModelSpec(**spec.to_dict()))
    assert ModelSpec(**json.loads(json.dumps(spec.to_dict()))) == spec  # as a plan or checkpoint carries it
    yarn = from_hf_config(checkpoints["yarn"][0] / "config.json")  # the legacy "type" key
    assert yarn.rope_type == "yarn" and yarn.rope_theta == THETA
    assert "rope_scaling" not in from_hf_config(checkpoints["plain"][0] / "config.json").to_dict()


# ---- export --format hf: transformers computes the same logits --------------------------------------------

def loaded_run(directory: Path, tmp_path: Path):
    """The imported checkpoint as the exporters take a run (no training: the export of the import)."""
    from trainer.export.common import LoadedRun
    from trainer.hf_import import import_hf

    imported = import_hf(directory)
    return LoadedRun(run_dir=tmp_path / "run", checkpoint=tmp_path / "run" / "step-1", meta={"step": 1},
                     spec=imported.spec, ctx=T, precision="fp32", tensors=imported.tensors,
                     tokenizer_json=(directory / "tokenizer.json").read_text(), eot_id=0, eot_token="<|endoftext|>")


@pytest.mark.parametrize("kind", list(ROPES))
def test_export_hf_carries_the_scaling_transformers_computes(checkpoints, tmp_path, kind):
    from transformers import AutoModelForCausalLM

    from trainer.export.hf import write_hf

    directory, hf_model = checkpoints[kind]
    out = tmp_path / "hf"
    write_hf(loaded_run(directory, tmp_path), out, "float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == (None if kind == "plain" else dict(memplan_model(directory)[1].spec.rope_scaling))
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        diff = max_diff(exported(ids()).logits, hf_model(ids()).logits)
    print(f"{kind}: exported logits max|diff| {diff:.3g}")
    assert diff <= TOL


# ---- export --format gguf: what llama.cpp computes, or one line -------------------------------------------

def test_gguf_writes_llama3_as_rope_freqs_and_linear_and_yarn_as_metadata(checkpoints, tmp_path):
    import gguf

    from trainer.export.gguf import write_gguf

    def fields(kind):
        out = tmp_path / f"{kind}.gguf"
        write_gguf(loaded_run(checkpoints[kind][0], tmp_path), out, "float32")
        reader = gguf.GGUFReader(str(out))
        return ({f.name: f.contents() for f in reader.fields.values()},
                {t.name: t.data.copy() for t in reader.tensors})

    meta, tensors = fields("llama3")
    assert not any(k.startswith("llama.rope.scaling") for k in meta)
    # llama.cpp divides each frequency by its factor: the frequencies are then transformers' llama3 ones
    from trainer.model import rope_frequencies

    spec = memplan_model(checkpoints["llama3"][0])[1].spec
    default, _ = rope_frequencies(spec.rotary_dim, THETA)
    scaled, _ = rope_frequencies(spec.rotary_dim, THETA, spec.rope_scaling)
    factors = torch.from_numpy(tensors["rope_freqs.weight"])
    assert factors.shape == (8,) and factors.max() == 8.0 and 1 < factors.min() < 8  # two blended, six divided
    assert torch.allclose(default / factors, scaled, rtol=1e-5)
    meta, tensors = fields("linear")
    assert meta["llama.rope.scaling.type"] == "linear" and meta["llama.rope.scaling.factor"] == 4.0
    assert "rope_freqs.weight" not in tensors
    meta, _ = fields("yarn")
    assert meta["llama.rope.scaling.type"] == "yarn" and meta["llama.rope.scaling.original_context_length"] == 16


def test_gguf_refuses_dynamic_ntk_in_one_line_writing_nothing(checkpoints, tmp_path):
    from memplan.errors import InputError
    from trainer.export.gguf import write_gguf

    out = tmp_path / "dynamic.gguf"
    with pytest.raises(InputError) as e:
        write_gguf(loaded_run(checkpoints["dynamic"][0], tmp_path), out, "float32")
    assert "rope_type 'dynamic'" in str(e.value) and "accepted for GGUF" in str(e.value)
    assert "\n" not in str(e.value) and not out.exists() and list(tmp_path.glob(".dynamic*")) == []


def test_onnx_refuses_dynamic_ntk_beyond_its_positions_in_one_line(checkpoints, tmp_path):
    """One traced graph cannot recompute dynamic NTK's frequencies per length: a run trained past
    max_position_embeddings (48 > 32) is refused before anything is written."""
    from memplan.errors import InputError
    from trainer.export.onnx import write_onnx

    out = tmp_path / "dynamic.onnx"
    with pytest.raises(InputError, match="dynamic NTK RoPE.*accepted: --format hf"):
        write_onnx(loaded_run(checkpoints["dynamic"][0], tmp_path), out, "float32")
    assert not out.exists() and list(tmp_path.glob(".dynamic*")) == []


# ---- a rope type memplan does not compute -----------------------------------------------------------------

def test_an_unsupported_rope_type_is_one_line_exit_2(checkpoints, tmp_path):
    import shutil

    d = tmp_path / "longrope"
    shutil.copytree(checkpoints["plain"][0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": THETA, "short_factor": [1.0] * 8,
                              "long_factor": [2.0] * 8, "original_max_position_embeddings": 16}
    (d / "config.json").write_text(json.dumps(cfg))
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"prompt": "Which animal?", "response": "The cat."}) + "\n")
    result = runner.invoke(app, ["finetune", "--device", "cpu", "--from", str(d), "--data", str(sft),
                                 "--out", str(tmp_path / "out"), "--max-steps", "1"])
    one_line_error(result, "rope_type 'longrope'", "accepted: default, llama3, linear, dynamic, yarn")
    assert not (tmp_path / "out").exists()
    result = runner.invoke(app, ["estimate", "--model", str(d / "config.json"), "--ctx", "64", "--device", "cpu"])
    one_line_error(result, "rope_type 'longrope'", "accepted: default, llama3, linear, dynamic, yarn")


@pytest.mark.parametrize("rope,needle", [
    ({"rope_type": "llama3", "factor": 8.0}, "rope_type 'llama3' needs low_freq_factor"),
    ({"rope_type": "yarn", "factor": "4", "original_max_position_embeddings": 16}, "factor = '4'"),
    ({"rope_type": "linear", "factor": -2.0}, "factor = -2.0; accepted: a finite number > 0"),
    ({"rope_type": ["linear"], "factor": 2.0}, "rope_type ['linear']"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "truncate": "no"}, "truncate"),
    ("linear", "rope_scaling = 'linear'; accepted: an object with rope_type"),
])
def test_a_bad_rope_scaling_value_is_one_line_naming_the_key(tmp_path, rope, needle):
    path = tmp_path / "config.json"
    cfg = {"model_type": "llama", **SHAPE, "vocab_size": VOCAB, "rope_scaling": rope}
    path.write_text(json.dumps(cfg))
    result = runner.invoke(app, ["estimate", "--model", str(path), "--ctx", "64", "--device", "cpu"])
    one_line_error(result, needle)


# ---- finetune --from a scaled llama, with LoRA, and export -------------------------------------------------

@pytest.mark.slow
def test_lora_finetune_of_a_yarn_llama_exports_the_trained_logits(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.loop import load_trained

    directory, hf_model = checkpoints["yarn"]
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Which animal is {i}?", "response": f"The cat is {i}."}) + "\n"
                           for i in range(20)))
    out, hf_out = tmp_path / "ft", tmp_path / "hf"
    result = runner.invoke(app, ["finetune", "--device", "cpu", "--from", str(directory), "--data", str(sft),
                                 "--out", str(out), "--ctx", "32", "--lora-rank", "4", "--batch", "2",
                                 "--max-steps", "2", "--precision", "fp32", "--lr", "1e-2"])
    assert result.exit_code == 0, result.output
    exported = runner.invoke(app, ["export", "--run", str(out), "--format", "hf", "--out", str(hf_out)])
    assert exported.exit_code == 0, exported.output
    assert json.loads((hf_out / "config.json").read_text())["rope_scaling"]["rope_type"] == "yarn"
    model = AutoModelForCausalLM.from_pretrained(hf_out).eval()
    tuned, _, _ = load_trained(out)
    with torch.no_grad():
        assert max_diff(model(ids()).logits, tuned(ids())) <= TOL
        assert max_diff(hf_model(ids()).logits, tuned(ids())) > 1e-4  # the adapters moved it


# ---- the config.json presets -------------------------------------------------------------------------------

PRESET_CONFIGS = ("smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b")


def test_presets_are_the_shipped_config_json_files():
    from memplan.model import CONFIG_PRESETS, config_preset_path, from_hf_config, preset

    assert set(PRESET_CONFIGS) <= set(CONFIG_PRESETS)
    for name in PRESET_CONFIGS:
        spec = preset(name)
        assert spec == dataclasses.replace(from_hf_config(config_preset_path(name)), name=name, source=spec.source)
        assert spec.source == f"https://huggingface.co/{CONFIG_PRESETS[name]}/blob/main/config.json"
    llama = preset("llama-3.2-1b")
    assert dict(llama.rope_scaling) == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert (llama.rope_theta, llama.max_positions, llama.tied) == (500000.0, 131072, True)
    assert preset("qwen2.5-0.5b").qkv_bias and preset("smollm2-135m").rope_theta == 100000.0


@pytest.mark.parametrize("command", [
    ["estimate", "--model", "llama-3.2-1b", "--ctx", "2k", "--batch", "2", "--device", "a100-80gb", "--json"],
    ["autotune", "--model", "llama-3.2-1b", "--ctx", "2k", "--global-batch-tokens", "64k", "--device", "a100-80gb",
     "--json"],
])
def test_the_llama_3_2_1b_preset_estimates_and_autotunes(command):
    result = runner.invoke(app, command)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"]["params"] == 1_235_814_400


def tiny_of_preset(name: str, out: Path):
    """A tiny random checkpoint of the preset's family, its config.json the preset's own with only the shape
    shrunk: rope_theta, the RoPE scaling, biases and tying stay as the real model has them."""
    from transformers import AutoConfig

    from memplan.model import config_preset_path

    cfg = json.loads(config_preset_path(name).read_text())
    cfg.update(SHAPE, num_key_value_heads=2, vocab_size=VOCAB, eos_token_id=0, bos_token_id=0, head_dim=16)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items()
                                                 if k not in ("architectures", "torch_dtype")})  # fp32 here
    return write_checkpoint(out, config, tokenizer())


@pytest.mark.parametrize("name", PRESET_CONFIGS)
def test_a_tiny_checkpoint_with_the_presets_config_imports_with_its_rope(name, tmp_path):
    from memplan.model import preset

    ck = tmp_path / name
    reference = tiny_of_preset(name, ck)
    model, imported = memplan_model(ck)
    real = preset(name)
    assert (imported.spec.rope_scaling, imported.spec.rope_theta, imported.spec.qkv_bias, imported.spec.tied) == \
        (real.rope_scaling, real.rope_theta, real.qkv_bias, real.tied)
    with torch.no_grad():
        assert max_diff(model(ids()), reference(ids()).logits) <= TOL


@pytest.mark.slow
def test_train_from_a_tiny_llama_3_2_checkpoint_with_its_llama3_rope(tmp_path):
    """Two steps of ``memplan train --from`` on a tiny random checkpoint whose config.json is Llama-3.2-1B's own
    with the shape shrunk (llama3 RoPE ×32 over 8192 positions, rope_theta 500000, tied)."""
    from memplan.model import preset
    from trainer.loop import load_trained

    ck = tmp_path / "llama-3.2-1b"
    reference = tiny_of_preset("llama-3.2-1b", ck)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Story {i}. Once upon a time a fox met an owl by the river.\n\n" for i in range(200)))
    data = tmp_path / "data"
    result = runner.invoke(app, ["prepare", "--input", str(corpus), "--tokenizer", str(ck), "--out", str(data)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", "--device", "cpu", "--sample-tokens", "0", "--from", str(ck), "--data",
                                 str(data), "--out", str(run), "--ctx", "32", "--batch", "2", "--precision", "fp32",
                                 "--max-steps", "2", "--lr", "1e-2"])
    assert result.exit_code == 0, result.output
    tuned, _, _ = load_trained(run)
    assert tuned.spec.rope_scaling == preset("llama-3.2-1b").rope_scaling
    with torch.no_grad():
        assert 1e-4 < max_diff(reference(ids(24)).logits, tuned(ids(24))) < 10  # trained, from the checkpoint

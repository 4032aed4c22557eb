"""Every family memplan plans also trains, finetunes, imports and exports (issue 24).

For each family (llama, mistral, qwen2, gpt2, gpt_neox in memplan's own model; qwen3, gemma, phi, stablelm, and a
llama with llama3 ``rope_scaling`` in transformers' own model class, ``--stack transformers``) a tiny checkpoint
written by transformers' ``save_pretrained`` (safetensors, a BPE tokenizer.json) imports with the logits
transformers computes (max |diff| <= 1e-4, fp32); a LoRA finetune from it exports to a directory
``AutoModelForCausalLM`` loads with the trained logits. A fresh ``train --arch`` of a transformers-only family
trains, resumes, evaluates and generates (its cached decoding the full forward's argmax); hostile checkpoints
(``auto_map``, tensors that do not match config.json, pickle) are one-line errors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runs_helper import one_line_error, tiny_corpus  # noqa: E402
from test_hf_import import (SHAPE, TOL, VOCAB, copy_checkpoint, edit_weights, memplan_model, tokenizer,  # noqa: E402
                            write_checkpoint)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()
MEMPLAN_FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "gpt_neox")
STACK_FAMILIES = ("qwen3", "gemma", "phi", "stablelm", "llama-rope-llama3")  # transformers' model class trains


def configs() -> dict:
    from transformers import (GemmaConfig, GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig, PhiConfig,
                              Qwen2Config, Qwen3Config, StableLmConfig)

    ids = dict(vocab_size=VOCAB, eos_token_id=0, bos_token_id=0)
    return {
        "llama": LlamaConfig(**SHAPE, num_key_value_heads=2, **ids),
        "mistral": MistralConfig(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True, **ids),
        "qwen2": Qwen2Config(**SHAPE, num_key_value_heads=2, **ids),
        "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, **ids),
        "gpt_neox": GPTNeoXConfig(**SHAPE, rotary_pct=0.5, hidden_act="gelu_pytorch_tanh", **ids),
        "qwen3": Qwen3Config(**SHAPE, num_key_value_heads=2, head_dim=16, **ids),  # q/k norms, untied
        "gemma": GemmaConfig(**SHAPE, num_key_value_heads=1, head_dim=32, **ids),  # head_dim its own, tied
        "phi": PhiConfig(**SHAPE, partial_rotary_factor=0.5, **ids),  # parallel block, partial rotary, biases
        "stablelm": StableLmConfig(**SHAPE, num_key_value_heads=2, **ids),  # LayerNorm, partial rotary, GQA
        "llama-rope-llama3": LlamaConfig(**SHAPE, num_key_value_heads=2, max_position_embeddings=256, **ids,
                                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64}),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    tok = tokenizer()
    return {name: (root / name, write_checkpoint(root / name, cfg, tok)) for name, cfg in configs().items()}


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}?", "response": f"The cat {i}."}) + "\n" for i in range(20)))
    return path


def ids_of(n: int = 24, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def stack_flags(name: str) -> list[str]:
    return ["--stack", "transformers"] if name == "llama-rope-llama3" else []


def imported_model(directory: Path, name: str):
    """The checkpoint as memplan trains it: memplan's model, or transformers' class (``trainer.hf_model``)."""
    if name in MEMPLAN_FAMILIES:
        return memplan_model(directory)[0]
    from memplan.setup import TrainSetup
    from trainer import hf_model
    from trainer.finetune import base_of_hf

    imported = base_of_hf(directory, stack="transformers" if stack_flags(name) else None)
    assert imported.hf_config is not None and imported.tensors
    setup = TrainSetup(precision="fp32", stack="transformers")
    return hf_model.build(imported.spec, setup, "cpu", imported.hf_config, weights=imported.tensors).eval()


@pytest.mark.parametrize("name", list(configs()))
def test_imported_checkpoint_computes_transformers_logits(checkpoints, name):
    directory, reference = checkpoints[name]
    model = imported_model(directory, name)
    x = ids_of()
    with torch.no_grad():
        diff = (model(x).float() - reference(x).logits.float()).abs().max().item()
    assert diff <= TOL, f"{name}: max |diff| {diff:.3g}"


def test_the_stack_is_chosen_per_family_with_one_note(checkpoints):
    from trainer import hf_model
    from trainer.finetune import base_of_hf

    for name in ("qwen3", "gemma", "phi", "stablelm"):
        imported = base_of_hf(checkpoints[name][0], weights=False)
        assert imported.hf_config["model_type"] == name
        assert len(imported.notes) == 1 and "transformers' model class" in imported.notes[0]
    assert base_of_hf(checkpoints["llama"][0], weights=False).hf_config is None  # memplan's own, no note
    spec = base_of_hf(checkpoints["qwen3"][0], weights=False).spec
    with pytest.raises(Exception, match="--stack memplan: memplan's own model does not build the qwen3 family"):
        hf_model.choose_stack("memplan", spec)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(configs()))
def test_lora_finetune_then_export_gives_the_trained_logits(checkpoints, sft, tmp_path, name):
    """2 LoRA steps from the checkpoint; the hf export loads in AutoModelForCausalLM with the trained logits,
    which moved off the checkpoint's."""
    from transformers import AutoModelForCausalLM

    from trainer.loop import load_trained

    directory, base = checkpoints[name]
    out = tmp_path / "ft"
    result = runner.invoke(app, ["finetune", "--device", "cpu", "--from", str(directory), "--data", str(sft),
                                 "--out", str(out), "--ctx", "32", "--batch", "2", "--max-steps", "2",
                                 "--eval-every", "2", "--sample-tokens", "0", "--precision", "fp32", "--lr", "5e-2",
                                 "--lora-rank", "4", *stack_flags(name)])
    assert result.exit_code == 0, result.output
    meta = json.loads(next((out / "checkpoints").glob("step-*/meta.json")).read_text())
    assert meta["plan"]["setup"].get("stack", "memplan") == ("memplan" if name in MEMPLAN_FAMILIES
                                                             else "transformers")
    hf_out = tmp_path / "hf"
    exported = runner.invoke(app, ["export", "--run", str(out), "--format", "hf", "--out", str(hf_out)])
    assert exported.exit_code == 0, exported.output
    model = AutoModelForCausalLM.from_pretrained(hf_out).eval()
    tuned, _, _ = load_trained(out)
    x = ids_of()
    with torch.no_grad():
        trained = tuned(x).float()
        assert (model(x).logits.float() - trained).abs().max().item() <= TOL
        assert (base(x).logits.float() - trained).abs().max().item() > 1e-3


@pytest.mark.slow
def test_a_fresh_qwen3_trains_resumes_evaluates_generates_and_refuses_gguf(tmp_path):
    from trainer.generate import SamplingConfig, generate_ids
    from trainer.loop import load_trained

    corpus = tiny_corpus(tmp_path)
    out = tmp_path / "run"
    flags = ["--device", "cpu", "--sample-tokens", "0"]
    result = runner.invoke(app, ["train", *flags, "--data", str(corpus), "--out", str(out), "--arch", "qwen3",
                                 "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
                                 "--ctx", "32", "--batch", "2", "--precision", "fp32", "--max-steps", "2",
                                 "--save-every", "2", "--eval-every", "2"])
    assert result.exit_code == 0, result.output
    assert "transformers' model class trains in memplan's loop" in " ".join(result.output.split())
    result = runner.invoke(app, ["train", *flags, "--out", str(out), "--resume", "--max-steps", "3"])
    assert result.exit_code == 0, result.output
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") == "train"]
    assert steps == [1, 2, 3]
    result = runner.invoke(app, ["eval", "--run", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["eval_loss"] > 0
    model, tokenizer, meta = load_trained(out)
    assert type(model.net).__name__ == "Qwen3ForCausalLM" and meta["hf_config"]["model_type"] == "qwen3"
    prompt = tokenizer.encode("Story 3. Once upon")
    got = [t[0] for t in generate_ids(model, prompt, SamplingConfig(max_new_tokens=6, greedy=True), window=32)]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):  # the full forward's argmax, position by position
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert got == ids[len(prompt):]
    line = one_line_error(runner.invoke(app, ["export", "--run", str(out), "--format", "gguf", "--out",
                                              str(tmp_path / "m.gguf")]), "--format hf", "convert_hf_to_gguf.py")
    assert "qwen3" in line and not (tmp_path / "m.gguf").exists()


# ---- hostile checkpoints: one line, exit 2, nothing written ------------------------------------------------

def _refused(directory, sft, tmp_path, *needles, extra=()):
    out = tmp_path / "out"
    result = runner.invoke(app, ["finetune", "--device", "cpu", "--from", str(directory), "--data", str(sft),
                                 "--out", str(out), "--batch", "2", "--max-steps", "1", *extra])
    line = one_line_error(result, *needles)
    assert not out.exists()
    return line


def test_a_remote_code_config_is_refused(checkpoints, sft, tmp_path):
    d = copy_checkpoint(checkpoints["qwen3"][0], tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "modeling_evil.py").write_text("raise SystemExit('executed')\n")
    _refused(d, sft, tmp_path, "auto_map", "trust_remote_code")


@pytest.mark.parametrize("change, needles", [
    (lambda t: t.pop("model.layers.1.self_attn.q_norm.weight"), ("tensor model.layers.1.self_attn.q_norm.weight",
                                                                 "missing")),
    (lambda t: t.__setitem__("model.layers.0.self_attn.k_norm.weight", torch.ones(32)),
     ("model.layers.0.self_attn.k_norm.weight", "[32]", "[16]")),
    (lambda t: t.__setitem__("model.layers.9.mlp.up_proj.weight", torch.ones(2, 2)),
     ("model.layers.9.mlp.up_proj.weight", "not part of the model")),
])
def test_tensors_that_do_not_match_the_config_are_refused(checkpoints, sft, tmp_path, change, needles):
    d = copy_checkpoint(checkpoints["qwen3"][0], tmp_path / "ck")
    edit_weights(d, change)
    _refused(d, sft, tmp_path, *needles)


def test_pickle_weights_of_a_transformers_family_are_refused(checkpoints, sft, tmp_path):
    d = copy_checkpoint(checkpoints["gemma"][0], tmp_path / "ck")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    _refused(d, sft, tmp_path, "pytorch_model.bin", "safetensors")


def test_fsdp_is_refused_for_transformers_model_class():
    from memplan.setup import TrainSetup
    from trainer.hf_model import check_stack_setup

    with pytest.raises(Exception, match="--sharding fsdp is not wrapped"):
        check_stack_setup(TrainSetup(world_size=2, sharding="fsdp", stack="transformers"))
    check_stack_setup(TrainSetup(world_size=2, sharding="ddp", stack="transformers"))


# ---- the presets of transformers' families: the real shape planned, a tiny one of the family trained ------------

PRESETS = ("qwen3-0.6b", "gemma-2b", "phi-2")


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_is_its_published_config_and_plans_with_transformers(name):
    from test_families import PUBLISHED

    from memplan.model import CONFIG_PRESETS, config_preset_path, preset

    spec = preset(name)
    published = json.loads(config_preset_path(name).read_text())
    assert CONFIG_PRESETS[name] in spec.source and spec.arch == published["model_type"]
    def kv(cfg):  # None: one key/value head per query head (PhiConfig's default)
        return cfg.get("num_key_value_heads") or cfg["num_attention_heads"]

    assert kv(published) == kv(PUBLISHED[name][0])
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        assert published[key] == PUBLISHED[name][0][key]
    assert abs(spec.params / 1e9 - PUBLISHED[name][1]) < 0.01  # the model card's size
    est = runner.invoke(app, ["estimate", "--model", name, "--stack", "transformers", "--device", "h100-sxm",
                              "--ctx", "2048", "--batch", "1", "--precision", "bf16-mixed", "--json"])
    assert est.exit_code == 0, est.output
    assert json.loads(est.output)["memory"]["peak_reserved"] > spec.params * 16  # weights, grads, AdamW
    tuned = runner.invoke(app, ["autotune", "--model", name, "--stack", "transformers", "--device", "h100-sxm",
                                "--ctx", "2048", "--json"])
    assert tuned.exit_code == 0, tuned.output
    assert json.loads(tuned.output)["plan"]["micro_batch"] >= 1
    one_line_error(runner.invoke(app, ["estimate", "--model", name, "--device", "h100-sxm"]), "--stack transformers")


def tiny_of(name: str):
    """The preset's own config.json, shrunk to 2 layers of hidden 64: a random model of the same family."""
    from transformers import AutoConfig

    from memplan.model import config_preset_path

    cfg = json.loads(config_preset_path(name).read_text())
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]  # None: one per query head (phi-2)
    heads, kv = 4, max(1, 4 * kv_heads // cfg["num_attention_heads"])
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
               num_key_value_heads=kv, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=None,
               max_position_embeddings=128)
    if "head_dim" in cfg:
        cfg["head_dim"] = 16
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = 2
    dropped = ("_name_or_path", "torch_dtype", "dtype")  # the tiny one in fp32, as the test computes
    return AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in dropped})


@pytest.mark.slow
def test_each_preset_family_trains_two_steps_from_a_tiny_random_checkpoint(tmp_path):
    from test_train_from import prepare

    tok = tokenizer()
    for i, name in enumerate(PRESETS):
        directory = tmp_path / name
        base = write_checkpoint(directory, tiny_of(name), tok)
        data = prepare(tmp_path, str(directory), name=f"data-{name}")
        out = tmp_path / f"run-{name}"
        result = runner.invoke(app, ["train", "--device", "cpu", "--sample-tokens", "0", "--from", str(directory),
                                     "--data", str(data), "--out", str(out), "--ctx", "32", "--batch", "2",
                                     "--precision", "fp32", "--max-steps", "2", "--lr", "1e-9"])
        assert result.exit_code == 0, result.output
        from trainer.loop import load_trained

        model, _, meta = load_trained(out)
        assert meta["step"] == 2 and meta["plan"]["setup"]["stack"] == "transformers"
        x = ids_of()
        with torch.no_grad():  # it started from the checkpoint's weights (a learning rate of 1e-9 keeps them)
            assert (model(x).float() - base(x).logits.float()).abs().max().item() <= TOL

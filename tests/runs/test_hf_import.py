"""memplan finetune --from DIR: a Hugging Face checkpoint (llama, mistral, qwen2, gpt2, gpt_neox) written by
transformers' own save_pretrained imports with the logits transformers computes (within 1e-4, fp32), finetunes,
and exports back to a directory transformers loads; a missing, extra or misshapen tensor, an unsupported model,
a missing tokenizer.json and a Hub id that is not in the cache and cannot be fetched are one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runs_helper import one_line_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()
TOL = 1e-4
VOCAB = 300
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def configs():
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen2Config

    ids = dict(vocab_size=VOCAB, eos_token_id=0, bos_token_id=0)
    return {
        "llama": LlamaConfig(**SHAPE, num_key_value_heads=2, rope_theta=500.0, **ids),  # GQA, untied
        "llama-tied-bias": LlamaConfig(**SHAPE, num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                                       mlp_bias=True, **ids),
        "mistral": MistralConfig(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True, **ids),
        "qwen2": Qwen2Config(**SHAPE, num_key_value_heads=2, rope_theta=2000.0, **ids),
        "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, **ids),  # Conv1D, tied
        "gpt_neox": GPTNeoXConfig(**SHAPE, rotary_pct=0.5, rotary_emb_base=500, hidden_act="gelu_pytorch_tanh",
                                  **ids),
    }


def tokenizer():
    """A byte-level BPE of VOCAB tokens, <|endoftext|> its id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [f"Story {i}. Once upon a time a fox met an owl by the river. Which animal is {i}? The cat."
             for i in range(200)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return tok


def write_checkpoint(out: Path, config, tok, seed: int = 0, **save) -> "torch.nn.Module":
    """A random model of ``config`` (weights of order one, so a wrong layout shows in the logits) written by
    transformers' save_pretrained, with ``tok`` as its tokenizer.json."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif name.endswith("weight"):  # norms
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(out, **save)
    tok.save(str(out / "tokenizer.json"))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    tok = tokenizer()
    return {name: (root / name, write_checkpoint(root / name, cfg, tok)) for name, cfg in configs().items()}


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Which animal is {i}?", "response": f"The cat is {i}."}) + "\n"
                            for i in range(20)))
    return path


def memplan_model(directory):
    from trainer import checkpoint_format as ckpt
    from trainer.hf_import import import_hf
    from trainer.model import build_model

    imported = import_hf(directory)
    model = build_model(imported.spec, "sdpa", "none", torch.float32)
    ckpt.load_weights(model, imported.tensors, str(directory))
    return model.eval(), imported


def finetune(*args):
    return runner.invoke(app, ["finetune", "--device", "cpu", *args])


def copy_checkpoint(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def edit_weights(directory: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


# ---- the import computes what transformers computes -------------------------------------------------

@pytest.mark.parametrize("name", list(configs()))
def test_imported_model_computes_transformers_logits(checkpoints, name):
    directory, hf_model = checkpoints[name]
    model, imported = memplan_model(directory)
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(ids).logits.float()
        got = model(ids).float()
    assert want.abs().max() > 1  # weights of order one: a wrong layout would be far off
    assert (got - want).abs().max().item() < TOL
    assert imported.tokenizer.eot_id == 0 and imported.tokenizer.eot_token == "<|endoftext|>"


def test_rope_parameters_of_transformers_5_reach_the_spec(checkpoints):
    _, imported = memplan_model(checkpoints["qwen2"][0])
    assert imported.spec.rope_theta == 2000.0 and imported.spec.qkv_bias
    _, imported = memplan_model(checkpoints["gpt_neox"][0])
    assert imported.spec.rope_theta == 500.0 and imported.spec.rotary_pct == 0.5  # not the 0.25 default
    _, imported = memplan_model(checkpoints["mistral"][0])
    assert imported.max_ctx == 4096  # MistralConfig's sliding window caps the context


def test_a_sharded_checkpoint_imports_as_the_single_file(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    directory, hf_model = checkpoints["llama"]
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="100KB")
    (sharded / "tokenizer.json").write_bytes((directory / "tokenizer.json").read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    _, whole = memplan_model(directory)
    _, parts = memplan_model(sharded)
    assert whole.tensors.keys() == parts.tensors.keys()
    assert all(torch.equal(whole.tensors[k], parts.tensors[k]) for k in whole.tensors)
    AutoModelForCausalLM.from_pretrained(sharded)  # transformers reads the same shards


def test_import_inverts_the_hf_export_exactly():
    """canonical -> trainer/export/hf.py's hf_tensors -> import gives the canonical tensors back, bit for bit."""
    from safetensors.torch import save_file

    from trainer.export.hf import hf_tensors
    from trainer.hf_import import read_weights
    from trainer.model import build_model
    from runs_helper import tiny_spec

    for arch, extra in (("llama", {}), ("llama", {"qkv_bias": True, "tied": False}), ("gpt2", {"tied": False}),
                        ("gpt_neox", {"rotary_pct": 0.25})):
        spec = tiny_spec(arch, VOCAB, **extra)
        torch.manual_seed(0)
        state = {k: torch.randn_like(v) for k, v in build_model(spec, "sdpa", "none", torch.float32).state_dict().items()
                 if not (spec.tied and k == "head.weight")}

        class Run:
            def __init__(self):
                self.spec = spec

            def tensor(self, name):
                return state["embed.weight"] if name == "head.weight" and spec.tied else state[name]

        import tempfile

        with tempfile.TemporaryDirectory() as d:
            save_file({k: v.contiguous() for k, v in hf_tensors(Run()).items()}, str(Path(d) / "model.safetensors"))
            back, dtype = read_weights(Path(d), spec)
        assert back.keys() == state.keys() and dtype == "float32"
        assert all(torch.equal(back[k], state[k]) for k in state), (arch, extra)


# ---- finetune --from, then export ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "gpt_neox"])
def test_finetune_from_a_checkpoint_then_export_loads_in_transformers(checkpoints, sft, tmp_path, name):
    from transformers import AutoModelForCausalLM

    directory, _ = checkpoints[name]
    out = tmp_path / "ft"
    result = finetune("--from", str(directory), "--data", str(sft), "--out", str(out), "--ctx", "32",
                      "--batch", "2", "--max-steps", "5", "--save-every", "5", "--eval-every", "5",
                      "--precision", "fp32", "--lr", "1e-3")
    assert result.exit_code == 0, result.output
    meta = json.loads(next((out / "checkpoints").glob("step-*/meta.json")).read_text())
    assert meta["step"] == 5 and meta["finetune"]["base_hf"]["model_type"] == name
    assert meta["tokenizer"]["eot_id"] == 0 and meta["plan"]["model"]["vocab"] == VOCAB
    losses = [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()
              if json.loads(l).get("kind") == "train"]
    assert len(losses) == 5
    hf_out = tmp_path / "hf"
    exported = runner.invoke(app, ["export", "--run", str(out), "--format", "hf", "--out", str(hf_out)])
    assert exported.exit_code == 0, exported.output
    model = AutoModelForCausalLM.from_pretrained(hf_out).eval()
    from trainer.loop import load_trained

    tuned, _, _ = load_trained(out)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(ids).logits.float() - tuned(ids).float()).abs().max().item() < TOL
    base, _ = memplan_model(directory)
    with torch.no_grad():  # the finetune started from the checkpoint and moved off it
        assert (base(ids) - tuned(ids)).abs().max().item() > 1e-3


def test_lora_finetune_from_a_checkpoint_resumes_with_from(checkpoints, sft, tmp_path):
    directory, _ = checkpoints["mistral"]
    out = tmp_path / "ft"
    args = ["--from", str(directory), "--data", str(sft), "--out", str(out), "--ctx", "32"]
    result = finetune(*args, "--lora-rank", "4", "--batch", "2", "--max-steps", "2", "--save-every", "2",
                      "--precision", "fp32")
    assert result.exit_code == 0, result.output
    result = finetune(*args, "--resume", "--max-steps", "3")
    assert result.exit_code == 0, result.output
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(l).get("kind") == "train"]
    assert steps == [1, 2, 3]


# ---- hostile inputs: one line, exit 2, nothing written ------------------------------------------------

def _refused(directory, sft, tmp_path, *needles, extra=()):
    out = tmp_path / "out"
    result = finetune("--from", str(directory), "--data", str(sft), "--out", str(out), "--batch", "2",
                      "--max-steps", "1", *extra)
    line = one_line_error(result, *needles)
    assert not out.exists()
    return line


def test_a_missing_tensor_is_refused_naming_it(checkpoints, sft, tmp_path):
    d = copy_checkpoint(checkpoints["llama"][0], tmp_path / "ck")
    edit_weights(d, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    _refused(d, sft, tmp_path, "tensor model.layers.1.self_attn.k_proj.weight is missing")


def test_an_untied_model_without_its_head_is_refused(checkpoints, sft, tmp_path):
    d = copy_checkpoint(checkpoints["gpt_neox"][0], tmp_path / "ck")
    edit_weights(d, lambda t: t.pop("embed_out.weight"))
    _refused(d, sft, tmp_path, "tensor embed_out.weight is missing")


def test_an_extra_tensor_is_refused_naming_it(checkpoints, sft, tmp_path):
    d = copy_checkpoint(checkpoints["qwen2"][0], tmp_path / "ck")
    edit_weights(d, lambda t: t.update({"model.layers.2.mlp.down_proj.weight": torch.zeros(64, 128)}))
    _refused(d, sft, tmp_path, "tensor model.layers.2.mlp.down_proj.weight is not part of the model")


def test_a_wrong_shape_is_refused_naming_the_tensor(checkpoints, sft, tmp_path):
    d = copy_checkpoint(checkpoints["gpt2"][0], tmp_path / "ck")
    edit_weights(d, lambda t: t.update({"transformer.h.0.attn.c_attn.weight": torch.zeros(192, 64)}))
    _refused(d, sft, tmp_path, "tensor transformer.h.0.attn.c_attn.weight has shape [192, 64]", "[64, 192]")


def test_an_unsupported_model_type_is_refused(checkpoints, sft, tmp_path):
    d = copy_checkpoint(checkpoints["llama"][0], tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "mixtral"}))
    _refused(d, sft, tmp_path, "'mixtral'", "llama, mistral, qwen2, gpt2, gpt_neox")


def test_a_scaled_rope_missing_a_key_is_refused(checkpoints, sft, tmp_path):
    """llama3 RoPE imports (tests/runs/test_rope_scaling.py); one without its low_freq_factor is one line naming it."""
    d = copy_checkpoint(checkpoints["llama"][0], tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0}
    (d / "config.json").write_text(json.dumps(cfg))
    _refused(d, sft, tmp_path, "rope_type 'llama3' needs low_freq_factor")


def test_a_missing_tokenizer_is_refused(checkpoints, sft, tmp_path):
    d = copy_checkpoint(checkpoints["gpt_neox"][0], tmp_path / "ck")
    (d / "tokenizer.json").unlink()
    _refused(d, sft, tmp_path, "no tokenizer.json")


def test_pickle_weights_are_refused(checkpoints, sft, tmp_path):
    d = copy_checkpoint(checkpoints["gpt2"][0], tmp_path / "ck")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    _refused(d, sft, tmp_path, "pytorch_model.bin", "safetensors only")


def test_a_hub_id_absent_from_the_cache_names_the_cache(sft, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network in tests: the fetch is refused as offline
    monkeypatch.chdir(tmp_path)
    _refused("EleutherAI/pythia-14m", sft, tmp_path, "EleutherAI/pythia-14m", str(cache), "HF_HUB_OFFLINE")


def test_a_hub_id_in_the_cache_is_used(checkpoints, tmp_path, monkeypatch):
    import shutil

    from huggingface_hub import constants

    from trainer.hf_import import import_hf

    cache = tmp_path / "hub-cache"
    snap = cache / "models--acme--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(checkpoints["llama"][0], snap)
    (cache / "models--acme--tiny-llama" / "refs").mkdir()
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    assert import_hf("acme/tiny-llama").path == snap


def test_run_and_from_together_or_neither_are_refused(checkpoints, sft, tmp_path):
    result = finetune("--data", str(sft), "--out", str(tmp_path / "o"))
    one_line_error(result, "--run", "--from", "exactly one")
    result = finetune("--run", str(tmp_path), "--from", str(checkpoints["llama"][0]), "--data", str(sft),
                      "--out", str(tmp_path / "o"))
    one_line_error(result, "exactly one")


def test_ctx_beyond_the_sliding_window_is_refused(checkpoints, sft, tmp_path):
    _refused(checkpoints["mistral"][0], sft, tmp_path, "--ctx 8192", "4096", extra=("--ctx", "8192"))


def test_exact_gelu_is_said_not_hidden(tmp_path, sft):
    from transformers import GPTNeoXConfig

    d = tmp_path / "neox-erf"
    write_checkpoint(d, GPTNeoXConfig(**SHAPE, vocab_size=VOCAB, eos_token_id=0, hidden_act="gelu"), tokenizer())
    _, imported = memplan_model(d)
    assert any("exact erf" in n for n in imported.notes)


def test_gpt2s_own_layout_without_prefix_and_with_old_buffers_imports(checkpoints, tmp_path):
    """The Hub's gpt2 files: base-model names (h.0..., wte), attn.bias buffers, a tied lm_head stored anyway."""
    d = copy_checkpoint(checkpoints["gpt2"][0], tmp_path / "ck")

    def legacy(t):
        for k in list(t):
            t[k.removeprefix("transformer.")] = t.pop(k)
        t["h.0.attn.bias"] = torch.ones(1, 1, 128, 128)
        t["lm_head.weight"] = t["wte.weight"].clone()
    edit_weights(d, legacy)
    _, want = memplan_model(checkpoints["gpt2"][0])
    _, got = memplan_model(d)
    assert got.tensors.keys() == want.tensors.keys()
    assert all(torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)


def test_a_lora_finetune_from_a_checkpoint_exports_with_its_adapters_folded_in(checkpoints, sft, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.loop import load_trained

    out, hf_out = tmp_path / "ft", tmp_path / "hf"
    result = finetune("--from", str(checkpoints["gpt_neox"][0]), "--data", str(sft), "--out", str(out), "--ctx", "32",
                      "--lora-rank", "4", "--batch", "2", "--max-steps", "3", "--precision", "fp32", "--lr", "1e-2")
    assert result.exit_code == 0, result.output
    exported = runner.invoke(app, ["export", "--run", str(out), "--format", "hf", "--out", str(hf_out)])
    assert exported.exit_code == 0, exported.output
    model = AutoModelForCausalLM.from_pretrained(hf_out).eval()
    tuned, _, _ = load_trained(out)
    base, _ = memplan_model(checkpoints["gpt_neox"][0])
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(ids).logits.float() - tuned(ids).float()).abs().max().item() < TOL
        assert (base(ids) - tuned(ids)).abs().max().item() > 1e-4  # the adapters moved it


def test_a_missing_path_is_not_taken_for_a_hub_id(sft, tmp_path):
    line = _refused(tmp_path / "nowhere", sft, tmp_path, "no such directory")
    assert "hf download" not in line


def test_a_checkpoint_that_ends_text_with_its_own_token_keeps_it_after_the_finetune(sft, tmp_path):
    """config.json's eos_token_id names <|im_end|> (as Qwen's instruct models do), not the <|endoftext|> the
    vocabulary also holds: the finetune trains with that end-of-text id, and load_trained (generate, eval,
    export) must read it back from the checkpoint's record rather than guess <|endoftext|> from the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig

    from trainer.loop import load_trained

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([f"Which animal is {i}? The cat is {i}." for i in range(200)],
                            trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end != tok.token_to_id("<|endoftext|>")
    directory = tmp_path / "instruct"
    write_checkpoint(directory, LlamaConfig(**SHAPE, num_key_value_heads=2, vocab_size=VOCAB, eos_token_id=im_end,
                                            bos_token_id=0), tok)
    out = tmp_path / "ft"
    result = finetune("--from", str(directory), "--data", str(sft), "--out", str(out), "--ctx", "32", "--batch", "2",
                      "--max-steps", "2", "--save-every", "2", "--eval-every", "2", "--precision", "fp32",
                      "--sample-tokens", "0")
    assert result.exit_code == 0, result.output
    meta = json.loads(next((out / "checkpoints").glob("step-*/meta.json")).read_text())
    assert meta["tokenizer"]["eot_id"] == im_end
    _, tokenizer, _ = load_trained(out)
    assert (tokenizer.eot_id, tokenizer.eot_token) == (im_end, "<|im_end|>")


def test_a_recorded_end_of_text_token_the_tokenizer_lacks_is_refused(tmp_path):
    from memplan.errors import InputError
    from trainer.tokenizer import Tokenizer

    path = tmp_path / "tokenizer.json"
    tokenizer().save(str(path))
    tok = Tokenizer.from_file(path)
    assert tok.as_recorded({"eot_token": tok.eot_token, "eot_id": tok.eot_id}, "t") is tok
    with pytest.raises(InputError, match="not in its tokenizer"):
        tok.as_recorded({"eot_token": "<|im_end|>", "eot_id": 7}, str(path))
    assert tok.as_recorded({"vocab_size": VOCAB + 64}, "t").vocab_size == VOCAB + 64  # a padded embedding


def test_estimate_reads_the_rope_settings_transformers_5_writes(tmp_path):
    """transformers 5 writes RoPE's base and rotary share only inside ``rope_parameters``: the planner's
    ``from_hf_config`` (estimate --model, autotune --out, train --plan) reads them there, as the importer does."""
    from transformers import GPTNeoXConfig, LlamaConfig

    from memplan.model import from_hf_config

    LlamaConfig(**SHAPE, num_key_value_heads=2, vocab_size=VOCAB, rope_theta=500000.0).save_pretrained(tmp_path / "l")
    assert "rope_theta" not in json.loads((tmp_path / "l" / "config.json").read_text())  # only in rope_parameters
    assert from_hf_config(tmp_path / "l" / "config.json").rope_theta == 500000.0
    GPTNeoXConfig(**SHAPE, vocab_size=VOCAB, rotary_pct=0.5, rotary_emb_base=500).save_pretrained(tmp_path / "n")
    spec = from_hf_config(tmp_path / "n" / "config.json")
    assert (spec.rope_theta, spec.rotary_pct) == (500.0, 0.5)
    for name in ("l", "n"):  # and the importer agrees with the planner
        from trainer.hf_import import read_spec

        imported = read_spec(tmp_path / name)[1]
        planned = from_hf_config(tmp_path / name / "config.json")
        assert (imported.rope_theta, imported.rotary_pct) == (planned.rope_theta, planned.rotary_pct)

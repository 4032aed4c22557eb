"""ModelSpec: exact parameter counts of published models, where shapes come from, and bad shapes."""

import json

import pytest

from memplan.errors import InputError
from memplan.model import CONFIG_PRESETS, PRESETS, SIZE_TABLE, ModelSpec, from_hf_config, from_size, preset, resolve

# Parameter counts published with (or computed by transformers from) each model's weights.
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "tinyllama-1.1b": 1_100_048_384,
    "llama-3.2-1b": 1_235_814_400,
    "llama-2-7b": 6_738_415_616,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-0.5b": 494_032_768,
    "smollm2-135m": 134_515_008,
    "pythia-70m": 70_426_624,
    "pythia-160m": 162_322_944,
}


@pytest.mark.parametrize("name,count", PUBLISHED.items())
def test_preset_parameter_counts_match_the_published_models(name, count):
    assert preset(name).params == count


# config.json files as the Hugging Face Hub serves them (the keys memplan reads).
HF_CONFIGS = {
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "vocab_size": 50257,
             "n_positions": 1024, "layer_norm_epsilon": 1e-5},
    "tinyllama-1.1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                       "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
                       "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048},
    "llama-3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "head_dim": 64,
                     "tie_word_embeddings": True, "rope_theta": 500000.0, "attention_bias": False,
                     "mlp_bias": False},
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32768,
                   "tie_word_embeddings": False},
    "pythia-70m": {"model_type": "gpt_neox", "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6,
                   "num_attention_heads": 8, "vocab_size": 50304, "rotary_pct": 0.25, "use_parallel_residual": True,
                   "tie_word_embeddings": False},
}


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_hf_config_json_gives_the_published_count(tmp_path, name):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_CONFIGS[name]))
    spec = from_hf_config(path)
    expected = PUBLISHED.get(name) or preset(name).params
    if name == "mistral-7b":  # v0.3 has a 32768 vocabulary; the preset (v0.3) matches it
        expected = 7_248_023_552
    assert spec.params == expected


def test_hf_config_errors_name_the_file_and_the_missing_keys(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(InputError, match="missing key.*num_hidden_layers.*intermediate_size"):
        from_hf_config(bad)
    bad.write_text("{ not json")
    with pytest.raises(InputError, match="is not JSON"):
        from_hf_config(bad)
    bad.write_text('{"model_type": "t5"}')
    with pytest.raises(InputError, match="model_type 't5'.*llama, mistral, qwen2, gpt2, gpt_neox"):
        from_hf_config(bad)


def test_hand_counted_llama_block():
    # 2 layers, hidden 128, 4 heads of 32, 2 kv heads (kv width 64), SwiGLU 256, vocab 512, tied
    spec = ModelSpec(arch="llama", layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=512, tied=True)
    attention = 128 * 128 + 2 * 128 * 64 + 128 * 128  # W_q, W_k, W_v, W_o
    mlp = 3 * 128 * 256  # gate, up, down
    norms = 2 * 128
    assert spec.params == 512 * 128 + 2 * (attention + mlp + norms) + 128
    untied = spec.replace(tied=False)
    assert untied.params - spec.params == 512 * 128


def test_hand_counted_gpt2_block_has_biases_layernorm_and_positions():
    spec = ModelSpec(arch="gpt2", layers=1, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100, tied=True,
                     max_positions=32)
    attention = 4 * 64 * 64 + 4 * 64  # q, k, v, o and their biases
    mlp = 2 * 64 * 256 + 256 + 64
    norms = 2 * 2 * 64  # two LayerNorms, weight and bias
    assert spec.params == 100 * 64 + 32 * 64 + attention + mlp + norms + 2 * 64


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
@pytest.mark.parametrize("tied", [True, False])
def test_reference_model_has_exactly_the_planned_parameters(arch, tied):
    from trainer.model import build_model

    spec = ModelSpec(arch=arch, layers=2, hidden=64, heads=4, kv_heads=2 if arch == "llama" else 4, ffn=96,
                     vocab=300, tied=tied, max_positions=64)
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.params
    assert len(list(model.parameters())) == spec.n_tensors


@pytest.mark.parametrize("size", SIZE_TABLE)
def test_every_named_size_resolves_near_its_name(size):
    spec = from_size(size)
    nominal = float(size[:-1]) * (1e9 if size.endswith("b") else 1e6)
    assert 0.8 < spec.params / nominal < 1.1, spec.describe()


@pytest.mark.parametrize("target", [2_000_000, 50_000_000, 200_000_000, 2_000_000_000])
def test_the_size_rule_picks_a_documented_shape_close_to_any_size(target):
    spec = from_size(str(target))
    assert spec.hidden == 64 * spec.layers and spec.head_dim == 64
    neighbours = [ModelSpec(**{**spec.to_dict(), "layers": spec.layers + d, "hidden": 64 * (spec.layers + d),
                               "heads": spec.layers + d, "kv_heads": spec.layers + d if spec.kv_heads == spec.heads
                               else (spec.layers + d) // 4,
                               "ffn": -(-(8 * 64 * (spec.layers + d) // 3) // 256) * 256}).params
                  for d in (-1, 1) if spec.layers + d >= 2]
    assert all(abs(spec.params - target) <= abs(n - target) for n in neighbours)


@pytest.mark.parametrize("kwargs,message", [
    (dict(hidden=2048, heads=7), "--heads 7 does not divide --hidden 2048"),
    (dict(heads=32, kv_heads=5), "--kv-heads 5 does not divide --heads 32"),
    (dict(layers=0), "--layers: 0 must be a positive integer"),
])
def test_inconsistent_shapes_are_refused_with_the_accepted_values(kwargs, message):
    base = dict(arch="llama", layers=2, hidden=2048, heads=32, kv_heads=32, ffn=64, vocab=64, tied=True)
    with pytest.raises(InputError, match=message):
        ModelSpec(**{**base, **kwargs})


def test_overrides_apply_on_top_of_a_preset_and_switch_family_components():
    spec = resolve(model="tinyllama-1.1b", layers=4, vocab=1000)
    assert (spec.layers, spec.vocab, spec.kv_heads) == (4, 1000, 4)
    gpt = resolve(params="22m", arch="gpt2")
    assert (gpt.norm, gpt.pos, gpt.mlp, gpt.bias) == ("layernorm", "learned", "gelu", True)


def test_misspelt_preset_suggests_the_closest():
    with pytest.raises(InputError, match="did you mean.*tinyllama-1.1b"):
        preset("tinylama-1.1b")
    assert set(PRESETS) >= {"gpt2", "tinyllama-1.1b"} and "llama-3.2-1b" in CONFIG_PRESETS


def test_a_config_json_is_named_after_its_model_not_its_directory(tmp_path):
    """`--model path/to/config.json` is not a model called "to" (issue 14)."""
    import json

    from memplan.model import from_hf_config

    cfg = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 512, "vocab_size": 1000}

    def name_of(sub: str, **extra) -> str:
        path = tmp_path / sub / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**cfg, **extra}))
        return from_hf_config(path).name

    assert name_of("path/to") == "llama config"
    assert name_of("a/to", _name_or_path="TinyLlama/TinyLlama_v1.1") == "TinyLlama/TinyLlama_v1.1"
    assert name_of("b/to", _name_or_path="/home/me/ckpts/my-run/") == "my-run"
    assert name_of("hub/models--HuggingFaceTB--SmolLM2-135M/snapshots/" + "0a" * 20) == "HuggingFaceTB/SmolLM2-135M"
    assert name_of("c/my-llama") == "my-llama"

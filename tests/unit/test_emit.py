"""``memplan autotune --emit DIR``: the plan written as transformers', litgpt's and torchtune's own config."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import yaml
from typer.testing import CliRunner

from memplan.cli import app
from memplan.emit import emit, render
from memplan.errors import InputError
from memplan.model import ModelSpec
from memplan.plan import Plan
from memplan.setup import TrainSetup

TINY_LLAMA = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, tied=False,
                       name="tiny")


def run_cli(*args: str):
    return CliRunner().invoke(app, list(args))


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


def plan_of(spec: ModelSpec = TINY_LLAMA, **setup) -> Plan:
    return Plan(model=spec, setup=TrainSetup(**{"ctx": 32, **setup}), device="cpu", budget_bytes=2**30)


def autotune_emit(tmp_path, stack: str, *extra: str):
    out, emitted = tmp_path / "plan.toml", tmp_path / "emitted"
    result = run_cli("autotune", "--params", "22m", "--device", "rtx-4090", "--ctx", "512", "--stack", stack,
                     "--out", str(out), "--emit", str(emitted), "--json", *extra)
    return result, out, emitted


# ---- transformers ----------------------------------------------------------------------------------------

def test_transformers_emit_loads_in_training_arguments_and_the_plan_records_the_stack(tmp_path):
    pytest.importorskip("transformers")  # in the test extra; not in litgpt's or torchtune's environment
    from transformers import TrainingArguments

    result, out, emitted = autotune_emit(tmp_path, "transformers")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert sorted(data["emitted"]) == sorted(str(emitted / n) for n in ("training_args.json", "train.py"))
    plan = Plan.load(out)
    assert plan.stack == "transformers"
    s = plan.setup
    kwargs = json.loads((emitted / "training_args.json").read_text())
    # bf16 on this CPU-only machine needs use_cpu; on the plan's GPU the JSON loads as it is
    args = TrainingArguments(**kwargs, use_cpu=True)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (s.micro_batch, s.grad_accum)
    assert args.bf16 == (s.precision == "bf16-mixed") and args.fp16 == (s.precision == "fp16-mixed")
    assert args.gradient_checkpointing == (s.checkpointing == "full")
    assert args.optim.value == {"adamw": "adamw_torch", "adamw-fused": "adamw_torch_fused"}[s.optimizer]
    assert args.torch_compile == s.compile and args.max_grad_norm == 1.0
    assert not (emitted / "lora_config.json").exists()


def test_transformers_lora_config_and_train_py_train_a_tiny_model(tmp_path):
    """The emitted LoraConfig adapts the modules memplan planned, and train.py builds the model, the
    arguments and the Trainer from the files and takes an optimizer step."""
    pytest.importorskip("transformers")  # in the test extra; not in litgpt's or torchtune's environment
    pytest.importorskip("peft")
    import torch
    import transformers
    from peft import LoraConfig

    plan = plan_of(lora_rank=4, lora_targets="q,v,down", precision="fp32", checkpointing="full", optimizer="sgd",
                   micro_batch=2, grad_accum=2)
    paths = emit(plan, "transformers", tmp_path / "emitted")
    assert [p.name for p in paths] == ["training_args.json", "lora_config.json", "train.py"]
    lora = json.loads((tmp_path / "emitted" / "lora_config.json").read_text())
    assert LoraConfig(**lora).r == 4 and sorted(lora["target_modules"]) == ["down_proj", "q_proj", "v_proj"]

    model_dir = tmp_path / "model"
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    spec = importlib.util.spec_from_file_location("emitted_train", tmp_path / "emitted" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.CTX == 32 and script.LORA is True and script.MODEL_DTYPE == torch.float32

    net = script.build_model(str(model_dir))
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in net.named_parameters() if ".lora_A" in n}
    assert adapted == {"q_proj", "v_proj", "down_proj"}
    args = script.training_args(tmp_path / "run")
    assert args.gradient_checkpointing and args.optim.value == "sgd" and args.optim_args == "momentum=0.9"
    args = transformers.TrainingArguments(**{**json.loads((tmp_path / "emitted" / "training_args.json").read_text()),
                                             "output_dir": str(tmp_path / "run"), "max_steps": 1,
                                             "save_strategy": "no"})
    ids = torch.randint(0, 256, (4, 32)).tolist()
    trainer = script.make_trainer(net, [{"input_ids": x, "labels": x} for x in ids], args)
    before = [p.detach().clone() for n, p in net.named_parameters() if "lora_B" in n]
    trainer.train()
    after = [p for n, p in net.named_parameters() if "lora_B" in n]
    assert trainer.state.global_step == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # the adapters trained


def test_gpt2_lora_targets_are_its_fused_attention_and_conv1d():
    plan = plan_of(ModelSpec(arch="gpt2", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=256, tied=True),
                   lora_rank=2, lora_targets="qkv,proj")
    lora = json.loads(render(plan, "transformers")["lora_config.json"])
    assert lora["target_modules"] == ["attn.c_attn", "attn.c_proj"] and lora["fan_in_fan_out"] is True


def test_pure_bf16_loads_bf16_weights_without_autocast():
    files = render(plan_of(precision="bf16"), "transformers")
    args = json.loads(files["training_args.json"])
    assert args["bf16"] is False and args["fp16"] is False
    assert "MODEL_DTYPE = torch.bfloat16" in files["train.py"]


# ---- litgpt ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision, expected", [("bf16-mixed", "bf16-mixed"), ("bf16", "bf16-true"),
                                                 ("fp32", "32-true"), ("tf32", "32-true")])
def test_litgpt_pretrain_yaml_has_litgpts_keys(precision, expected):
    text = render(plan_of(precision=precision, micro_batch=4, grad_accum=8), "litgpt")["litgpt.yaml"]
    assert text.startswith("# litgpt pretrain --config litgpt.yaml")
    cfg = yaml.safe_load(text)
    assert cfg["precision"] == expected and cfg["devices"] == 1
    assert cfg["train"] == {"global_batch_size": 32, "micro_batch_size": 4, "max_seq_length": 32, "max_norm": 1.0}
    mc = cfg["model_config"]
    assert (mc["n_layer"], mc["n_embd"], mc["n_head"], mc["n_query_groups"], mc["intermediate_size"]) == \
        (2, 64, 4, 2, 128)
    assert mc["norm_class_name"] == "RMSNorm" and mc["mlp_class_name"] == "LLaMAMLP"


def test_litgpt_lora_yaml_is_finetune_loras():
    cfg_text = render(plan_of(lora_rank=8, lora_targets="q,v,up,down", optimizer="adamw-fused"),
                      "litgpt")["litgpt.yaml"]
    assert cfg_text.startswith("# litgpt finetune_lora --config litgpt.yaml")
    cfg = yaml.safe_load(cfg_text)
    assert (cfg["lora_r"], cfg["lora_alpha"], cfg["lora_dropout"]) == (8, 16, 0.05)
    assert {k: cfg[k] for k in ("lora_query", "lora_key", "lora_value", "lora_projection", "lora_mlp",
                                "lora_head")} == dict(lora_query=True, lora_key=False, lora_value=True,
                                                      lora_projection=False, lora_mlp=True, lora_head=False)
    assert cfg["optimizer"] == {"class_path": "torch.optim.AdamW", "init_args": {"fused": True}}
    assert "max_norm" not in cfg["train"] and cfg["checkpoint_dir"] == "checkpoints/tiny"


def test_litgpt_lora_yaml_for_several_devices_is_finetune_loras_fsdp2():
    """``devices: 2`` with LoRA: finetune_lora picks its ModelParallelStrategy itself (FSDP2, every Block
    checkpointed), the walk's --sharding fsdp --checkpointing full; as DDP, or not checkpointed, one line."""
    plan = plan_of(lora_rank=4, world_size=2, sharding="fsdp", checkpointing="full", micro_batch=2, grad_accum=3)
    text = render(plan, "litgpt")["litgpt.yaml"]
    assert text.startswith("# litgpt finetune_lora --config litgpt.yaml") and "ModelParallelStrategy" in text
    cfg = yaml.safe_load(text)
    assert cfg["devices"] == 2 and cfg["train"]["global_batch_size"] == 2 * 3 * 2
    for setup, accepted in (({"sharding": "ddp", "checkpointing": "none"}, "full (LoRA on devices > 1"),
                            ({"sharding": "ddp"}, "fsdp (devices > 1)"), ({"checkpointing": "none"}, "full")):
        with pytest.raises(InputError) as e:
            render(plan_of(**{"lora_rank": 4, "world_size": 2, "sharding": "fsdp", "checkpointing": "full",
                              **setup}), "litgpt")
        assert accepted in str(e.value) and "\n" not in str(e.value)


@pytest.mark.libs
def test_litgpt_yaml_loads_in_litgpts_config_classes():
    pytest.importorskip("litgpt", reason="litgpt is not installed (pip install 'memplan[litgpt]')")
    from litgpt import Config
    from litgpt.args import TrainArgs

    cfg = yaml.safe_load(render(plan_of(micro_batch=2, grad_accum=4), "litgpt")["litgpt.yaml"])
    train = TrainArgs(**cfg["train"])
    assert train.gradient_accumulation_iters(devices=1) == 4
    config = Config(**cfg["model_config"])
    assert config.n_layer == 2 and config.n_query_groups == 2


@pytest.mark.libs
def test_litgpt_yaml_over_several_devices_loads_in_litgpts_config_classes():
    """The FSDP plan over two devices: ``devices: 2`` and a global batch of both devices' micro-batches, which
    litgpt's TrainArgs turns back into the planned accumulation."""
    pytest.importorskip("litgpt", reason="litgpt is not installed (pip install 'memplan[litgpt]')")
    from litgpt.args import TrainArgs

    cfg = yaml.safe_load(render(plan_of(micro_batch=2, grad_accum=1, world_size=2, sharding="fsdp"),
                                "litgpt")["litgpt.yaml"])
    assert cfg["devices"] == 2
    assert TrainArgs(**cfg["train"]).gradient_accumulation_iters(devices=2) == 1


# ---- torchtune -------------------------------------------------------------------------------------------

def test_torchtune_yaml_names_the_recipe_and_its_overrides():
    text = render(plan_of(precision="bf16", checkpointing="full", optimizer="adamw-fused", micro_batch=2,
                          grad_accum=3), "torchtune")["torchtune.yaml"]
    assert text.startswith("# recipe: full_finetune_single_device")
    cfg = yaml.safe_load(text)
    assert (cfg["batch_size"], cfg["gradient_accumulation_steps"], cfg["dtype"]) == (2, 3, "bf16")
    assert cfg["enable_activation_checkpointing"] is True and cfg["compile"] is False
    assert cfg["optimizer"] == {"_component_": "torch.optim.AdamW", "fused": True}
    assert cfg["model"]["_component_"] == "torchtune.models.llama3.llama3" and cfg["model"]["num_kv_heads"] == 2


def test_torchtune_lora_and_distributed_recipes():
    plan = plan_of(lora_rank=4, lora_targets="qkv,proj,up,down,head", precision="fp32", world_size=2,
                   sharding="fsdp")
    text = render(plan, "torchtune")["torchtune.yaml"]
    assert text.startswith("# recipe: lora_finetune_distributed")
    assert "tune run --nproc_per_node 2 lora_finetune_distributed" in text
    model = yaml.safe_load(text)["model"]
    assert model["_component_"] == "torchtune.models.llama3.lora_llama3"
    assert model["lora_attn_modules"] == ["q_proj", "k_proj", "v_proj", "output_proj"]
    assert model["apply_lora_to_mlp"] is True and model["apply_lora_to_output"] is True
    assert (model["lora_rank"], model["lora_alpha"]) == (4, 8.0)
    data = yaml.safe_load(text)  # the FSDP2 layout the walk follows (tt_fsdp_root_reshards_after_forward)
    assert (data["fsdp_reshard_after_forward"], data["fsdp_cpu_offload"], data["custom_sharded_layers"]) == \
        (True, False, None)


@pytest.mark.parametrize("setup, tied, layers", [
    ({}, False, ["tok_embeddings", "output"]),  # the published full-finetune configs' (llama3/8B_full.yaml, ...)
    ({"lora_rank": 4}, False, None),  # commented out in the LoRA configs
    ({}, True, None),  # the tied llama3_2 configs leave it unset: TiedLinear reads the embedding's weight
])
def test_torchtune_distributed_custom_sharded_layers_are_the_walks(setup, tied, layers):
    """The FSDP2 groups the walk plans (``tt_custom_sharded_layers``' auto) are the ones the YAML asks for."""
    import dataclasses

    plan = plan_of(dataclasses.replace(TINY_LLAMA, tied=tied), precision="bf16", world_size=2, sharding="fsdp",
                   **setup)
    assert yaml.safe_load(render(plan, "torchtune")["torchtune.yaml"])["custom_sharded_layers"] == layers


@pytest.mark.libs
def test_torchtune_distributed_yaml_names_modules_torchtunes_shard_conditions_match():
    """The emitted ``custom_sharded_layers``, read by torchtune's config parsing as the recipes read it
    (``cfg.get("custom_sharded_layers", None)``), names modules of the model the YAML instantiates that
    ``training.get_shard_conditions`` matches."""
    pytest.importorskip("torchtune", reason="torchtune is not installed (pip install 'memplan[torchtune]')")
    from omegaconf import OmegaConf
    from torchtune import config, training

    text = render(plan_of(precision="bf16", world_size=2, sharding="fsdp"), "torchtune")["torchtune.yaml"]
    cfg = OmegaConf.create(yaml.safe_load(text))
    names = cfg.get("custom_sharded_layers", None)
    model = config.instantiate(cfg.model)
    matched = [n for n, m in model.named_modules() if n in names and training.get_shard_conditions(n, m, names)]
    assert list(names) == matched == ["tok_embeddings", "output"]


@pytest.mark.libs
def test_torchtune_yaml_loads_in_torchtunes_config():
    pytest.importorskip("torchtune", reason="torchtune is not installed (pip install 'memplan[torchtune]')")
    from omegaconf import OmegaConf
    from torchtune import config

    text = render(plan_of(precision="bf16", lora_rank=4), "torchtune")["torchtune.yaml"]
    cfg = OmegaConf.create(yaml.safe_load(text))
    model = config.instantiate(cfg.model)
    assert sum(p.numel() for n, p in model.named_parameters() if "lora" in n) > 0


# ---- what a stack cannot express, and what is on disk -----------------------------------------------------

@pytest.mark.parametrize("stack, setup, accepted", [
    ("transformers", {"checkpointing": "selective"}, "accepted by transformers: none, full"),
    ("litgpt", {"precision": "fp16-mixed"}, "accepted by litgpt: fp32, tf32, bf16-mixed, bf16"),
    ("litgpt", {"checkpointing": "full"}, "accepted by litgpt: none"),
    ("litgpt", {"optimizer": "sgd"}, "accepted by litgpt: adamw, adamw-fused"),
    ("torchtune", {"precision": "bf16-mixed"}, "accepted by torchtune: fp32, tf32, bf16"),
    ("torchtune", {"precision": "bf16", "world_size": 2, "sharding": "ddp"}, "accepted by torchtune: fsdp"),
])
def test_a_setting_the_stack_cannot_express_is_one_line_naming_what_it_takes(stack, setup, accepted):
    with pytest.raises(InputError) as e:
        render(plan_of(**setup), stack)
    assert accepted in str(e.value) and "\n" not in str(e.value)


def test_emit_for_memplans_own_stack_is_refused_before_any_work(tmp_path):
    line = one_line_error(run_cli("autotune", "--params", "22m", "--device", "rtx-4090", "--emit",
                                  str(tmp_path / "e")))
    assert "--stack memplan has none" in line and "transformers, litgpt, torchtune" in line
    assert not (tmp_path / "e").exists()


def test_an_existing_emit_file_is_kept_without_force_and_replaced_with_it(tmp_path):
    emitted = tmp_path / "emitted"
    emitted.mkdir()
    (emitted / "litgpt.yaml").write_text("mine\n")
    result = run_cli("autotune", "--params", "22m", "--device", "rtx-4090", "--ctx", "512", "--stack", "litgpt",
                     "--emit", str(emitted))
    assert "already exists; give --force" in one_line_error(result)
    assert (emitted / "litgpt.yaml").read_text() == "mine\n"
    result = run_cli("autotune", "--params", "22m", "--device", "rtx-4090", "--ctx", "512", "--stack", "litgpt",
                     "--emit", str(emitted), "--force")
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((emitted / "litgpt.yaml").read_text())["train"]["max_seq_length"] == 512
    assert [p.name for p in emitted.iterdir()] == ["litgpt.yaml"]  # no temporary file left


def test_emit_into_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    line = one_line_error(run_cli("autotune", "--params", "22m", "--device", "rtx-4090", "--stack", "torchtune",
                                  "--emit", str(tmp_path / "f")))
    assert "is a file; give a directory" in line


def test_a_plan_for_another_stack_is_not_trained_by_memplans_trainer(tmp_path):
    from memplan.planning import plan_from_flags

    path = tmp_path / "plan.toml"
    Plan(model=TINY_LLAMA, setup=TrainSetup(ctx=32), stack="torchtune").save(path)
    assert Plan.load(path).stack == "torchtune"
    with pytest.raises(InputError, match="a plan for --stack torchtune"):
        plan_from_flags(str(path), None, None, None, None)
    line = one_line_error(run_cli("train", "--plan", str(path), "--out", str(tmp_path / "run")))
    assert "a plan for --stack torchtune" in line and "--stack memplan --out FILE" in line
    assert not (tmp_path / "run").exists()
    path.write_text(path.read_text().replace('stack = "torchtune"', 'stack = "keras"'))
    with pytest.raises(InputError, match="stack = 'keras' is not one memplan plans for"):
        Plan.load(path)


def test_emit_imports_no_torch():
    code = "import sys, memplan.emit; sys.exit('torch' in sys.modules)"
    import subprocess

    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_nothing_fits_emits_nothing_and_exits_3(tmp_path):
    result, out, emitted = autotune_emit(tmp_path, "torchtune", "--budget", "64MiB")
    assert result.exit_code == 3, result.output
    assert json.loads(result.stdout)["emitted"] == []
    assert not emitted.exists() or not any(emitted.iterdir())
    with pytest.raises(InputError, match="holds no plan"):
        Plan.load(out)


@pytest.mark.parametrize("stack, needle", [("litgpt", "accepted: llama, gpt_neox shapes"),
                                           ("torchtune", "accepted: --arch llama")])
def test_a_family_the_stack_does_not_build_is_refused(stack, needle):
    gpt2 = ModelSpec(arch="gpt2", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=256, tied=True)
    for lora in (0, 4):
        with pytest.raises(InputError, match=needle):
            render(plan_of(gpt2, precision="fp32", lora_rank=lora), stack)

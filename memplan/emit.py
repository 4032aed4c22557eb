"""``memplan autotune --emit DIR``: the plan as the user's own stack takes it, in that library's format and keys.

One writer per stack, found by name in ``WRITERS``:

- ``transformers``: ``training_args.json`` (``transformers.TrainingArguments(**json)``), ``lora_config.json``
  where LoRA is planned (``peft.LoraConfig(**json)``), and ``train.py``, a short script that loads both
  and trains with ``transformers.Trainer``;
- ``litgpt``: ``litgpt.yaml``, the config of ``litgpt pretrain`` (``litgpt finetune_lora`` with LoRA),
  with litgpt's own keys (``train.micro_batch_size``, ``precision: bf16-true``, ``lora_r`` ...);
- ``torchtune``: ``torchtune.yaml``, the recipe (``full_finetune_single_device``, ``lora_finetune_distributed``
  ...) in its header and its overrides as YAML (``batch_size``, ``gradient_accumulation_steps``, ``dtype``,
  ``model._component_`` ...).

A setting the stack's code cannot express (selective checkpointing in torchtune, fp16 in litgpt ...) is
one InputError line naming the settings it takes. Every file is written whole or not at all
(``memplan.fsutil.write_atomic``), and one that exists is replaced only with ``--force``.

Torch-free: only the planner's dataclasses, json and PyYAML.
"""

from __future__ import annotations

import json
from pathlib import Path

from memplan.errors import InputError
from memplan.setup import QKV_PARTS

# memplan's adapter targets (memplan.setup.LORA_TARGET_NAMES) as each transformers family names its modules:
# peft's target_modules (a module is adapted when its full name ends with one of them)
HF_LORA_MODULES = {
    "llama": {"qkv": ("q_proj", "k_proj", "v_proj"), "q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",),
              "proj": ("o_proj",), "up": ("gate_proj", "up_proj"), "down": ("down_proj",), "head": ("lm_head",)},
    "gpt2": {"qkv": ("attn.c_attn",), "proj": ("attn.c_proj",), "up": ("mlp.c_fc",), "down": ("mlp.c_proj",),
             "head": ("lm_head",)},
    "gpt_neox": {"qkv": ("query_key_value",), "proj": ("attention.dense",), "up": ("dense_h_to_4h",),
                 "down": ("dense_4h_to_h",), "head": ("embed_out",)},
    "phi": {"qkv": ("q_proj", "k_proj", "v_proj"), "q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",),
            "proj": ("self_attn.dense",), "up": ("fc1",), "down": ("fc2",), "head": ("lm_head",)},
    "phi3": {"qkv": ("qkv_proj",), "proj": ("o_proj",), "up": ("gate_up_proj",), "down": ("down_proj",),
             "head": ("lm_head",)},
}
HF_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "stablelm", "olmo", "olmo2",
                 "smollm3", "granite")


def hf_lora_modules(model_type: str, targets: str) -> list[str]:
    """peft's ``target_modules`` (module-name suffixes) for memplan's ``--lora-targets`` in a transformers
    family, or the one-line InputError naming what that family takes."""
    family = "llama" if model_type in HF_LLAMA_LIKE else model_type
    names = HF_LORA_MODULES.get(family)
    if names is None:
        raise InputError(f"--lora-rank with --stack transformers: no adapter targets known for model_type "
                         f"{model_type!r} (accepted: {', '.join(sorted({*HF_LLAMA_LIKE, *HF_LORA_MODULES}))})")
    missing = [t for t in targets.split(",") if t not in names]
    if missing:
        raise InputError(f"--lora-targets {targets}: {model_type}'s attention is one fused matrix, which peft adapts "
                         f"whole (accepted for {model_type}: {', '.join(names)})")
    return [m for t in targets.split(",") for m in names[t]]


def _refuse(stack: str, flag: str, value, accepted) -> InputError:
    return InputError(f"--emit: {stack} cannot express {flag} {value} (accepted by {stack}: {', '.join(accepted)})")


def _yaml(header: list[str], data: dict) -> str:
    import yaml

    lines = "".join(f"# {h}\n" if h else "#\n" for h in header)
    return lines + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def _training(plan) -> dict:
    return dict(plan.training or {})


class Writer:
    """One stack's config writer: ``names`` the files it writes for a plan, ``render`` their contents."""

    stack = ""

    def names(self, lora: bool) -> tuple[str, ...]:
        raise NotImplementedError

    def render(self, plan) -> dict[str, str]:
        raise NotImplementedError

    def emitted_sharding(self, world_size: int) -> str | None:
        """The one sharding the stack's config runs ``world_size`` devices with, where its library picks it itself
        (``autotune --emit`` searches it alone); None: every sharding the walk covers can be written."""
        return None


# ---- transformers ------------------------------------------------------------------------------------------

HF_OPTIM = {"adamw": "adamw_torch", "adamw-fused": "adamw_torch_fused", "adamw8bit": "adamw_bnb_8bit", "sgd": "sgd"}
SGD_MOMENTUM = 0.9  # memplan's sgd (trainer.step.SGD_MOMENTUM): Trainer's "sgd" takes it in optim_args
HF_DEFAULT_LORA_ALPHA = 16.0  # trainer/stacks/transformers.py's DEFAULT_LORA_ALPHA
HF_LORA_DROPOUT = 0.0  # peft's LoraConfig.lora_dropout default, as the walk assumes

_TRAIN_PY = '''"""Train with transformers' Trainer on the plan memplan chose (memplan autotune --emit).

    python train.py --model MODEL_DIR_OR_ID --data TEXT_FILE [--output-dir DIR]{launch}

training_args.json holds transformers.TrainingArguments; lora_config.json (when LoRA is planned) peft's LoraConfig.
"""

import argparse
import json
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
CTX = {ctx}  # tokens per sequence the plan is for
MODEL_DTYPE = torch.{dtype}  # the weights' dtype: bfloat16 for pure bf16, else float32 (bf16/fp16 autocast)
ATTENTION = "{attention}"  # attn_implementation
LORA = {lora}  # whether lora_config.json applies


def training_args(output_dir=None):
    kwargs = json.loads((HERE / "training_args.json").read_text())
    if output_dir is not None:
        kwargs["output_dir"] = str(output_dir)
    return transformers.TrainingArguments(**kwargs)


def build_model(model):
    net = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=MODEL_DTYPE, attn_implementation=ATTENTION)
    net.config.use_cache = False
    if LORA:
        import peft

        net = peft.get_peft_model(net, peft.LoraConfig(**json.loads((HERE / "lora_config.json").read_text())))
    return net


def text_dataset(tokenizer, path, ctx=CTX):
    """The text file's tokens in windows of ctx tokens, each its own labels (the model shifts them)."""
    ids = tokenizer(Path(path).read_text(encoding="utf-8"))["input_ids"]
    return [{{"input_ids": ids[i:i + ctx], "labels": ids[i:i + ctx]}} for i in range(0, len(ids) - ctx + 1, ctx)]


def make_trainer(net, dataset, args):
    return transformers.Trainer(model=net, args=args, train_dataset=dataset,
                                data_collator=transformers.default_data_collator)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory or Hugging Face id")
    parser.add_argument("--data", required=True, help="a UTF-8 text file to train on")
    parser.add_argument("--tokenizer", help="the tokenizer (default: the model's)")
    parser.add_argument("--output-dir", help="where Trainer writes (default: training_args.json's output_dir)")
    a = parser.parse_args(argv)
    tokenizer = transformers.AutoTokenizer.from_pretrained(a.tokenizer or a.model)
    trainer = make_trainer(build_model(a.model), text_dataset(tokenizer, a.data), training_args(a.output_dir))
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
'''


class TransformersWriter(Writer):
    """``TrainingArguments`` and peft's ``LoraConfig`` as JSON, and ``train.py`` using them."""

    stack = "transformers"

    def names(self, lora: bool) -> tuple[str, ...]:
        return ("training_args.json",) + (("lora_config.json",) if lora else ()) + ("train.py",)

    def training_args(self, plan) -> dict:
        s, t = plan.setup, _training(plan)
        if s.checkpointing == "selective":
            raise _refuse(self.stack, "--checkpointing", s.checkpointing, ("none", "full"))
        if s.sharding == "fsdp":
            raise _refuse(self.stack, "--sharding", s.sharding, ("none", "ddp (torchrun)"))
        args = {
            "output_dir": "out", "per_device_train_batch_size": s.micro_batch,
            "gradient_accumulation_steps": s.grad_accum,
            "bf16": s.precision == "bf16-mixed", "fp16": s.precision == "fp16-mixed",
            "gradient_checkpointing": s.checkpointing == "full",
            "optim": HF_OPTIM[s.optimizer], "torch_compile": s.compile,
            "max_grad_norm": float(t.get("clip", 1.0)),
            "report_to": "none",
        }
        if s.precision == "tf32":
            args["tf32"] = True
        if s.checkpointing == "full":
            args["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
        if s.optimizer == "sgd":
            args["optim_args"] = f"momentum={SGD_MOMENTUM}"
        for key, name in (("lr", "learning_rate"), ("weight_decay", "weight_decay"), ("beta1", "adam_beta1"),
                          ("beta2", "adam_beta2"), ("warmup_steps", "warmup_steps")):
            if key in t:
                args[name] = t[key]
        if s.world_size > 1:
            args["ddp_find_unused_parameters"] = False
        return args

    def lora_config(self, plan) -> dict:
        s = plan.setup
        return {"r": s.lora_rank, "lora_alpha": HF_DEFAULT_LORA_ALPHA, "lora_dropout": HF_LORA_DROPOUT,
                "target_modules": hf_lora_modules(plan.model.arch, s.lora_targets),
                "fan_in_fan_out": plan.model.arch == "gpt2",  # GPT-2's Conv1D stores W transposed
                "task_type": "CAUSAL_LM"}

    def render(self, plan) -> dict[str, str]:
        s = plan.setup
        out = {"training_args.json": json.dumps(self.training_args(plan), indent=2) + "\n"}
        if s.lora_rank:
            out["lora_config.json"] = json.dumps(self.lora_config(plan), indent=2) + "\n"
        launch = (f"\n    torchrun --nproc-per-node {s.world_size} train.py --model ... --data ...   (DDP over "
                  f"{s.world_size} devices)") if s.world_size > 1 else ""
        out["train.py"] = _TRAIN_PY.format(ctx=s.ctx, dtype="bfloat16" if s.precision == "bf16" else "float32",
                                           attention=s.attention, lora=bool(s.lora_rank), launch=launch)
        return out


# ---- litgpt ------------------------------------------------------------------------------------------------

LIT_PRECISION = {"fp32": "32-true", "tf32": "32-true", "bf16-mixed": "bf16-mixed", "bf16": "bf16-true"}
LIT_LORA_ALPHA = 16  # finetune/lora.py's lora_alpha default (trainer/stacks/litgpt.py)
LIT_LORA_DROPOUT = 0.05  # finetune/lora.py's lora_dropout default


def lit_model_config(spec, ctx: int) -> dict:
    """litgpt ``Config`` fields for memplan's shape (as ``trainer.stacks.litgpt.config_kwargs``)."""
    from memplan.memory.stacks.litgpt import LitgptStack

    if spec.pos != "rope" or spec.arch not in LitgptStack.archs:
        raise InputError(f"--emit: litgpt's GPT builds rotary llama and gpt_neox shapes, not {spec.arch!r} with "
                         f"{spec.pos} positions (accepted: llama, gpt_neox shapes)")
    llama = spec.norm == "rmsnorm"
    return dict(
        name=spec.name or f"memplan-{spec.arch}", block_size=max(ctx, spec.max_positions),
        vocab_size=spec.vocab, padded_vocab_size=spec.vocab, n_layer=spec.layers, n_embd=spec.hidden,
        n_head=spec.heads, head_size=spec.head_dim, n_query_groups=spec.kv_heads,
        intermediate_size=spec.ffn, rotary_percentage=spec.rotary_pct, parallel_residual=bool(spec.parallel_residual),
        bias=bool(spec.bias), attn_bias=bool(spec.qkv_bias), norm_eps=spec.norm_eps, rope_base=int(spec.rope_theta),
        norm_class_name="RMSNorm" if llama else "LayerNorm",
        mlp_class_name="LLaMAMLP" if spec.mlp == "swiglu" else "GptNeoxMLP",
    )


class LitgptWriter(Writer):
    """``litgpt.yaml``: ``litgpt pretrain --config litgpt.yaml``, or ``litgpt finetune_lora`` with LoRA."""

    stack = "litgpt"

    def emitted_sharding(self, world_size: int) -> str | None:
        """litgpt's YAML has ``devices`` but no strategy: its scripts pick FSDP themselves whenever devices > 1
        (pretrain.py: ``FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy=
        "HYBRID_SHARD")``, FSDP1, walked as ``memory.fsdp1.FlatShard``; finetune/lora.py: ``ModelParallelStrategy(
        parallelize_fn=parallelize_fn)``, FSDP2 over checkpointed Blocks, walked as
        ``memory.stacks.litgpt_sharding.LitFullyShard``), so the DDP the walk also covers cannot be written: with
        several devices the search is FSDP's alone."""
        return "fsdp" if world_size > 1 else None

    def names(self, lora: bool) -> tuple[str, ...]:
        return ("litgpt.yaml",)

    def config(self, plan) -> tuple[str, dict]:
        s, t = plan.setup, _training(plan)
        if s.precision not in LIT_PRECISION:
            raise _refuse(self.stack, "--precision", s.precision, LIT_PRECISION)
        if s.attention != "sdpa":
            raise _refuse(self.stack, "--attention", s.attention, ("sdpa",))
        # several devices with LoRA: finetune_lora's ModelParallelStrategy (FSDP2, every Block checkpointed by its
        # parallelize_fn: no YAML key), the walk's --sharding fsdp --checkpointing full; pretrain's FSDP1 checkpoints
        # nothing (finetune/full.py's checkpointed FSDP1 is walked, not written)
        several = s.world_size > 1
        lora_shards = several and bool(s.lora_rank)
        if s.checkpointing != ("full" if lora_shards else "none"):
            raise _refuse(self.stack, "--checkpointing", s.checkpointing,
                          ("full (LoRA on devices > 1: finetune_lora's parallelize_fn)",) if lora_shards else ("none",))
        if s.optimizer not in ("adamw", "adamw-fused"):
            raise _refuse(self.stack, "--optimizer", s.optimizer, ("adamw", "adamw-fused"))
        if several and s.sharding != "fsdp":  # several devices: the scripts' own FSDP strategy
            raise _refuse(self.stack, "--sharding", s.sharding, ("fsdp (devices > 1)",))
        if s.lora_rank and s.compile:
            raise _refuse(self.stack, "--compile", "with LoRA", ("no compile: finetune_lora does not compile",))
        script = "finetune_lora" if s.lora_rank else "pretrain"
        train = {"global_batch_size": s.micro_batch * s.grad_accum * s.world_size, "micro_batch_size": s.micro_batch,
                 "max_seq_length": s.ctx}
        if "warmup_steps" in t:
            train["lr_warmup_steps"] = t["warmup_steps"]
        if not s.lora_rank:
            train["max_norm"] = float(t.get("clip", 1.0))
        if "lr" in t and "min_lr_ratio" in t:
            train["min_lr"] = t["lr"] * t["min_lr_ratio"]
        # pretrain.py passes fused=(device is CUDA) itself, over init_args; finetune_lora.py passes nothing
        init = {"fused": True} if s.optimizer == "adamw-fused" and s.lora_rank else {}
        for key, name in (("lr", "lr"), ("weight_decay", "weight_decay")):
            if key in t:
                init[name] = t[key]
        if "beta1" in t and "beta2" in t:
            init["betas"] = [t["beta1"], t["beta2"]]
        model_config = lit_model_config(plan.model, s.ctx)  # also refuses a shape litgpt's GPT does not build
        common = {"precision": LIT_PRECISION[s.precision], "devices": s.world_size}
        if s.lora_rank:  # finetune_lora reads the model from its checkpoint directory
            data = {"checkpoint_dir": f"checkpoints/{plan.model.name or 'MODEL'}", **common,
                    "lora_r": s.lora_rank, "lora_alpha": LIT_LORA_ALPHA, "lora_dropout": LIT_LORA_DROPOUT,
                    **lit_lora_flags(s.lora_targets)}
        else:
            data = {"model_name": model_config["name"], "model_config": model_config, **common}
        data["train"] = train
        data["optimizer"] = {"class_path": "torch.optim.AdamW", "init_args": init} if init else "AdamW"
        return script, data

    def render(self, plan) -> dict[str, str]:
        script, data = self.config(plan)
        header = [f"litgpt {script} --config litgpt.yaml   (written by memplan autotune --emit)",
                  f"{plan.model.name or plan.model.arch}: micro-batch {plan.setup.micro_batch} x "
                  f"{plan.setup.grad_accum} accumulation on {plan.setup.world_size} device(s), {data['precision']}"]
        if plan.setup.world_size > 1 and script == "finetune_lora":  # memory.stacks.litgpt_sharding.LitFullyShard
            header.append(f"devices: {plan.setup.world_size} runs finetune_lora's ModelParallelStrategy: FSDP2 "
                          "(parallelize_fn: every Block checkpointed and sharded, then the root), as the walk planned")
        if script == "pretrain":
            header.append("pretrain.py compiles the model itself (torch.compile) and fuses AdamW on CUDA, whatever "
                          "the plan")
        if plan.setup.world_size > 1 and script == "pretrain":  # the FSDP1 layout the walk planned (memory.fsdp1)
            header.append(f"devices {plan.setup.world_size}: pretrain.py shards with FSDPStrategy(auto_wrap_policy="
                          "{Block}, sharding_strategy=\"HYBRID_SHARD\"), FSDP1 over the node's devices, as planned")
        return {"litgpt.yaml": _yaml(header, data)}


def lit_lora_flags(targets: str) -> dict:
    """litgpt.lora's ``lora_query/key/value/projection/mlp/head`` for memplan's ``--lora-targets``; litgpt
    adapts the whole MLP or none of it (``lora_mlp``)."""
    chosen = set(targets.split(","))
    if ("up" in chosen) != ("down" in chosen):
        raise _refuse("litgpt", "--lora-targets", targets, ("qkv, q, k, v, proj, up with down, head",))
    qkv = "qkv" in chosen
    return dict(lora_query=qkv or "q" in chosen, lora_key=qkv or "k" in chosen, lora_value=qkv or "v" in chosen,
                lora_projection="proj" in chosen, lora_mlp="up" in chosen, lora_head="head" in chosen)


# ---- torchtune ---------------------------------------------------------------------------------------------

TT_DTYPE = {"fp32": "fp32", "tf32": "fp32", "bf16": "bf16"}  # one dtype, no autocast (tf32: fp32's matmuls)
TT_OPTIMIZER = {"adamw": ("torch.optim.AdamW", {"fused": False}), "adamw-fused": ("torch.optim.AdamW", {"fused": True}),
                "sgd": ("torch.optim.SGD", {"momentum": SGD_MOMENTUM}),
                "adamw8bit": ("bitsandbytes.optim.AdamW8bit", {})}
TT_LORA_DROPOUT = 0.0  # the recipes' configs


def tt_lora_modules(targets: str) -> tuple[list[str], bool, bool]:
    """``lora_attn_modules``, ``apply_lora_to_mlp`` and ``apply_lora_to_output`` for ``--lora-targets``."""
    chosen = set(targets.split(","))
    if ("up" in chosen) != ("down" in chosen):
        raise _refuse("torchtune", "--lora-targets", targets, ("qkv, q, k, v, proj, up with down, head",))
    qkv = "qkv" in chosen
    attn = [f"{p}_proj" for p in QKV_PARTS if qkv or p in chosen] + (["output_proj"] if "proj" in chosen else [])
    if not attn:
        raise _refuse("torchtune", "--lora-targets", targets, ("at least one of qkv, q, k, v, proj",))
    return attn, "up" in chosen, "head" in chosen


class TorchtuneWriter(Writer):
    """``torchtune.yaml``: the recipe and its overrides (``tune run RECIPE --config CONFIG`` with them merged)."""

    stack = "torchtune"

    def names(self, lora: bool) -> tuple[str, ...]:
        return ("torchtune.yaml",)

    def config(self, plan) -> tuple[str, dict]:
        s, spec, t = plan.setup, plan.model, _training(plan)
        if s.precision not in TT_DTYPE:
            raise _refuse(self.stack, "--precision", s.precision, TT_DTYPE)
        if s.attention != "sdpa":
            raise _refuse(self.stack, "--attention", s.attention, ("sdpa",))
        if s.checkpointing == "selective":
            raise _refuse(self.stack, "--checkpointing", s.checkpointing, ("none", "full"))
        if s.world_size > 1 and s.sharding != "fsdp":  # the distributed recipes shard with FSDP2
            raise _refuse(self.stack, "--sharding", s.sharding, ("fsdp (the distributed recipes)",))
        if spec.arch != "llama" or spec.pos != "rope":
            raise InputError(f"--emit: torchtune's Llama builders take llama shapes, not {spec.arch!r} "
                             "(accepted: --arch llama, a llama preset or size)")
        recipe = ("lora" if s.lora_rank else "full") + "_finetune_" + (
            "distributed" if s.world_size > 1 else "single_device")
        family = "llama3_2" if spec.tied else "llama3"
        model = {"_component_": f"torchtune.models.{family}.{'lora_' if s.lora_rank else ''}{family}",
                 "vocab_size": spec.vocab, "num_layers": spec.layers, "num_heads": spec.heads,
                 "num_kv_heads": spec.kv_heads, "embed_dim": spec.hidden, "max_seq_len": max(s.ctx, spec.max_positions),
                 "intermediate_dim": spec.ffn, "norm_eps": spec.norm_eps, "rope_base": int(spec.rope_theta)}
        if spec.tied:
            model["tie_word_embeddings"] = True
        if s.lora_rank:
            attn, mlp, head = tt_lora_modules(s.lora_targets)
            if head and spec.tied:
                raise _refuse(self.stack, "--lora-targets", s.lora_targets,
                              ("for a tied model: qkv, q, k, v, proj, up with down",))
            model.update(lora_attn_modules=attn, apply_lora_to_mlp=mlp, apply_lora_to_output=head,
                         lora_rank=s.lora_rank, lora_alpha=2.0 * s.lora_rank, lora_dropout=TT_LORA_DROPOUT)
        component, kwargs = TT_OPTIMIZER[s.optimizer]
        optimizer = {"_component_": component, **kwargs}
        for key, name in (("lr", "lr"), ("weight_decay", "weight_decay")):
            if key in t:
                optimizer[name] = t[key]
        data = {"model": model, "batch_size": s.micro_batch, "gradient_accumulation_steps": s.grad_accum,
                "dtype": TT_DTYPE[s.precision], "enable_activation_checkpointing": s.checkpointing == "full",
                "compile": s.compile, "optimizer": optimizer, "tokenizer": {"max_seq_len": s.ctx}}
        if "clip" in t:
            data["clip_grad_norm"] = t["clip"]
        if s.world_size > 1:  # the FSDP2 layout the walk follows (tt_fsdp_root_reshards_after_forward), its groups
            from memplan.memory.stacks.torchtune_fsdp import tt_custom_sharded_layers  # the published configs'

            layers = list(tt_custom_sharded_layers(spec, s, "auto")) or None
            data.update(fsdp_reshard_after_forward=True, fsdp_cpu_offload=False, custom_sharded_layers=layers)
        return recipe, data

    def render(self, plan) -> dict[str, str]:
        recipe, data = self.config(plan)
        s = plan.setup
        run = (f"tune run --nproc_per_node {s.world_size} {recipe}" if s.world_size > 1 else f"tune run {recipe}")
        header = [f"recipe: {recipe}   (written by memplan autotune --emit)",
                  f"{run} --config CONFIG   with these keys merged into CONFIG (the recipe's own config:",
                  "tokenizer path, checkpointer, dataset), or given as key=value overrides"]
        if s.precision == "tf32":
            header.append("tf32: dtype fp32 with TF32 matmuls (torch.backends.cuda.matmul.allow_tf32 = True)")
        return {"torchtune.yaml": _yaml(header, data)}


WRITERS = {w.stack: w for w in (TransformersWriter(), LitgptWriter(), TorchtuneWriter())}


def writer_for(stack: str) -> Writer:
    """The writer of ``stack``, or the one-line InputError naming the stacks ``--emit`` writes for."""
    writer = WRITERS.get(stack)
    if writer is None:
        raise InputError(f"--emit writes another library's config; --stack {stack} has none (memplan's own is the "
                         f"plan: --out FILE) (accepted with --emit: --stack {', '.join(WRITERS)})")
    return writer


def check_emit(directory: str | Path, stack: str, lora: bool, force: bool) -> Path:
    """``--emit DIR`` checked before any work: the stack has a writer, DIR is a directory (or can be made in an existing, writable one), and
    none of the files it would write exists unless ``force``."""
    import os

    from memplan.fsutil import check_target

    writer = writer_for(stack)
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise InputError(f"--emit: {str(directory)!r} is a file; give a directory (created if absent)")
    if not directory.exists():
        check_target(directory, "--emit", "emitted/")
    elif not os.access(directory, os.W_OK | os.X_OK):
        raise InputError(f"--emit: cannot write in the directory {str(directory)!r} (read-only or not yours)")
    if not force:
        existing = [n for n in writer.names(lora) if (directory / n).exists() or (directory / n).is_symlink()]
        if existing:
            raise InputError(f"--emit: {', '.join(str(directory / n) for n in existing)} already "
                             f"exist{'s' if len(existing) == 1 else ''}; give --force to replace "
                             f"{'it' if len(existing) == 1 else 'them'}, or another directory")
    return directory


def render(plan, stack: str) -> dict[str, str]:
    """The files of ``stack``'s config for ``plan``: name to contents (nothing written)."""
    return writer_for(stack).render(plan)


def emit(plan, stack: str, directory: str | Path, force: bool = False,
         files: dict[str, str] | None = None) -> list[Path]:
    """Write ``stack``'s config for ``plan`` (``files``: as ``render`` gave them) into ``directory`` (made if
    absent): all files rendered first (a setting the stack cannot express writes nothing), then each written
    atomically."""
    from memplan.fsutil import write_atomic

    files = render(plan, stack) if files is None else files
    directory = check_emit(directory, stack, bool(plan.setup.lora_rank), force)
    directory.mkdir(exist_ok=True)
    return [write_atomic(directory / name, content) for name, content in files.items()]

"""transformers' own model class, trained in memplan's loop: ``memplan train/finetune --stack transformers``.

The stack that trains is the stack that is planned. memplan's own model (``trainer/model.py``) builds llama,
mistral, qwen2, gpt2 and gpt_neox; for qwen3, gemma, phi and stablelm (``memplan.model.STACK_ARCHS``) memplan
trains transformers' model class instead (chosen automatically, with a one-line note), and ``--stack
transformers`` asks for it for any family. Everything else is memplan's: the loop (``trainer/loop.py``), the
step (``trainer/step.py``: logits, fp32 cross-entropy, backward, clip, optimizer), checkpoints, evaluation,
sampling, reports. The plan is walked as ``--stack transformers`` walks it (``TrainSetup.stack``).

- The model: ``AutoModelForCausalLM.from_config`` of a config.json's contents (``trainer.stacks.transformers.build_model``:
  attention, precision, checkpointing ``full``, peft's LoRA), never ``trust_remote_code``: a config with an
  ``auto_map`` is refused, and nothing from a checkpoint directory is imported or executed.
- ``HFCausalLM`` wraps it as memplan's loop calls a model: ``model(ids)`` gives the logits; ``generate``'s
  cached forward runs on transformers' own ``DynamicCache``.
- Weights: read with ``safetensors`` only; every tensor is checked by name and shape against the model built
  from config.json (on the meta device: no memory) before any is used, and a missing, unknown or misshapen
  tensor is one line naming it. A tied model may omit its LM head.
- The run's config.json contents are recorded in every checkpoint's meta.json (``hf_config``): eval, generate,
  resume and export rebuild the same class from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from memplan.errors import InputError
from memplan.memory.stacks import stack_class
from memplan.model import HF_MODEL_TYPES, STACK_ARCHS, ModelSpec

STACK = "transformers"
FAMILIES = (*HF_MODEL_TYPES, *STACK_ARCHS)  # the model types memplan trains with transformers' class
META_KEY = "hf_config"  # a checkpoint's meta.json: the config.json the model was built from


# ---- which stack trains ------------------------------------------------------------------------------

def choose_stack(asked: str | None, spec: ModelSpec) -> tuple[str, str | None]:
    """(the stack whose model class trains ``spec``, a one-line note when it was chosen for the user): memplan's
    own where it builds the family, else transformers'; ``asked`` (``--stack``) as given where it can."""
    from memplan.setup import TRAIN_STACKS

    if asked is not None and asked not in TRAIN_STACKS:
        raise InputError(f"--stack: {asked!r} does not train here (accepted: {', '.join(TRAIN_STACKS)})")
    if asked is not None and not stack_class(asked).trains_hf_model and not spec.memplan_builds:
        raise InputError(f"--stack memplan: memplan's own model does not build the {spec.arch} family (it builds "
                         f"{', '.join(HF_MODEL_TYPES)}); accepted for {spec.arch}: --stack transformers")
    if asked is not None:
        return asked, None
    if spec.memplan_builds:
        return "memplan", None
    return STACK, (f"{spec.arch}: memplan's own model does not build this family, so transformers' model class "
                   "trains in memplan's loop, planned as --stack transformers")


def check_stack_setup(setup, where: str = "--stack transformers") -> None:
    """What memplan's loop cannot yet do with transformers' model: FSDP2, torch.compile, selective checkpointing."""
    if not stack_class(setup.stack).trains_hf_model:
        return
    if setup.sharding == "fsdp":
        raise InputError(f"{where}: --sharding fsdp is not wrapped for transformers' model class here; use "
                         "--sharding ddp (accepted: ddp)")
    if setup.compile:
        raise InputError(f"{where}: --compile is planned for memplan's own model only; drop it (accepted: "
                         "--no-compile)")
    if setup.checkpointing == "selective":
        raise InputError(f"{where}: checkpointing 'selective' is memplan's own; transformers checkpoints whole "
                         "layers (accepted: none, full)")


# ---- the config ----------------------------------------------------------------------------------------

def check_config(cfg, where: str) -> dict:
    """A config.json's contents as memplan builds transformers' model from them: a JSON object of a family it
    trains, with no ``auto_map`` (remote code is never run)."""
    if not isinstance(cfg, dict):
        raise InputError(f"{where}: config.json must be a JSON object")
    if "auto_map" in cfg:
        raise InputError(f"{where}: config.json has auto_map, a model whose code lives beside its weights "
                         "(trust_remote_code); memplan never imports or runs code from a checkpoint (accepted: "
                         f"the model types transformers ships: {', '.join(FAMILIES)})")
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise InputError(f"{where}: model_type {model_type!r:.40} is not one memplan trains (accepted: "
                         f"{', '.join(FAMILIES)})")
    return dict(cfg)


def spec_hf_config(spec: ModelSpec, setup) -> dict:
    """The config.json contents of a fresh model of ``spec`` (``--arch``/``--model``) in transformers' class."""
    from trainer.stacks import StackModel
    from trainer.stacks.transformers import config_dict

    return config_dict(StackModel(spec=spec), setup)


def read_config(directory: Path, flag: str = "--from") -> dict:
    """A checkpoint directory's config.json, checked (``check_config``)."""
    path = directory / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{flag} {directory}: config.json is not readable JSON ({type(e).__name__})") from None
    return check_config(cfg, f"{flag} {directory}")


# ---- the model -------------------------------------------------------------------------------------------

class HFCausalLM(nn.Module):
    """transformers' causal LM as memplan's loop calls a model: ``forward(ids)`` -> logits (B, T, vocab)."""

    def __init__(self, net: nn.Module, spec: ModelSpec, hf_config: dict):
        super().__init__()
        self.net = net
        self.spec = spec
        self.hf_config = hf_config

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=ids, use_cache=False).logits

    @property
    def embed(self) -> nn.Module:
        """The input embedding (its weight tells the device and dtype, as memplan's model's ``embed``)."""
        return self.net.get_input_embeddings()

    # generation: trainer.generate's cached forward, on transformers' own cache
    def new_cache(self, batch: int, max_len: int) -> "HFCache":
        return HFCache(batch, max_len)

    @torch.no_grad()
    def forward_cached(self, idx: torch.Tensor, cache: "HFCache", start: int) -> torch.Tensor:
        """Logits (B, vocab), fp32, of the last of ``idx``'s tokens at positions [start, start + T)."""
        from transformers import DynamicCache

        if start == 0 or cache.kv is None:
            cache.kv = DynamicCache()
        end = start + idx.shape[1]
        if end > cache.max_len:
            raise ValueError(f"positions up to {end} exceed the cache's {cache.max_len}")
        positions = torch.arange(start, end, device=idx.device)[None].expand(idx.shape[0], -1)
        import inspect

        # the cache, updated in place: ``cache`` in transformers 5.2x, ``past_key_values`` before
        name = "cache" if "cache" in inspect.signature(self.net.forward).parameters else "past_key_values"
        out = self.net(input_ids=idx, use_cache=True, position_ids=positions, logits_to_keep=1, **{name: cache.kv})
        cache.length = end
        return out.logits[:, -1].float()


class HFCache:
    """transformers' ``DynamicCache`` with what ``trainer.generate`` reads of a cache."""

    def __init__(self, batch: int, max_len: int):
        self.batch, self.max_len, self.length, self.kv = batch, max_len, 0, None

    @property
    def nbytes(self) -> int:
        layers = getattr(self.kv, "layers", None) or []
        return sum(t.numel() * t.element_size() for layer in layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)


def _setup_for(setup, lora: bool):
    return setup if lora else setup.replace(lora_rank=0)


def build(spec: ModelSpec, setup, device, hf_config: dict, weights=None, lora_alpha: float = 16.0,
          lora: bool = True) -> HFCausalLM:
    """transformers' model of ``hf_config`` in ``setup``'s precision, attention and checkpointing, on ``device``;
    ``weights`` (HF-named tensors, checked already) loaded before peft's LoRA adapters (``setup.lora_rank``,
    unless ``lora`` is False) wrap it."""
    from trainer.stacks import StackModel
    from trainer.stacks.transformers import build_model

    check_config(hf_config, "the run's config")
    check_stack_setup(setup.replace(stack=STACK), "--stack transformers")  # a plan file's too: no FSDP2, no compile

    def load(net):
        if weights is not None:
            load_into(net, weights, "weights")

    net = build_model(StackModel(spec=spec, hf_config=hf_config), _setup_for(setup, lora), lora_alpha=lora_alpha,
                      before_lora=load)
    return HFCausalLM(net, spec, hf_config).to(device)


def expected_tensors(spec: ModelSpec, setup, hf_config: dict) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(every tensor name and shape of transformers' model of ``hf_config``, the names a checkpoint may omit
    because they are tied to another), from the model built on the meta device."""
    from memplan.setup import TrainSetup

    setup = (setup or TrainSetup(precision="fp32")).replace(lora_rank=0, checkpointing="none", compile=False,
                                                           world_size=1, sharding="none")
    with torch.device("meta"):
        net = build(spec, setup, "meta", hf_config).net
    shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    tied = set()
    if getattr(net.config, "tie_word_embeddings", False):
        out = net.get_output_embeddings()
        for name, module in net.named_modules():
            if module is out and out is not None:
                tied.add(f"{name}.weight")
    return shapes, tied


SKIPPED = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias")


def check_weights(directory: Path, spec: ModelSpec, setup, hf_config: dict, flag: str = "--from"):
    # (``setup`` None: fp32, sdpa; the shapes do not depend on it)
    """The checkpoint's safetensors headers checked by name and shape against transformers' model of its
    config.json, no data read: the ``trainer.hf_import`` file set and the names to read; else a one-line
    InputError naming the first missing, unknown or misshapen tensor."""
    from trainer.hf_import import _Files, check_names_and_shapes

    files = _Files(directory)
    shapes, tied = expected_tensors(spec, setup, hf_config)
    present = {k: v for k, v in files.shapes.items() if not k.endswith(SKIPPED)}
    expected = {k: v for k, v in shapes.items() if k not in tied or k in present}  # a tied head may be absent
    check_names_and_shapes(f"{flag} {directory}", present, expected,
                           f"a {spec.layers}-layer {hf_config['model_type']}")
    return files, sorted(present)


def read_weights(directory: Path, spec: ModelSpec, setup, hf_config: dict, flag: str = "--from") -> dict:
    """The checkpoint's tensors under transformers' names, every one checked first (``check_weights``)."""
    files, names = check_weights(directory, spec, setup, hf_config, flag)
    return files.read(names)


def load_into(net: nn.Module, tensors: dict, where: str) -> None:
    """Copy HF-named ``tensors`` (checked by ``check_weights``) into transformers' model ``net``."""
    result = net.load_state_dict(tensors, strict=False)
    tied = set()
    if getattr(net.config, "tie_word_embeddings", False):
        tied = {k for k in result.missing_keys if net.get_output_embeddings() is not None and k.endswith("weight")
                and net.state_dict()[k].data_ptr() == net.get_input_embeddings().weight.data_ptr()}
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise InputError(f"{where}: does not match the model ({(missing or result.unexpected_keys)[0]})")
    if tied:
        net.tie_weights()


def merged(model: HFCausalLM) -> HFCausalLM:
    """A LoRA model with peft's adapters folded into its weights (``merge_and_unload``); others as they are."""
    net = model.net
    if hasattr(net, "merge_and_unload"):
        net = net.merge_and_unload()
    return HFCausalLM(net, model.spec, model.hf_config)


def run_config(meta: dict, where: str) -> dict:
    """The config.json contents a run of transformers' model class recorded in its checkpoint's meta.json."""
    cfg = meta.get(META_KEY)
    if cfg is None and isinstance(meta.get("base_hf"), dict):  # a run.json from before its first checkpoint
        cfg = meta["base_hf"].get("config")
    if cfg is None:
        raise InputError(f"{where}: a --stack transformers run's meta.json must record {META_KEY}")
    return check_config(cfg, where)


def trained(trained_ckpt, plan, meta: dict, device) -> HFCausalLM:
    """A verified checkpoint of transformers' model class, in eval mode on ``device``: rebuilt from the config it
    recorded, without checkpointing or compile, its LoRA adapters (peft's) folded into the weights."""
    from trainer import checkpoint_format as ckpt

    cfg = run_config(meta, str(trained_ckpt.path / ckpt.META_FILE))
    alpha = float(((meta.get("finetune") or {}).get("lora") or {}).get("alpha", 16.0))
    setup = plan.setup.replace(checkpointing="none", compile=False, world_size=1, sharding="none")
    model = build(plan.model, setup, "cpu", cfg, lora_alpha=alpha)
    path = trained_ckpt.path / ckpt.MODEL_FILE
    ckpt.load_weights(model, ckpt.read_weights(path), str(path))
    return merged(model).to(torch.device(device)).eval()


def import_checkpoint(directory: Path, spec: ModelSpec, cfg: dict, weights: bool, note: str | None):
    """A checkpoint directory as transformers' model class trains it: a ``trainer.hf_import.ImportedModel`` whose
    tensors keep transformers' names (read, every one checked, only with ``weights``) and whose ``hf_config``
    is its config.json; its tokenizer read as for memplan's own model."""
    import dataclasses

    from trainer import hf_import

    tokenizer, record = hf_import.read_tokenizer(directory, cfg, spec)
    tensors = read_weights(directory, spec, None, cfg) if weights else {}
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    spec = dataclasses.replace(spec, name=cfg.get("_name_or_path") or directory.name, source=str(directory))
    return hf_import.ImportedModel(path=directory, model_type=cfg["model_type"], spec=spec, tensors=tensors,
                                   tokenizer=tokenizer, tokenizer_record=record,
                                   dtype=(dtypes.pop() if len(dtypes) == 1 else "mixed") if tensors else "",
                                   max_ctx=spec.max_positions, notes=(note,) if note else (), hf_config=cfg)


def checkpoint_stack(directory: Path, asked: str | None, flag: str = "--from") -> tuple[str, ModelSpec, dict,
                                                                                        str | None]:
    """(the stack that trains the checkpoint in ``directory``, its spec, its config.json, the note of a stack
    chosen for the user); a config with ``auto_map`` is refused whichever stack trains it."""
    from memplan.model import from_hf_config

    cfg = json.loads((directory / "config.json").read_text(encoding="utf-8")) \
        if (directory / "config.json").is_file() else None
    if isinstance(cfg, dict) and "auto_map" in cfg:
        check_config(cfg, f"{flag} {directory}")
    spec = from_hf_config(directory / "config.json", stack_families=True)
    stack, note = choose_stack(asked, spec)
    if stack_class(stack).trains_hf_model:
        cfg = read_config(directory, flag)
    return stack, spec, cfg, note


def plain_weights(tensors: dict, where: str) -> dict:
    """A checkpoint of ``HFCausalLM`` (``net.``-prefixed names) as transformers' own names; a LoRA finetune's
    checkpoint (peft's names) is refused: finetune its export (``memplan export --format hf``) instead."""
    if any("lora_" in k or ".base_layer." in k for k in tensors):
        raise InputError(f"{where}: a LoRA finetune's weights; export it (`memplan export --format hf`) and "
                         "finetune the export with --from")
    return {k.removeprefix("net."): v for k, v in tensors.items()}

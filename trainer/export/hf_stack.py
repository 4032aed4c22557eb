"""Export of a run that trained transformers' own model class (``trainer.hf_model``, ``--stack transformers``).

``hf``: the model is rebuilt from the config.json contents the run recorded, its checkpoint loaded and peft's
LoRA adapters folded in (``merge_and_unload``); its ``state_dict`` is written as model.safetensors under
transformers' own names, beside that config.json (the run's end-of-text as its token ids, the export marker) and
the tokenizer files. ``AutoModelForCausalLM.from_pretrained`` loads it and gives the trained logits.

``gguf`` and ``onnx`` are refused in one line: memplan's GGUF writer maps memplan's own layout only; llama.cpp's
``convert_hf_to_gguf.py`` converts the ``hf`` export of every family llama.cpp has.
"""

from __future__ import annotations

from pathlib import Path

from memplan.errors import InputError
from memplan.memory.stacks import DEFAULT, stack_class
from trainer.export.common import MARKER, LoadedRun

TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def is_stack_run(run: LoadedRun) -> bool:
    """Whether the run trained transformers' model class (its plan's [setup] stack)."""
    return stack_class(((run.meta.get("plan") or {}).get("setup") or {}).get("stack", DEFAULT)).trains_hf_model


def check_format(run: LoadedRun, fmt: str) -> None:
    """Only ``hf`` writes transformers' model class; the other formats in one line naming the route."""
    if fmt == "hf":
        return
    model_type = (run.meta.get("hf_config") or {}).get("model_type", run.spec.arch)
    if fmt == "gguf":
        raise InputError(f"--format gguf: memplan's GGUF writer does not write transformers' {model_type} model "
                         "class yet; export with --format hf and convert that directory with llama.cpp's own "
                         "convert_hf_to_gguf.py")
    raise InputError(f"--format {fmt}: a run of transformers' {model_type} model class exports as --format hf "
                     "(accepted: hf); convert that directory with the runtime's own tools")


def write_hf_stack(run: LoadedRun, out: Path, dtype: str) -> tuple[str, list[str], int]:
    """(the class name, notes, parameters) of the ``hf`` export of ``run`` written to ``out``."""
    import torch

    from trainer import rundir
    from trainer.export.hf import write_hf_dir
    from trainer.hf_model import trained

    checkpoint = rundir.trained_checkpoint(run.run_dir, run.checkpoint)
    model = trained(checkpoint, checkpoint.plan, checkpoint.meta, "cpu")
    net = model.net
    state = net.state_dict()
    tied = set()
    if getattr(net.config, "tie_word_embeddings", False) and net.get_output_embeddings() is not None:
        emb = net.get_input_embeddings().weight
        tied = {k for k, v in state.items() if v.data_ptr() == emb.data_ptr() and k.startswith("lm_head")}
    tensors = {k: v.detach().to(getattr(torch, TORCH_DTYPES[dtype])).contiguous().clone()
               for k, v in state.items() if k not in tied}
    config = {**model.hf_config, "torch_dtype": dtype, "dtype": dtype, "use_cache": True,
              "architectures": [type(net).__name__], "bos_token_id": run.eot_id, "eos_token_id": run.eot_id}
    config[MARKER] = {"run": str(run.run_dir), "checkpoint": str(run.checkpoint), "step": run.step,
                      "tokens": run.meta.get("tokens"), "spec": run.spec.to_dict()}
    context = config.get("max_position_embeddings") or config.get("n_positions") or run.ctx
    write_hf_dir(run, out, tensors, config, context)
    params = sum(t.numel() for t in tensors.values())
    return type(net).__name__, [], params

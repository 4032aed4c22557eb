"""Other people's training code, traced exactly: the model and the step as each library writes them.

memplan's walk (``memplan/memory/``) is exact for memplan's own model. Most people train with
someone else's code, whose models save other tensors (an fp32 copy of every norm's input, K and V
expanded to every query head, a dropout mask before each adapter). ``trace_stack`` builds that
library's real model for a config and runs two training steps of it, in the library's own idiom,
under ``FakeTensorMode`` with ``MemTracker``: nothing is allocated, and the peak of live tensor
bytes is the one the library's code reaches on real tensors (``measure_stack`` runs the same
steps on real tensors, which is how the tests hold the trace to that).

Stacks (``--stack``):

- ``memplan``: memplan's own trainer (``trainer/model.py``, ``trainer/step.py``) (``trainer/stacks/memplan.py``);
- ``transformers``: Hugging Face transformers' ``AutoModelForCausalLM.from_config``, its
  ``labels=`` loss, ``gradient_checkpointing_enable()``, and peft's ``LoraConfig`` /
  ``get_peft_model`` for LoRA (``trainer/stacks/transformers.py``);
- ``litgpt``: litgpt's ``GPT(Config(...))`` with Fabric's precision plugin, pretrain.py's step
  (``chunked_cross_entropy``, clipping) or, with LoRA, finetune/lora.py's (``litgpt.lora``,
  ``mark_only_lora_as_trainable``, the head in chunks) (``trainer/stacks/litgpt.py``);
- ``torchtune``: torchtune's ``llama3`` / ``lora_llama3`` component builders and the step of its
  single-device recipes (``CEWithChunkedOutputLoss``, ``set_activation_checkpointing``,
  ``set_trainable_params``) (``trainer/stacks/torchtune.py``).

The libraries are optional: ``pip install 'memplan[stacks]'`` (transformers, peft),
``'memplan[litgpt]'``, ``'memplan[torchtune]'``, the last two each in an environment of its own
(their pins conflict with transformers 5's and peft's: pyproject.toml says how); without one, a
one-line error names its extra.

``trainer/stacks/ranks.py`` (``measure_stack_ranks``) runs a stack's step on several real gloo ranks, wrapped as
the library's own distributed code wraps it (its module's ``wrap_ranks``: litgpt, Fabric's DDP; torchtune, its
distributed recipes' ``training.shard_model``): what the walk of litgpt's ``--sharding ddp`` (DDP's reducer
cannot run on fake tensors) and torchtune's ``--sharding fsdp`` is held to.

Each module here is the trainer's twin of the planner's stack of the same name (``memplan.memory.stacks``,
whose ``STACKS`` this package takes): ``build_model``, ``train_step`` (None: memplan's own step), optionally
``make_optimizer``, ``as_on_real_tensors``, ``for_fake_tensors`` (the built model made to trace: transformers'
dynamic NTK RoPE) and ``quiet_import``, and ``LIBRARY``, the package it needs
(None for memplan's own).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from memplan.errors import InputError
from memplan.memory.stacks import STACKS, check_stack as check_planned_stack
from memplan.units import possessive

EXTRA = "pip install 'memplan[stacks]'"
# the extra that installs each stack's library (its twin's EXTRA), and what a trial of its step imports besides
EXTRAS = {"transformers": EXTRA, "litgpt": "pip install 'memplan[litgpt]'",
          "torchtune": "pip install 'memplan[torchtune]'"}
# what a trial of each stack runs (``trial_steps``), as ``autotune --verify`` names it
TRIAL_CODE = {"transformers": "transformers' Trainer with the emitted TrainingArguments",
              "litgpt": "litgpt's GPT and its scripts' step", "torchtune": "torchtune's builders and its recipes' step"}
TRIAL_IMPORTS = {"transformers": ("transformers", "accelerate"),  # Trainer runs on accelerate's Accelerator
                 "litgpt": ("litgpt", "lightning"), "torchtune": ("torchtune", "torchao")}


@dataclass(frozen=True)
class StackModel:
    """What a stack builds from: memplan's ModelSpec, or (transformers) a Hugging Face config.json's
    contents, which may name a family memplan's analytic model does not cover."""

    spec: object | None = None  # memplan.model.ModelSpec
    hf_config: dict | None = None  # a config.json, as read


def check_stack(stack: str) -> str:
    """``stack`` if a trace can take it (``STACKS``), else the one-line InputError naming them."""
    return check_planned_stack(stack, STACKS)


def require(module: str, stack: str, extra: str = EXTRA):
    """``module`` imported, or the one-line error naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise InputError(f"--stack {stack}: needs the {module} package; install it with {extra}") from None


def require_installed(stack: str, lora: bool = False) -> None:
    """Torch-free (nothing imported): the one-line InputError naming the extra to install where a package a trial
    of ``stack``'s step imports (``TRIAL_IMPORTS``; with ``lora``, peft for transformers) is not installed."""
    import importlib.util

    check_stack(stack)
    needed = TRIAL_IMPORTS.get(stack, ()) + (("peft",) if lora and stack == "transformers" else ())
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(f"--stack {stack}: needs the {', '.join(missing)} package{'s' if len(missing) > 1 else ''}; "
                         f"install {'them' if len(missing) > 1 else 'it'} with {EXTRAS[stack]}")


def trial_steps(stack: str, model: StackModel, setup, run_setup, steps: int, device, seed: int = 0,
                emitted: dict | None = None, on_step=None) -> None:
    """``steps`` real optimizer steps of ``stack``'s own code on ``device`` (``autotune --verify``), each of
    ``run_setup``'s micro-batches (``setup``'s, capped); ``on_step(seconds)`` after each.

    A stack whose twin has ``trial_steps`` runs its own (transformers: ``Trainer`` with the ``emitted``
    ``TrainingArguments``); the others run their twin's model, optimizer and step, as ``trace_stack``
    does, on real tensors: litgpt's ``GPT`` and its scripts' step, torchtune's builders and its recipes'.
    Every micro-batch's inputs of the plan's step exist for the whole step, as in memplan's own trial."""
    import time

    import torch

    from trainer import device as devices
    from trainer.step import set_matmul_precision

    check_stack(stack)
    module = _stack_module(stack)
    _require_library(stack, module)
    own = getattr(module, "trial_steps", None)
    if own is not None:
        own(model, setup, run_setup, steps, device, seed=seed, emitted=emitted or {}, on_step=on_step)
        return
    torch.manual_seed(seed)
    set_matmul_precision(setup.precision)
    with torch.device(device):
        net, optimizer, step = _built(stack, model, setup, None)
    gen = torch.Generator(device=device).manual_seed(seed)
    vocab = _vocab(model)

    def ids():
        return torch.randint(0, vocab, (setup.micro_batch, setup.ctx), device=device, generator=gen)

    batches = [(ids(), ids()) for _ in range(setup.grad_accum)]
    sync = devices.synchronizer(device)
    for _ in range(steps):
        t0 = time.perf_counter()
        step(net, optimizer, batches[:run_setup.grad_accum], run_setup, device.type)
        sync()
        if on_step is not None:
            on_step(time.perf_counter() - t0)


def _stack_module(stack: str):
    """trainer/stacks/<stack>.py, the trainer's twin of the planner's stack."""
    import importlib

    return importlib.import_module(f"trainer.stacks.{stack}")


def _vocab(model: StackModel) -> int:
    if model.hf_config is None:
        return model.spec.vocab
    vocab = model.hf_config.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise InputError(f"--model: vocab_size {vocab!r} must be a positive integer")
    return vocab


def _built(stack: str, model: StackModel, setup, lora_dropout: float | None, wrap=None):
    """(the stack's model, its optimizer, its step function) for ``setup``; memplan's own step is None:
    ``trainer.measure._tracked_steps`` takes it by default. ``wrap`` (a stack's ``wrap_ranks``), where given,
    wraps the model before its optimizer is made, as the library's distributed code does (FSDP2's sharded
    parameters are new tensors: the optimizer must be given them)."""
    from trainer.step import make_optimizer

    module = _stack_module(stack)
    net = module.build_model(model, setup, lora_dropout=lora_dropout)
    if wrap is not None:
        net = wrap(net, setup)
    own = getattr(module, "make_optimizer", None)  # the library's optimizer as its scripts make it
    return net, own(net, setup) if own else make_optimizer(net, setup.optimizer), module.train_step


def require_stack(stack: str, lora: bool = False) -> None:
    """The one-line InputError naming the extra to install when ``stack``'s library is missing (with ``lora``,
    also the library its adapters come from: ``LORA_LIBRARY``, peft for transformers)."""
    check_stack(stack)
    module = _stack_module(stack)
    _require_library(stack, module)
    if lora and getattr(module, "LORA_LIBRARY", None):
        require(module.LORA_LIBRARY, stack)


def _require_library(stack: str, module) -> None:
    """The one-line InputError naming the extra where ``module``'s library is missing (memplan's own needs none)."""
    if module.LIBRARY is None:
        return
    with getattr(module, "quiet_import", contextlib.nullcontext)():  # missing: the one line, before any import
        require(module.LIBRARY, stack, getattr(module, "EXTRA", EXTRA))


def _as_on_real_tensors(stack: str):
    """The stack's code on fake tensors takes the path it takes on real ones (``transformers.as_on_real_tensors``)."""
    module = _stack_module(stack)
    _require_library(stack, module)
    return module.as_on_real_tensors()


def trace_stack(stack: str, model: StackModel, setup, device: str = "cpu", lora_dropout: float | None = None,
                accelerator: bool = False, wrap=None, warmup: int = 0):
    """The exact live-tensor peak of a steady-state step of ``stack``'s code (``trainer.measure.StepMemory``),
    on fake tensors claiming to live on ``device``: two steps under ``FakeTensorMode`` and ``MemTracker``.
    ``accelerator``: the step is planned for an accelerator though the fake tensors live on the CPU:
    dropout as its kernels run it, a bool mask (``trainer.measure.AcceleratorDropout``). ``wrap`` (a stack's
    ``wrap_ranks``, under a process group): the model wrapped before its optimizer is made; ``warmup``: steps taken
    untraced first (``trainer.stacks.ranks.trace_stack_rank``: DTensor's sharding propagation makes fake tensors the
    first time it meets each op and shape, which a real step does not hold; it caches what it found)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainer.measure import (_AS_ACCELERATOR, AcceleratorDropout, StepMemory, _random_ids, _tracked_steps,
                                 traced_accumulation, with_untraced_inputs)
    from trainer.step import set_matmul_precision

    check_stack(stack)
    asked, setup = setup, traced_accumulation(setup)  # the peak of N micro-batches: the second's, plus their ids
    set_matmul_precision(setup.precision)
    with FakeTensorMode(allow_non_fake_inputs=False), torch.device(device), _as_on_real_tensors(stack), \
            (AcceleratorDropout() if accelerator else contextlib.nullcontext()):
        net, optimizer, step = _built(stack, model, setup, lora_dropout, wrap)
        for_fake_tensors = getattr(_stack_module(stack), "for_fake_tensors", None)
        if for_fake_tensors is not None:  # what the model's code reads of a value, settled before it runs
            for_fake_tensors(net, setup)
        for _ in range(warmup):
            step(net, optimizer, _random_ids(_vocab(model), setup, device), setup, torch.device(device).type)
        total, categories, _ = _tracked_steps(net, optimizer, setup, lambda: _random_ids(_vocab(model), setup, device),
                                              torch.device(device).type, step_fn=step)
    return with_untraced_inputs(
        StepMemory(peak_allocated=total, breakdown=categories, params=sum(p.numel() for p in net.parameters()),
                   method=f"{possessive(stack)} model and step, MemTracker under FakeTensorMode "
                          f"({device}{_AS_ACCELERATOR if accelerator else ''})"),
        asked, torch.device(device).type)


def measure_stack(stack: str, model: StackModel, setup, seed: int = 0, lora_dropout: float | None = None):
    """The same two steps as ``trace_stack`` on real tensors on the CPU, under ``MemTracker``: the
    ground truth a trace is held to."""
    import torch

    from trainer.measure import StepMemory, _random_ids, _tracked_steps
    from trainer.step import set_matmul_precision

    check_stack(stack)
    torch.manual_seed(seed)
    set_matmul_precision(setup.precision)
    gen = torch.Generator().manual_seed(seed)
    net, optimizer, step = _built(stack, model, setup, lora_dropout)
    total, categories, _ = _tracked_steps(net, optimizer, setup, lambda: _random_ids(_vocab(model), setup, "cpu", gen),
                                          "cpu", step_fn=step)
    return StepMemory(peak_allocated=total, breakdown=categories, params=sum(p.numel() for p in net.parameters()),
                      method=f"{possessive(stack)} model and step, MemTracker on real tensors (cpu)")



class _Forgetful(dict):
    """A memo that keeps nothing."""

    def __setitem__(self, key, value) -> None:
        pass


@contextlib.contextmanager
def converting_fake_parameters():
    """Within this block, ``Module.to`` can convert fake parameters (peft casts each adapter to its
    base layer's dtype that way); outside a FakeTensorMode it changes nothing.

    ``Module._apply`` swaps a FakeTensor parameter for its converted copy with
    ``torch.utils.swap_tensors``, which refuses a tensor that something holds a weak reference to,
    and FakeTensorMode's MetaConverter keeps one to every tensor it makes (its memo of real tensor →
    fake tensor, for constants). The block's new tensors stay out of that memo; the memo is back
    as it was afterwards."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode()
    if mode is None:
        yield
        return
    converter = mode.fake_tensor_converter.meta_converter
    saved = converter.tensor_memo, converter.storage_memo
    converter.tensor_memo, converter.storage_memo = _Forgetful(), _Forgetful()
    try:
        yield
    finally:
        converter.tensor_memo, converter.storage_memo = saved

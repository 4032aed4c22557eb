"""Whose training code the memory walk follows (``memplan estimate --stack``): torch-free.

Each stack is one module here, a ``Stack`` subclass whose hooks the walk calls at fixed points
(``memplan.memory.walk``) and whose attributes say what its code builds and runs:

- ``base.py``: ``Stack``, memplan's own model and step (``trainer/model.py``, ``trainer/step.py``): every
  hook adds nothing, so ``--stack memplan`` is the walk as it always was;
- ``transformers.py``: Hugging Face transformers' model and ``Trainer`` step, with peft's LoRA;
- ``litgpt.py``: litgpt's ``GPT`` and its single-device scripts' step, also under Fabric's DDP (``--sharding ddp``)
  and, with LoRA, finetune_lora's FSDP2 (``--sharding fsdp``: ``litgpt_sharding.py``);
- ``torchtune.py``: torchtune's ``llama3`` / ``lora_llama3`` and its single-device recipes' step;
  ``torchtune_fsdp.py``: its distributed recipes' ``custom_sharded_layers`` (FSDP2 groups of their own).

Each has a same-named twin on the trainer's side, ``trainer/stacks/<name>.py``, which builds the library's
model and runs its step on fake tensors (``memplan trace --stack``). ``REGISTRY`` names them all, in the
order the flags list them; the ``check_*`` functions below take a ``--stack`` name, look its stack up and
ask it. The stacks import ``memplan.memory.terms`` and nothing else of the walk (but a stack's own FSDP2 layout,
a ``memplan.memory.sharding.FullyShard`` subclass its ``fsdp_hook`` returns): the walk takes the stack object it is
given.

A new stack is one module here (a ``Stack`` subclass: its ``name``, ``library``, what its code takes, the
hooks its library changes), its class in ``REGISTRY`` below, and its trainer twin ``trainer/stacks/<name>.py``
(``LIBRARY``, ``build_model``, ``train_step``), which ``trainer.stacks`` finds by the name.
"""

from __future__ import annotations

import dataclasses

from memplan.errors import InputError
from memplan.memory.stacks.base import LOSS_DTYPES, Stack
from memplan.memory.stacks.litgpt import LitgptStack
from memplan.memory.stacks.torchtune import TorchtuneStack
from memplan.memory.stacks.transformers import TransformersStack

__all__ = ["LOSS_DTYPES", "MEMPLAN", "REGISTRY", "STACKS", "Stack", "check_lora_targets", "check_loss_dtype",
           "check_stack", "check_stack_builds", "check_stack_setup", "stack_class", "stack_for"]

# the stacks, by their --stack name, in the order the flags list them: a new stack is one line here
REGISTRY: dict[str, type[Stack]] = {s.name: s for s in (Stack, TransformersStack, LitgptStack, TorchtuneStack)}
STACKS = tuple(REGISTRY)  # the names: ("memplan", "transformers", "litgpt", "torchtune")
DEFAULT = Stack.name  # --stack's default: memplan's own step

MEMPLAN = Stack()


def check_stack(stack: str, accepted: tuple[str, ...] = STACKS) -> str:
    """``stack`` if it is one of ``accepted`` (the registry's stacks by default), else the one-line InputError
    naming them."""
    if stack not in accepted:
        raise InputError(f"--stack: unknown {stack!r} (accepted: {', '.join(accepted)})")
    return stack


def stack_class(stack: str) -> type[Stack]:
    """The class of ``--stack stack`` (``REGISTRY``), after ``check_stack``."""
    return REGISTRY[check_stack(stack)]


def check_stack_builds(stack: str, spec, accepted: tuple[str, ...] = STACKS) -> str:
    """``stack`` if its code builds ``spec``'s family, else the one-line InputError naming the stacks
    that do (``Stack.check_builds``): memplan's own trainer builds llama, gpt2 and gpt_neox only
    (``ModelSpec.memplan_builds``); phi, gemma, stablelm and qwen3 are walked as transformers runs them."""
    check_stack(stack, accepted)
    stack_class(stack)().check_builds(spec, accepted)
    return stack


def check_stack_setup(stack: str, spec, setup) -> str:
    """``stack`` if its code runs ``setup``'s step for ``spec``, else the one-line InputError naming what
    it takes: ``check_lora_targets``'s, then the stack's own (``Stack.check_setup``: litgpt's scripts and
    torchtune's recipes on one device)."""
    check_lora_targets(stack, spec, setup)
    stack_class(stack)().check_setup(spec, setup)
    return stack


def check_lora_targets(stack: str, spec, setup) -> None:
    """The one-line InputError where ``stack``'s code cannot put adapters where ``--lora-targets`` says
    (``Stack.check_lora_targets``)."""
    stack_class(stack)().check_lora_targets(spec, setup)


def check_loss_dtype(loss_dtype: str) -> str:
    if loss_dtype not in LOSS_DTYPES:
        raise InputError(f"--loss-dtype: unknown {loss_dtype!r} (accepted: {', '.join(LOSS_DTYPES)})")
    return loss_dtype


def stack_for(name: str = DEFAULT, loss_dtype: str | None = None, lora_dropout: float | None = None,
              cpu: bool = False, own_loop: bool = False) -> Stack:
    """The hooks of stack ``name``; ``loss_dtype`` None: what the stack's own loss does (fp32 for all);
    ``lora_dropout`` None: the stack's own default (``Stack.lora_default_dropout``); ``own_loop``: memplan's loop
    trains the stack's model class, not the library's own (``Stack.own_loop``)."""
    cls = stack_class(name)
    if lora_dropout is None:
        lora_dropout = cls.lora_default_dropout
    if not 0.0 <= lora_dropout < 1.0:
        raise InputError(f"--lora-dropout: {lora_dropout} must be in [0, 1)")
    return cls(loss_dtype=check_loss_dtype(loss_dtype or "fp32"), lora_dropout=lora_dropout, cpu=cpu,
               own_loop=own_loop)


def stack_from_flags(stack: str, loss_dtype: str | None, lora_dropout: float | None, spec, setup) -> Stack:
    """The walk's hooks for --stack, --loss-dtype and --lora-dropout, or a one-line error: a family the stack's
    code does not build (``check_stack_builds``: phi, gemma, stablelm, qwen3 under --stack memplan), or a
    setting it does not have. estimate, autotune and sweep check alike."""
    if lora_dropout is not None and (not stack_class(stack).has_lora_dropout or not setup.lora_rank
                                     or not 0.0 <= lora_dropout < 1.0):
        raise InputError(f"--lora-dropout {lora_dropout}: a probability in [0, 1) for --stack transformers, litgpt "
                         "or torchtune with --lora-rank (memplan's own adapters have no dropout)")
    check_stack_builds(stack, spec)
    stack_class(stack)().check_walked(setup)
    check_stack_setup(stack, spec, setup)
    return stack_for(stack, loss_dtype, lora_dropout if setup.lora_rank else 0.0)


def with_custom_sharded_layers(stack: Stack, choice: str, spec, setup, reshard_after_forward: bool = True) -> Stack:
    """``stack`` with torchtune's ``custom_sharded_layers`` set to ``choice`` (``--custom-sharded-layers``) and its
    ``fsdp_reshard_after_forward``, or the one-line InputError: another stack or no FSDP (accepted there: auto and
    the default), a value not taken, a tied head's ``tok_embeddings`` (``tt_check_custom_sharded_layers``), groups
    of their own kept from forward to backward (not walked)."""
    from memplan.memory.stacks.torchtune_fsdp import tt_check_custom_sharded_layers, tt_custom_sharded_layers

    flag = f"--custom-sharded-layers {choice}" if reshard_after_forward else "--no-fsdp-reshard-after-forward"
    if stack.name != "torchtune" or setup.sharding != "fsdp":
        raise InputError(f"{flag}: torchtune's FSDP2 layout applies to --stack torchtune --sharding fsdp "
                         "(accepted otherwise: --custom-sharded-layers auto, --fsdp-reshard-after-forward)")
    tt_check_custom_sharded_layers(spec, choice)
    if not reshard_after_forward and tt_custom_sharded_layers(spec, setup, choice):
        raise InputError("--no-fsdp-reshard-after-forward: not walked with the embedding and head as groups of "
                         "their own (accepted with it: --custom-sharded-layers none)")
    return dataclasses.replace(stack, custom_sharded_layers=choice, fsdp_reshard_after_forward=reshard_after_forward)


def walked_for(stack: Stack, setup) -> Stack:
    """The hooks the walk follows for ``setup``: ``stack``, or where that is memplan's own step and the plan
    trains another stack's model class (``TrainSetup.stack``: transformers'), that stack's."""
    if type(stack) is Stack and setup.stack != Stack.name:
        return stack_for(setup.stack, own_loop=True)
    return stack


def shown(stack: str) -> str | None:
    """``--stack``'s name where a report or a plan file names it: None for memplan's own step, the default
    (the JSON and the files as they always were)."""
    return None if stack == DEFAULT else stack

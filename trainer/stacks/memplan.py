"""The memplan stack: memplan's own model and step (``trainer/model.py``, ``trainer/step.py``), built as the
other stacks' modules build theirs, so ``trace_stack("memplan", ...)`` traces the step ``memplan train`` runs.

Its planner twin is ``memplan.memory.stacks.base.Stack``, whose hooks add nothing: the walk is memplan's step.
"""

from __future__ import annotations

import contextlib

import torch

from memplan.errors import InputError
from memplan.setup import TrainSetup
from trainer.lora import lora_for
from trainer.model import build_model as build_memplan_model
from trainer.stacks import StackModel
from trainer.step import make_optimizer as make_memplan_optimizer, param_dtype

STACK = "memplan"
LIBRARY = None  # memplan's own code: no library to install
train_step = None  # trainer.measure._tracked_steps takes memplan's own step by default


def build_model(model: StackModel, setup: TrainSetup, lora_dropout: float | None = None) -> torch.nn.Module:
    """memplan's model for ``model.spec``, with memplan's adapters where ``setup`` asks for LoRA."""
    if model.spec is None:
        raise InputError("--stack memplan: memplan's own model needs a shape it covers "
                         "(--params, --arch … or a config.json of llama, mistral, qwen2, gpt2, gpt_neox)")
    return lora_for(build_memplan_model(model.spec, setup.attention, setup.checkpointing,
                                        param_dtype(setup.precision)), setup)


def make_optimizer(net: torch.nn.Module, setup: TrainSetup) -> torch.optim.Optimizer:
    """memplan's optimizer (``trainer.step.make_optimizer``)."""
    return make_memplan_optimizer(net, setup.optimizer)


def as_on_real_tensors():
    """memplan's own step takes one path on fake and real tensors."""
    return contextlib.nullcontext()

"""What a ``trainer.loop.Trainer`` trains, given to it as factories: how the model is built (with the weights
it starts from), where its batches come from, how it is evaluated, what its checkpoints record of where it
came from. The trainer calls the same factories in one process and in every rank of a distributed run.

``pretraining(data, starting)`` is ``memplan train``'s: a seeded initialisation (or ``--from``'s weights,
``StartingWeights``) on a prepared corpus. ``trainer.finetune.finetune_task`` is ``memplan finetune``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from memplan.errors import InputError
from memplan.memory.stacks import stack_class
from memplan.model import ModelSpec
from memplan.plan import Plan
from memplan.setup import TrainSetup
from trainer import checkpoint_format as ckpt


@dataclass(frozen=True, kw_only=True)
class TrainingTask:
    """The factories of a run.

    ``build_model(spec, setup, device, with_weights)``: the plain module (no DDP/FSDP wrapper, its activation
    checkpointing applied) on ``device``, seeded by the caller; ``with_weights``: load the weights the run
    starts from (False on the meta device, on the ranks that receive rank 0's, and when a checkpoint's
    weights will be loaded instead). Only its trainable parameters are trained.

    ``make_stream(micro_batch=, ctx=, seed=, rank=, world_size=)``: the training batches, resumable
    (``state_dict``/``load_state_dict``), ``epoch_plan(epoch)`` and ``global_batch`` (rows of all ranks per
    micro-batch); each rank reads its own share of every global batch.

    ``evaluate(model, setup, device, max_batches)``: the held-out losses (``trainer.loop_eval.evaluate``'s
    keys); ``prompts()``: the sample prompts when none are configured; ``meta(setup)``: keys every
    checkpoint's meta.json adds; ``kind``: RUN/run.json's kind (what resumes it)."""

    kind: str = "train"
    build_model: Callable[[ModelSpec, TrainSetup, torch.device | str, bool], torch.nn.Module]
    make_stream: Callable[..., object]
    evaluate: Callable[[torch.nn.Module, TrainSetup, torch.device, int], dict]
    prompts: Callable[[], list[str]]
    meta: Callable[[TrainSetup], dict] = field(default=lambda setup: {})

    def built(self, spec: ModelSpec, setup: TrainSetup, *, dist, seed: int, device: torch.device,
              with_weights: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(the model as trained, the plain module) for this process: in one, ``build_model`` seeded with
        ``seed`` (the same module twice); over several ranks (``dist``: ``trainer.distributed.DistContext``),
        wrapped with DDP or FSDP2 (``trainer.distributed.build_wrapped_model``: rank 0's weights in every rank;
        FSDP2's plain module is sharded in place). ``with_weights``: the weights the run starts from are loaded
        (False where a checkpoint's will be)."""
        if dist.world_size > 1:
            from trainer import distributed

            wrapped = distributed.build_wrapped_model(
                spec, setup, dist, seed,
                build=lambda device, rank0: self.build_model(spec, setup, device, rank0 and with_weights))
            return wrapped, distributed.unwrapped(wrapped)
        torch.manual_seed(seed)
        model = self.build_model(spec, setup, device, with_weights)
        return model, model


@dataclass(frozen=True)
class StartingWeights:
    """Weights a new run starts from instead of a seeded initialisation (``memplan train --from``: a Hugging
    Face checkpoint, continued pretraining). ``load()`` reads them as canonical-named tensors, called once
    while the model is built, after the process's baseline memory is taken (so the copy it holds only
    briefly is not counted as runtime context); on ranks other than 0 it is not called, since DDP and FSDP
    take rank 0's weights. ``record`` is what the run keeps of where they came from (``base_hf`` in
    run.json and each checkpoint's meta.json): path, model_type, dtype and ``weights_sha256``."""

    load: Callable[[], dict]
    record: dict
    where: str
    hf_config: dict | None = None  # transformers' model class trains (``trainer.hf_model``): its config.json


def starting_from_hf(directory: Path, spec, *, model_type: str, recorded_sha256: str | None = None,
                     flag: str = "--from") -> StartingWeights:
    """The weights of the Hugging Face checkpoint in ``directory`` as a run's start: names and shapes checked
    against ``spec`` now (headers only), the files' sha256 taken now (``recorded_sha256``: it must still be
    that one, for a run that starts again from step 0), the tensors read when the model is built."""
    from trainer import hf_import

    hf_import.check_weights(directory, spec)
    sha = hf_import.weights_sha256(directory)
    if recorded_sha256 is not None and sha != recorded_sha256:
        raise InputError(f"{flag}: the weights in {directory} changed since the run started from them (sha256 "
                         f"{sha[:12]}, recorded {recorded_sha256[:12]}); start a new run from them instead")

    def load() -> dict:
        return hf_import.read_weights(directory, spec)[0]

    return StartingWeights(load=load, record={"path": str(directory.resolve()), "model_type": model_type,
                                              "weights_sha256": sha}, where=f"{flag} {directory}")


def starting_from_hf_stack(directory: Path, spec: ModelSpec, setup, hf_config: dict, *, model_type: str,
                           recorded_sha256: str | None = None, flag: str = "--from") -> StartingWeights:
    """The ``StartingWeights`` of a Hugging Face checkpoint for transformers' model class (``trainer.hf_model``):
    names and shapes checked now (headers only), read when the model is built."""
    from trainer import hf_import
    from trainer.hf_model import check_weights, read_weights

    check_weights(directory, spec, setup, hf_config, flag)
    sha = hf_import.weights_sha256(directory)
    if recorded_sha256 is not None and sha != recorded_sha256:
        raise InputError(f"{flag}: the weights in {directory} changed since the run started from them (sha256 "
                         f"{sha[:12]}, recorded {recorded_sha256[:12]}); start a new run from them instead")
    return StartingWeights(load=lambda: read_weights(directory, spec, setup, hf_config, flag),
                           record={"path": str(directory.resolve()), "model_type": model_type,
                                   "weights_sha256": sha, "config": hf_config},
                           where=f"{flag} {directory}", hf_config=hf_config)


def starting_weights_again(meta: dict, where: str, plan: Plan) -> StartingWeights:
    """A ``--from`` run resumed before its first checkpoint starts again from the checkpoint it recorded."""
    base = meta.get("base_hf")
    if not isinstance(base, dict) or not isinstance(base.get("path"), str) \
            or not isinstance(base.get("weights_sha256"), str):
        raise InputError(f"--resume: {where}: base_hf must name the checkpoint's path and weights_sha256")
    directory = Path(base["path"])
    if not directory.is_dir():
        raise InputError(f"--resume: the run stopped before its first checkpoint and started from {directory}, "
                         "which is gone; start it again with --from")
    if stack_class(plan.setup.stack).trains_hf_model:  # transformers' model class, of the config.json it recorded
        from trainer import hf_model

        return starting_from_hf_stack(directory, plan.model, plan.setup, hf_model.run_config(meta, where),
                                         model_type=str(base.get("model_type")),
                                         recorded_sha256=base["weights_sha256"], flag="--resume")
    return starting_from_hf(directory, plan.model, model_type=str(base.get("model_type")),
                            recorded_sha256=base["weights_sha256"], flag="--resume")


def pretraining(data, starting: StartingWeights | None = None, hf_config: dict | None = None) -> TrainingTask:
    """``memplan train``'s task: the reference model (from ``starting``'s weights when given, else as seeded),
    windows of the prepared corpus ``data`` (``trainer.data.TrainStream``), its held-out windows per source,
    prompts from its held-out documents. A plan of ``--stack transformers`` trains transformers' model class
    (``trainer.hf_model``) of ``hf_config`` (a resumed run's), else of ``starting``'s checkpoint, else of the
    spec."""
    from trainer.data import TrainStream
    from trainer.loop_eval import default_prompts, evaluate
    from trainer.model import build_model
    from trainer.step import param_dtype

    built_from: dict = {}  # the config transformers' model was built from, for every checkpoint's meta.json

    def config(spec: ModelSpec, setup: TrainSetup) -> dict:
        from trainer import hf_model

        if hf_config is not None:
            cfg = hf_config
        elif starting is not None and starting.hf_config is not None:
            cfg = starting.hf_config
        else:
            cfg = hf_model.spec_hf_config(spec, setup)
        built_from["config"] = cfg
        return cfg

    def model(spec: ModelSpec, setup: TrainSetup, device, with_weights: bool) -> torch.nn.Module:
        if stack_class(setup.stack).trains_hf_model:
            from trainer import hf_model

            weights = starting.load() if with_weights and starting is not None else None
            return hf_model.build(spec, setup, device, config(spec, setup), weights=weights)
        built = build_model(spec, setup.attention, setup.checkpointing, param_dtype(setup.precision), device=device)
        if with_weights and starting is not None:
            ckpt.load_weights(built, starting.load(), starting.where)
        return built

    def stream(*, micro_batch: int, ctx: int, seed: int, rank: int, world_size: int):
        return TrainStream(data, batch=micro_batch, ctx=ctx, seed=seed, rank=rank, world_size=world_size)

    def meta(setup: TrainSetup) -> dict:
        from trainer import hf_model

        return {hf_model.META_KEY: built_from["config"]} if stack_class(setup.stack).trains_hf_model else {}

    return TrainingTask(kind="train", build_model=model, make_stream=stream,
                        evaluate=lambda m, setup, device, n: evaluate(m, data, setup, device, n),
                        prompts=lambda: default_prompts(data, data.tokenizer), meta=meta)

"""Supervised finetuning of a trained run on instruction data: what ``memplan finetune`` runs.

Data: a JSONL file, one example per line, in either form

- ``{"prompt": "...", "response": "..."}``
- ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``

Each example is rendered with a template and tokenized with the base run's own tokenizer. The loss
is on the responses only: every prompt token (system and user turns, the role headers) gets the
label -100, which ``trainer.model.lm_loss`` ignores. The ``chat`` template (the default) writes

    ### User:\\n{prompt}\\n\\n### Assistant:\\n{response}<end-of-text>

(``### System:`` for a system turn), so prompt a finetuned model the same way (``memplan generate
--prompt "### User:\\n...\\n\\n### Assistant:\\n"``). ``plain`` concatenates prompt and response
as they are. Every example ends with the end-of-text token, labelled, so the model learns to stop.

Batches are ``packed`` (examples one after another, cut into rows of ctx + 1 tokens: no padding,
an example may straddle two rows) or ``padded`` (one example per row, right-padded with the
end-of-text token, whose labels are -100). An example longer than the context is cut to it; one
with no response token left is dropped (both counted in ``SFTData.stats``). Every tenth example
is held out for the evaluation loss (responses only).

Training reuses ``trainer.loop.Trainer`` whole (schedule, logging, atomic checkpoints, resume,
the report, several processes under torchrun): ``finetune_task`` gives it the factories of a finetune,
a model built from the base run's newest checkpoint (with LoRA adapters if the plan has ``lora_rank``
> 0, ``trainer/lora.py``), these rows instead of a prepared corpus (each rank its share of every batch),
and the held-out examples' loss.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memplan.errors import InputError
from memplan.memory.stacks import stack_class
from memplan.plan import Plan
from trainer import checkpoint_format as ckpt
from trainer.loop_eval import ppl as _ppl
from trainer.lora import DEFAULT_ALPHA, apply_lora, lora_targets
from trainer.task import TrainingTask
from trainer.model import apply_checkpointing, build_model, lm_loss
from trainer.step import autocast, param_dtype

IGNORE = -100
TEMPLATES = ("chat", "plain")
PACKINGS = ("packed", "padded")
HEADERS = {"system": "### System:\n", "user": "### User:\n", "assistant": "### Assistant:\n"}
VAL_EVERY = 10  # every tenth example is held out


def render(example: dict, template: str) -> list[tuple[str, bool]]:
    """An example as (text, trained) pieces in order; ``trained`` marks response text."""
    if "messages" in example:
        pieces = []
        for m in example["messages"]:
            role, content = m["role"], m["content"]
            if template == "chat":
                pieces.append((HEADERS[role], False))
                pieces.append((content, role == "assistant"))
                pieces.append(("\n\n", role == "assistant"))
            else:
                pieces.append((content, role == "assistant"))
        if template == "chat" and pieces:
            pieces.pop()  # no separator after the last turn: the end-of-text token follows
        return pieces
    if template == "chat":
        return [(f"{HEADERS['user']}{example['prompt']}\n\n{HEADERS['assistant']}", False), (example["response"], True)]
    return [(example["prompt"], False), (example["response"], True)]


def prompt_text(example: dict, template: str) -> str:
    """The text a finetuned model is prompted with for this example: everything before its first response."""
    out = []
    for text, trained in render(example, template):
        if trained:
            break
        out.append(text)
    return "".join(out)


def _check_example(obj, where: str) -> dict:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: each line must be a JSON object with prompt/response or messages")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise InputError(f"{where}: messages must be a non-empty list")
        for m in msgs:
            if not isinstance(m, dict) or m.get("role") not in HEADERS or not isinstance(m.get("content"), str):
                raise InputError(f"{where}: each message needs a role ({', '.join(HEADERS)}) and a string content")
        if not any(m["role"] == "assistant" for m in msgs):
            raise InputError(f"{where}: the conversation has no assistant message to learn")
        return obj
    if isinstance(obj.get("prompt"), str) and isinstance(obj.get("response"), str):
        return obj
    raise InputError(f"{where}: expected keys prompt and response (strings) or messages (accepted forms: "
                     '{"prompt": ..., "response": ...} or {"messages": [{"role": ..., "content": ...}]})')


def read_jsonl(path: str | Path) -> list[dict]:
    """The examples of a JSONL file, each checked; a bad line is an InputError naming it."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--data: no such file {str(path)!r} (a JSONL file of prompt/response or messages)")
    examples = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"--data {path}: line {i} is not JSON ({e.msg})") from None
            examples.append(_check_example(obj, f"--data {path}: line {i}"))
    if not examples:
        raise InputError(f"--data {path}: holds no examples")
    return examples


@dataclass
class Example:
    ids: list[int]
    trained: list[bool]  # per token: part of a response (its prediction is trained)


def tokenize(example: dict, tokenizer, template: str) -> Example:
    ids, trained = [], []
    for text, is_response in render(example, template):
        piece = tokenizer.encode(text) if text else []
        ids += piece
        trained += [is_response] * len(piece)
    ids.append(tokenizer.eot_id)
    trained.append(True)
    return Example(ids, trained)


def _rows(examples: list[Example], ctx: int, packing: str, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, ctx + 1) token ids and targets-mask rows; the inputs are row[:-1], the targets row[1:]."""
    if not examples:
        return torch.zeros((0, ctx + 1), dtype=torch.long), torch.zeros((0, ctx + 1), dtype=torch.bool)
    if packing == "padded":
        ids = torch.full((len(examples), ctx + 1), pad_id, dtype=torch.long)
        mask = torch.zeros((len(examples), ctx + 1), dtype=torch.bool)
        for i, e in enumerate(examples):
            ids[i, :len(e.ids)] = torch.tensor(e.ids)
            mask[i, :len(e.trained)] = torch.tensor(e.trained)
        return ids, mask
    flat = torch.tensor([t for e in examples for t in e.ids], dtype=torch.long)
    flags = torch.tensor([t for e in examples for t in e.trained], dtype=torch.bool)
    rows = max(1, math.ceil((len(flat) - 1) / ctx))
    ids = torch.full((rows, ctx + 1), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, ctx + 1), dtype=torch.bool)
    for r in range(rows):  # rows overlap by one token: the last target of a row is the next row's first input
        chunk = flat[r * ctx: r * ctx + ctx + 1]
        ids[r, :len(chunk)] = chunk
        mask[r, :len(chunk)] = flags[r * ctx: r * ctx + ctx + 1]
    return ids, mask


def batch_of(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of rows: targets are the next tokens, -100 where they are not a response's."""
    x = ids[:, :-1].contiguous()
    y = torch.where(mask[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE))
    return x, y


@dataclass
class SFTData:
    """Finetuning data, tokenized with the base run's tokenizer; offers what ``Trainer`` asks of prepared data."""

    path: Path
    tokenizer: object
    manifest: dict  # {"tokenizer": the base run's tokenizer record}
    template: str
    packing: str
    ctx: int
    train_ids: torch.Tensor
    train_mask: torch.Tensor
    val_ids: torch.Tensor
    val_mask: torch.Tensor
    sha256: str
    prompts: list[str]
    base_checkpoint: Path
    base_run: Path
    lora_alpha: float = DEFAULT_ALPHA
    stats: dict = field(default_factory=dict)
    base_weights: dict | None = None  # canonical tensors of an imported Hugging Face checkpoint (``base_of_hf``)
    base_hf: dict | None = None  # what was imported: {"path", "model_type", "dtype"}
    hf_config: dict | None = None  # transformers' model class trains (trainer.hf_model): the config.json it is of

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def train_tokens(self) -> int:
        """Tokens in the training rows (each row counts ctx inputs)."""
        return int(self.train_ids.shape[0]) * self.ctx

    @property
    def source_names(self) -> list[str]:
        return [self.path.name]

    def verify(self) -> None:
        """The JSONL file is still the one that was read."""
        if hashlib.sha256(self.path.read_bytes()).hexdigest() != self.sha256:
            raise InputError(f"--data {self.path}: changed while it was being read; run again")


def load_sft(path: str | Path, tokenizer, tokenizer_record: dict, *, ctx: int, template: str = "chat",
             packing: str = "packed", base_checkpoint: Path, base_run: Path,
             lora_alpha: float = DEFAULT_ALPHA, base_weights: dict | None = None,
             base_hf: dict | None = None) -> SFTData:
    if template not in TEMPLATES:
        raise InputError(f"--template: unknown {template!r} (accepted: {', '.join(TEMPLATES)})")
    if packing not in PACKINGS:
        raise InputError(f"--packing: unknown {packing!r} (accepted: {', '.join(PACKINGS)})")
    path = Path(path)
    raw = read_jsonl(path)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    train, val, truncated, dropped = [], [], 0, 0
    for i, ex in enumerate(raw):
        e = tokenize(ex, tokenizer, template)
        if len(e.ids) > ctx + 1:
            truncated += 1
            e = Example(e.ids[:ctx + 1], e.trained[:ctx + 1])
        if not any(e.trained[1:]):  # nothing to predict (a target is a token after the first)
            dropped += 1
            continue
        held_out = len(raw) >= 2 and (i % VAL_EVERY == VAL_EVERY - 1 or (len(raw) < VAL_EVERY and i == len(raw) - 1))
        (val if held_out else train).append((ex, e))
    if not train:
        raise InputError(f"--data {path}: no example keeps a response token within --ctx {ctx} (dropped {dropped}); "
                         "use a longer --ctx or shorter examples")
    pad = tokenizer.eot_id
    train_ids, train_mask = _rows([e for _, e in train], ctx, packing, pad)
    val_ids, val_mask = _rows([e for _, e in val], ctx, packing, pad)
    prompts = [prompt_text(ex, template) for ex, _ in (val or train)[:2]]
    return SFTData(path=path, tokenizer=tokenizer, manifest={"tokenizer": tokenizer_record}, template=template,
                   packing=packing, ctx=ctx, train_ids=train_ids, train_mask=train_mask, val_ids=val_ids,
                   val_mask=val_mask, sha256=sha, prompts=prompts, base_checkpoint=Path(base_checkpoint),
                   base_run=Path(base_run), lora_alpha=lora_alpha, base_weights=base_weights, base_hf=base_hf,
                   stats={"examples": len(raw), "train_examples": len(train), "val_examples": len(val),
                          "truncated": truncated, "dropped": dropped, "train_rows": int(train_ids.shape[0]),
                          "response_tokens": int(train_mask[:, 1:].sum())})


class SFTStream:
    """Batches of training rows, shuffled per epoch with a seeded generator; resumable.

    Under torchrun each of ``world_size`` ranks reads ``batch`` rows of every global batch of
    ``batch * world_size`` consecutive rows of the shuffled order (rank ``rank`` the ``rank``-th share), so the
    ranks together read what one process with a micro-batch of ``batch * world_size`` rows would. The position
    (``index``, rows of the epoch's order consumed by all ranks) is the same in every rank, so a checkpoint
    resumes at any world size."""

    def __init__(self, data: SFTData, batch: int, seed: int, rank: int = 0, world_size: int = 1):
        self.data, self.batch, self.seed = data, batch, seed
        self.rank, self.world_size = rank, world_size
        self.global_batch = batch * world_size
        self.epoch, self.index = 0, 0

    def epoch_plan(self, epoch: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return epoch, torch.randperm(self.data.train_ids.shape[0], generator=g).tolist()

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        order = self.epoch_plan(self.epoch)[1]
        while len(rows) < self.global_batch:
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
                order = self.epoch_plan(self.epoch)[1]
            rows.append(order[self.index])
            self.index += 1
        mine = rows[self.rank * self.batch:(self.rank + 1) * self.batch]
        return batch_of(self.data.train_ids[mine], self.data.train_mask[mine])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


@torch.no_grad()
def evaluate_sft(model, data: SFTData, setup, device, max_batches: int) -> dict:
    """Mean loss over the held-out examples' response tokens, and its perplexity."""
    if data.val_ids.shape[0] == 0:
        return {}
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        B = setup.micro_batch
        for start in range(0, min(data.val_ids.shape[0], B * max_batches), B):
            x, y = batch_of(data.val_ids[start:start + B], data.val_mask[start:start + B])
            n = int((y != IGNORE).sum())
            if not n:
                continue
            with autocast(setup.precision, device.type):
                logits = model(x.to(device))
            total += float(lm_loss(logits, y.to(device))) * n
            count += n
    finally:
        model.train(was_training)
    if not count:
        return {}
    loss = total / count
    name = data.path.name
    return {"eval_loss": loss, "eval_ppl": _ppl(loss), "eval_tokens": count, "eval_loss_by_source": {name: loss},
            "eval_ppl_by_source": {name: _ppl(loss)}, "eval_tokens_by_source": {name: count}}


def finetune_task(data: SFTData) -> TrainingTask:
    """``memplan finetune``'s factories for ``trainer.loop.Trainer``: the plan's model with the base run's
    weights (its newest checkpoint, or an imported Hugging Face checkpoint's ``data.base_weights``), LoRA
    adapters on it when the plan has ``lora_rank`` > 0 (every other weight frozen), the rows of ``data``
    (``SFTStream``), the held-out examples' loss (``evaluate_sft``), prompts from the held-out examples, and
    the ``finetune`` record every checkpoint's meta.json carries.

    The trainer calls the model factory with ``with_weights`` False where the base weights are not to be read:
    a resume (its checkpoint holds every weight), the ranks that receive rank 0's, the meta device."""

    def model(spec, setup, device, with_weights: bool) -> torch.nn.Module:
        if stack_class(setup.stack).trains_hf_model:  # transformers' model class (trainer.hf_model), peft's adapters
            return _hf_model(spec, setup, device, with_weights)
        built = build_model(spec, setup.attention, "none", param_dtype(setup.precision), device=device)
        if with_weights and data.base_weights is not None:  # imported (``base_of_hf``)
            ckpt.load_weights(built, data.base_weights, f"--from {data.base_run}")
            data.base_weights = None  # in the model now: the copy is not kept
        elif with_weights:
            path = data.base_checkpoint / ckpt.MODEL_FILE
            ckpt.load_weights(built, ckpt.read_weights(path), str(path))
        if setup.lora_rank:
            apply_lora(built, setup.lora_rank, data.lora_alpha, lora_targets(setup))
        return apply_checkpointing(built, setup.checkpointing)

    def stream(*, micro_batch: int, ctx: int, seed: int, rank: int, world_size: int) -> SFTStream:
        return SFTStream(data, micro_batch, seed, rank=rank, world_size=world_size)

    def _hf_model(spec, setup, device, with_weights: bool) -> torch.nn.Module:
        from trainer import hf_model

        weights = None
        if with_weights and data.base_weights is not None:  # imported, under transformers' names
            weights, data.base_weights = data.base_weights, None
        elif with_weights:  # a memplan run of transformers' model class: its newest checkpoint's weights
            path = data.base_checkpoint / ckpt.MODEL_FILE
            weights = hf_model.plain_weights(ckpt.read_weights(path), str(path))
        return hf_model.build(spec, setup, device, data.hf_config, weights=weights, lora_alpha=data.lora_alpha)

    def meta(setup) -> dict:
        d = data
        return {"finetune": {"base_run": str(d.base_run.resolve()), "base_checkpoint": str(d.base_checkpoint.resolve()),
                             "base_hf": d.base_hf, "data_sha256": d.sha256, "template": d.template,
                             "packing": d.packing, "stats": d.stats,
                             "lora": ({"rank": setup.lora_rank, "alpha": d.lora_alpha,
                                       "targets": setup.lora_targets} if setup.lora_rank else None)},
                **({"hf_config": d.hf_config} if stack_class(setup.stack).trains_hf_model else {})}

    return TrainingTask(kind="finetune", build_model=model, make_stream=stream,
                        evaluate=lambda m, setup, device, n: evaluate_sft(m, data, setup, device, n),
                        prompts=lambda: data.prompts, meta=meta)


def base_of(run_dir: str | Path) -> tuple[Plan, object, dict, Path]:
    """A trained run's plan, tokenizer, tokenizer record and newest checkpoint (what finetuning starts from)."""
    from trainer import rundir

    trained = rundir.trained_checkpoint(run_dir)
    return trained.plan, trained.tokenizer(), trained.tokenizer_record, trained.path


def base_of_hf(path: str | Path, *, weights: bool = True, stack: str | None = None):
    """A Hugging Face checkpoint directory (or a Hub id's cached snapshot) as a finetune's base: the
    ``trainer.hf_import.ImportedModel`` (spec, canonical weights, its own tokenizer and record); with
    ``weights=False`` only the spec and tokenizer are read (a resume takes its weights from its checkpoint).
    ``stack`` (``--stack``; None: memplan's own model where it builds the family, else transformers'): for
    transformers' model class the tensors keep their names and ``hf_config`` is the config.json
    (``trainer.hf_model``)."""
    from trainer import hf_import, hf_model

    directory = hf_import.resolve_checkpoint(str(path))
    chosen, spec, cfg, note = hf_model.checkpoint_stack(directory, stack)
    if chosen == hf_model.STACK:
        return hf_model.import_checkpoint(directory, spec, cfg, weights, note)
    if weights:
        return hf_import.import_hf(path)
    model_type, spec, cfg, max_ctx, notes = hf_import.read_spec(directory)
    tokenizer, record = hf_import.read_tokenizer(directory, cfg, spec)
    return hf_import.ImportedModel(path=directory, model_type=model_type, spec=spec, tensors={}, tokenizer=tokenizer,
                                   tokenizer_record=record, dtype="", max_ctx=max_ctx, notes=tuple(notes))

"""Held-out evaluation during a run: the loss (``evaluate`` for a prepared corpus; a task may bring its own,
as finetuning does), samples from the model, and ``Evaluation``, which runs both when the loop asks,
times them, and turns an out-of-memory evaluation into an event instead of a failed run. (``memplan eval``'s
library is ``trainer/eval_command.py``, which scores a finished run with the same ``evaluate``.)
"""

from __future__ import annotations

import gc
import math
import time
from typing import Callable

import torch

from memplan.setup import TrainSetup
from trainer import records
from trainer.data import PreparedData
from trainer.model import lm_loss
from trainer.sample import sample_text
from trainer.step import autocast
from trainer.stopping import ETA_WINDOW, out_of_memory

PROMPT_TOKENS = 12  # default prompts: at most this many tokens of a held-out document, cut at a word


def ppl(loss: float) -> float | None:
    """exp(loss), None for a non-finite or overflowing loss (JSON has no inf)."""
    try:
        return math.exp(loss) if math.isfinite(loss) else None
    except OverflowError:
        return None


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def json_safe(v):
    if isinstance(v, float):
        return finite_or_none(v)
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    return v


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: PreparedData, setup: TrainSetup, device: torch.device,
             max_batches: int) -> dict:
    """Mean next-token loss on held-out windows: per source (``max_batches`` batches of ``setup.micro_batch``
    windows of ``setup.ctx`` tokens, evenly spaced over the source's val split) and overall (the mean over
    every evaluated token), with perplexities. Empty when no source holds a full window."""
    was_training = model.training
    model.eval()
    by_source, tokens_by_source = {}, {}
    total_loss, total_tokens = 0.0, 0
    try:
        for s in data.sources:
            loss_sum, n = 0.0, 0
            for x, y in data.val_batches(s.name, batch=setup.micro_batch, ctx=setup.ctx, max_batches=max_batches):
                x, y = x.to(device), y.to(device)
                with autocast(setup.precision, device.type):
                    logits = model(x)
                loss_sum += float(lm_loss(logits, y)) * y.numel()
                n += y.numel()
                del logits
            if n:
                by_source[s.name], tokens_by_source[s.name] = loss_sum / n, n
                total_loss += loss_sum
                total_tokens += n
    finally:
        model.train(was_training)
    if not total_tokens:
        return {}
    overall = total_loss / total_tokens
    return {"eval_loss": overall, "eval_ppl": ppl(overall), "eval_tokens": total_tokens,
            "eval_loss_by_source": by_source, "eval_ppl_by_source": {k: ppl(v) for k, v in by_source.items()},
            "eval_tokens_by_source": tokens_by_source}


def default_prompts(data: PreparedData, tokenizer) -> list[str]:
    """The first words (up to PROMPT_TOKENS tokens, cut after the last whole word) of each source's
    first held-out document: prompts in the corpus's own style, the same on every run."""
    prompts = []
    for s in data.sources:
        n = min(s.val_tokens, PROMPT_TOKENS + 1)
        ids = [i for i in data.val.read(s.val_offset, n).tolist() if i != data.eot_id][:PROMPT_TOKENS] if n else []
        text = tokenizer.decode(ids) if ids else ""
        cut = max(text.rfind(" "), text.rfind("\n"))
        if cut > 0:
            text = text[:cut]
        text = text.rstrip()
        if text and text not in prompts:
            prompts.append(text)
    return prompts or ["The"]


class Evaluation:
    """A run's evaluations: ``loss()`` (the task's held-out loss with the run's settings), ``samples(step)``
    (one per prompt, seeded by the run's seed, the step and the prompt's index), and ``run(step)``, both
    together, timed, as the metrics line the loop writes.

    ``model``, ``setup`` and ``device`` are read when an evaluation runs (the loop may halve the micro-batch
    after an out-of-memory step); ``config`` gives eval_batches, sample_tokens, prompts and seed."""

    def __init__(self, *, config, loss: Callable[[torch.nn.Module, TrainSetup, torch.device, int], dict],
                 prompts: Callable[[], list[str]], tokenizer, model: Callable[[], torch.nn.Module],
                 setup: Callable[[], TrainSetup], device: torch.device):
        self.config, self._loss, self._prompts, self.tokenizer = config, loss, prompts, tokenizer
        self._model, self._setup, self.device = model, setup, device
        self.seconds: list[float] = []  # the latest evaluations' times
        self.last: records.EvalLine | None = None  # the latest evaluation's line
        self.last_step = -1  # the step of the latest evaluation (or of one that ran out of memory)

    def prompts(self) -> list[str]:
        """The configured prompts, else the task's (for a corpus, the start of each source's first held-out
        document)."""
        return list(self.config.prompts) or self._prompts()

    def loss(self) -> dict:
        return self._loss(self._model(), self._setup(), self.device, self.config.eval_batches)

    def samples(self, step: int) -> list[dict]:
        if not self.config.sample_tokens:
            return []
        setup = self._setup()
        return [{"prompt": prompt,
                 "text": sample_text(self._model(), self.tokenizer, prompt, self.config.sample_tokens, ctx=setup.ctx,
                                     seed=self.config.seed * 1_000_003 + step * 101 + i,
                                     precision=setup.precision)}
                for i, prompt in enumerate(self.prompts())]

    def run(self, step: int, tokens: int, emit: bool = True) -> tuple[records.EvalLine | None,
                                                                      records.EvalOomEvent | None]:
        """(the eval line, None) or (None, an eval_oom event) or (None, None): evaluate and sample at ``step``
        (``tokens`` trained). Out of memory, the evaluation is skipped and the run goes on. With ``emit`` False
        (a probe timing it) nothing is recorded and no line returned."""
        t0 = time.perf_counter()
        oom = None
        try:
            result = self.loss()
            samples = self.samples(step)
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
            oom = out_of_memory(e)
            if oom is None:
                raise
        if oom is not None:  # outside the except block, so the traceback no longer pins tensors
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if emit:
                self.last_step = step
                return None, records.EvalOomEvent(step=step, message=oom)
            return None, None
        if not emit:
            return None, None
        self.last_step = step
        if not result:
            return None, None
        self.seconds = (self.seconds + [time.perf_counter() - t0])[-ETA_WINDOW:]
        line = records.EvalLine(step=step, **{k: json_safe(v) for k, v in result.items()},
                                samples=samples, eval_seconds=self.seconds[-1], tokens=tokens)
        self.last = line
        return line, None

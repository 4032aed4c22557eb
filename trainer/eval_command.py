"""Held-out loss and perplexity of a trained run: what ``memplan eval`` runs.

The loss is the trainer's own evaluation (``trainer.loop_eval.evaluate``): mean next-token cross-entropy
over non-overlapping windows of ``ctx`` tokens of each source's held-out (val) split, in the run's
precision. Overall is the mean over every evaluated token (sources weighted by their tokens), and
perplexity is exp(loss). With the run's ctx, micro-batch and ``max_batches = eval_batches`` it gives
exactly the ``eval_loss`` the trainer logged when it saved the same checkpoint; by default it reads
every window of the split instead.

The corpus is the run's own prepared data (its path is in the checkpoint's meta.json) or any other
prepared corpus with the same tokenizer (same sha256 of its tokenizer.json). A corpus made with
another tokenizer is refused: its token ids mean other strings, so a loss on it means nothing.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from memplan.errors import InputError
from trainer.data import PreparedData
from trainer import rundir
from trainer.loop import build_trained
from trainer.loop_eval import evaluate


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """What to evaluate on. None means: as the run trained (ctx, micro-batch) / every window."""

    ctx: int | None = None  # tokens per evaluation window; None: the run's --ctx
    batch: int | None = None  # windows per forward; None: the run's micro-batch
    max_batches: int | None = None  # batches per source, evenly spaced over its split; None: all windows

    def __post_init__(self):
        for name in ("ctx", "batch", "max_batches"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InputError(f"--{name.replace('_', '-')}: {v!r} must be a positive whole number")


@dataclass(frozen=True, kw_only=True)
class SourceLoss:
    """Loss on one source's held-out split."""

    name: str
    loss: float | None  # mean next-token cross-entropy in nats; None when the split holds no full window
    tokens: int  # predicted tokens evaluated
    val_tokens: int  # tokens in the source's held-out split

    @property
    def ppl(self) -> float | None:
        return _ppl(self.loss)


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """Per-source and overall held-out loss of one checkpoint on one prepared corpus."""

    run: str
    checkpoint: str
    step: int
    data: str  # the prepared corpus evaluated on
    own_data: bool  # whether it is the corpus the run trained on
    ctx: int
    batch: int
    max_batches: int | None
    precision: str
    device: str
    sources: tuple[SourceLoss, ...]
    loss: float  # over every evaluated token
    tokens: int
    seconds: float

    @property
    def ppl(self) -> float:
        return _ppl(self.loss)

    def to_json(self) -> dict:
        return {"run": self.run, "checkpoint": self.checkpoint, "step": self.step, "data": self.data,
                "own_data": self.own_data, "ctx": self.ctx, "batch": self.batch, "max_batches": self.max_batches,
                "precision": self.precision, "device": self.device,
                "eval_loss": self.loss, "eval_ppl": self.ppl, "eval_tokens": self.tokens,
                "sources": [{"name": s.name, "eval_loss": s.loss, "eval_ppl": s.ppl, "eval_tokens": s.tokens,
                             "val_tokens": s.val_tokens} for s in self.sources],
                "seconds": self.seconds}


def _ppl(loss: float | None) -> float | None:
    if loss is None:
        return None
    return math.exp(loss) if loss < 700 else float("inf")


EMBEDDED_ORIGINS = ("pydoc_data.topics", "docstrings of ")  # trainer.data.embedded_sources' origins


def prepare_command(run_dir: Path, meta: dict, data: PreparedData, checkpoint: Path | None) -> str:
    """The whole `memplan prepare` command that remakes ``data``'s corpus with the run's tokenizer: the
    same inputs (the manifest's source origins; none for the embedded corpus), a new --out beside it
    (``DIR-RUN``, never the corpus itself), and the checkpoint's tokenizer.json (or the tiktoken
    encoding's name)."""
    origins = [str(s.get("origin", "")) for s in data.manifest.get("sources", [])]
    files = [o for o in origins if o and not o.startswith(EMBEDDED_ORIGINS)]
    if len(files) == len(origins):
        inputs = "".join(f" --input {shlex.quote(o)}" for o in files)
    elif files:
        inputs = " --input TEXT"  # the embedded corpus and files together: no command remakes both
    else:
        inputs = ""  # the embedded corpus: prepare's default
    tok = meta.get("tokenizer") or {}
    if tok.get("kind") == "tiktoken":
        tokenizer = str(tok.get("spec") or tok.get("encoding") or "gpt2")
    else:
        tokenizer = shlex.quote(str((checkpoint or Path(run_dir) / rundir.CHECKPOINT_DIR / "step-N")
                                    / rundir.TOKENIZER_FILE))
    out = shlex.quote(str(data.path.parent / f"{data.path.name}-{Path(run_dir).resolve().name}"))
    return f"memplan prepare{inputs} --out {out} --tokenizer {tokenizer}"


def resolve_data(run_dir: Path, meta: dict, data_dir: str | Path | None,
                 checkpoint: Path | None = None) -> tuple[PreparedData, bool]:
    """The corpus to evaluate on and whether it is the run's own; a different tokenizer is an InputError
    (naming the checkpoint's tokenizer.json to prepare with)."""
    own_path = (meta.get("data") or {}).get("path")
    if data_dir is None:
        if not own_path:
            raise InputError(f"--run {run_dir}: its checkpoint does not name the data it trained on; pass --data DIR")
        if not Path(own_path).is_dir():
            raise InputError(f"--run {run_dir}: the data it trained on ({own_path}) is gone; pass --data DIR, "
                             "a corpus prepared with the run's tokenizer")
        data_dir = own_path
    data = PreparedData(data_dir)
    data.verify(splits=("val",))  # the held-out shards eval reads, and the tokenizer, against their sha256
    run_sha = meta.get("tokenizer_sha256") or (meta.get("tokenizer") or {}).get("sha256")
    data_sha = data.manifest["tokenizer"]["sha256"]
    if run_sha != data_sha:
        raise InputError(f"--data {data_dir}: prepared with another tokenizer (sha256 {data_sha[:12]}) than the "
                         f"run's ({str(run_sha)[:12]}); prepare its text again with the run's: "
                         f"`{prepare_command(run_dir, meta, data, checkpoint)}`, then pass that --data")
    own = bool(own_path) and Path(own_path).resolve() == Path(data_dir).resolve()
    return data, own


def evaluate_run(run_dir: str | Path, data_dir: str | Path | None = None, config: EvalConfig = EvalConfig(), *,
                 checkpoint: str | Path | None = None, device: torch.device | None = None) -> EvalResult:
    """Held-out loss per source and overall of the run's newest (or the given) checkpoint.

    ``data_dir`` defaults to the run's own prepared corpus. Raises ``InputError`` for a missing or
    incomplete run, a corpus with another tokenizer, a --ctx beyond a learned position table, or a
    split without one full window.
    """
    run_dir = Path(run_dir)
    trained = rundir.trained_checkpoint(run_dir, checkpoint)
    ref = trained.path
    device = device or torch.device("cpu")
    model, _, meta = build_trained(trained, device=device)
    data, own = resolve_data(run_dir, meta, data_dir, ref)
    spec = model.spec
    setup = dataclasses.replace(_plan_setup(meta), checkpointing="none", compile=False)
    ctx = config.ctx or setup.ctx
    spec.check_context(ctx)
    batch = config.batch or setup.micro_batch
    setup = dataclasses.replace(setup, ctx=ctx, micro_batch=batch)
    if data.vocab_size > spec.vocab:
        raise InputError(f"--data {data.path}: token ids up to {data.vocab_size - 1}, the model's vocabulary is "
                         f"{spec.vocab}")
    t0 = time.perf_counter()
    found = evaluate(model, data, setup, device, config.max_batches)
    seconds = time.perf_counter() - t0
    if not found:
        longest = max((s.val_tokens for s in data.sources), default=0)
        fits = f"--ctx {longest - 1} or less" if longest > 1 else "a corpus with a held-out split"
        raise InputError(f"--data {data.path}: no source holds a full window of --ctx {ctx} + 1 held-out tokens "
                         f"(the longest split has {longest}); use {fits}")
    sources = tuple(SourceLoss(name=s.name, loss=found["eval_loss_by_source"].get(s.name),
                               tokens=found["eval_tokens_by_source"].get(s.name, 0), val_tokens=s.val_tokens)
                    for s in data.sources)
    return EvalResult(run=str(run_dir), checkpoint=str(ref), step=int(meta["step"]), data=str(data.path),
                      own_data=own, ctx=ctx, batch=batch, max_batches=config.max_batches,
                      precision=setup.precision, device=str(device), sources=sources, loss=found["eval_loss"],
                      tokens=found["eval_tokens"], seconds=seconds)


def _plan_setup(meta: dict):
    from memplan.plan import Plan

    return Plan.from_dict(meta["plan"], "meta.json").setup

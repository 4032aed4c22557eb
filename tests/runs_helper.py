"""Tiny trained runs for the tests of what comes after training (generate, eval, export, finetune).

``tiny_corpus`` prepares 300 generated stories with a 320-token byte-level BPE (a fraction of a
second); ``tiny_run`` trains a 2-layer model on it for a few dozen steps with the real trainer, so
the run directory is exactly what ``memplan train`` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

from memplan.hardware import load_profile
from memplan.model import ModelSpec
from memplan.plan import Plan
from memplan.setup import TrainSetup
from trainer import data
from trainer.data import PreparedData
from trainer.loop import TrainConfig, Trainer

ANIMALS = ["cat", "dog", "owl", "fox", "bee", "elk", "yak", "ant"]
PLACES = ["garden", "river", "forest", "city", "meadow", "harbour"]


def story(i: int) -> str:
    return (f"Story {i}. Once upon a time a {ANIMALS[i % 8]} walked to the {PLACES[i % 6]}. "
            f"It met a {ANIMALS[(i * 3 + 1) % 8]} and they talked about the number {i * 37 % 101}. ")


def tiny_corpus(root: Path, tokenizer: str = "bpe:320", n: int = 300, name: str = "prepared") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    src = root / f"{name}-stories.jsonl"
    src.write_text("".join(json.dumps({"text": story(i)}) + "\n" for i in range(n)))
    out = root / name
    data.prepare(data.resolve_inputs([str(src)]), out,
                 data.PrepareConfig(tokenizer=tokenizer, workers=1, val_fraction=0.1))
    return out


def pydoc_corpus(root: Path) -> Path:
    """A small corpus prepared from the embedded pydoc source: 40 documents, a 300-token BPE."""
    sources = [s for s in data.embedded_sources() if s.name == "pydoc"]
    out = root / "prepared"
    data.prepare(sources, out, data.PrepareConfig(tokenizer="bpe:300", workers=1, max_docs=40, val_fraction=0.1))
    return out


def tiny_spec(arch: str, vocab: int, **overrides) -> ModelSpec:
    shape = dict(arch=arch, layers=2, hidden=64, heads=4, kv_heads=2 if arch == "llama" else 4, ffn=128,
                 vocab=vocab, tied=True, max_positions=256)
    shape.update(overrides)
    return ModelSpec(**shape)


def tiny_run(run_dir: Path, corpus: Path, arch: str = "llama", steps: int = 40, ctx: int = 64,
             precision: str = "fp32", **overrides) -> Path:
    """Train a tiny model of ``arch`` on ``corpus`` for ``steps`` steps into ``run_dir``."""
    prepared = PreparedData(corpus)
    spec = tiny_spec(arch, prepared.vocab_size, **overrides)
    plan = Plan(model=spec, setup=TrainSetup(ctx=ctx, micro_batch=8, precision=precision), device="cpu")
    trainer = Trainer.start(run_dir, plan, prepared, TrainConfig(max_steps=steps, lr=3e-3, sample_tokens=0),
                            load_profile("cpu"))
    trainer.run()
    return run_dir


_TRACED: dict[tuple, int] = {}


def traced_peak(stack: str, spec: ModelSpec, setup: TrainSetup, lora_dropout: float | None = None) -> int:
    """``trainer.stacks.trace_stack``'s peak for ``stack``'s step of ``spec`` under ``setup``, traced once per
    test session: a trace runs on fake tensors, a function of these arguments alone, and the walk's tests hold
    the same steps to it from several tests (each fast subset in tests/walk is part of its slow matrix in
    tests/runs/test_walk_matrices.py, the hooks' cases are cells of the matrices)."""
    key = (stack, repr(spec), repr(setup), lora_dropout)
    if key not in _TRACED:
        from trainer.stacks import StackModel, trace_stack

        _TRACED[key] = trace_stack(stack, StackModel(spec=spec), setup, lora_dropout=lora_dropout).peak_allocated
    return _TRACED[key]


def one_line_error(result, *needles):
    """A CLI result that failed as bad input must: exit 2, one line on stderr, holding every needle."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def whole_line(line: dict) -> dict:
    """``line`` (a metrics.jsonl line a test writes by hand) with every key its record requires that it lacks
    filled with a zero of the key's type (``trainer.records``: a reader refuses a line missing one)."""
    import dataclasses
    import typing

    from trainer import records

    cls = (records.EVENTS.get(line.get("event"), records.OtherEvent) if line.get("kind") == "event"
           else records.KINDS[line["kind"]])
    hints = typing.get_type_hints(cls)
    zero = {int: 0, float: 0.0, bool: False, str: "", dict: {}, list: []}
    out = dict(line)
    for f in dataclasses.fields(cls):
        if f.name not in out and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
            out[f.name] = zero[next(k for k in kinds if k in zero)]
    return out

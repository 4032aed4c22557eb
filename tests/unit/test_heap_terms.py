"""On a CPU, the resident peak holds the heap's high-water and the mmapped loss tensors' high-water at once
(memplan.memory.terms.mapped_logits_high_water_bytes): each is taken at its own moment of the walk."""

from __future__ import annotations

import pytest

from memplan.memory import (GLIBC_MMAP_THRESHOLD_MAX, glibc_heap_retention_bytes, ledger, logits_bytes,
                            peak_memory)
from memplan.model import ModelSpec
from memplan.setup import TrainSetup


def shape(layers: int, hidden: int, ffn: int) -> ModelSpec:
    return ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=4, kv_heads=4, ffn=ffn, vocab=4096, tied=True)


def every_moment(monkeypatch, spec: ModelSpec, setup: TrainSetup) -> list[dict[str, int]]:
    """The live bytes by category after every allocation of the walk, recorded beside it."""
    seen = []
    alloc = ledger._StepWalk.alloc

    def recording(self, category, nbytes, where=None):
        alloc(self, category, nbytes, where)
        seen.append(dict(self.live))

    monkeypatch.setattr(ledger._StepWalk, "alloc", recording)
    peak_memory(spec, setup)
    monkeypatch.undo()
    return seen


def cpu_extra(spec: ModelSpec, setup: TrainSetup) -> int:
    """What a CPU estimate adds to the runtime beyond glibc's retention allowance."""
    on, off = peak_memory(spec, setup, heap_retention=True), peak_memory(spec, setup)
    return on.runtime - off.runtime - glibc_heap_retention_bytes(spec, setup)


def test_mmapped_logits_and_the_heap_are_resident_at_their_own_high_waters(monkeypatch):
    """Full checkpointing, fp32 logits of 32 MiB: the loss's tensors are mmapped and gone before the
    backward recomputes a block, whose live total besides the logits is the step's highest. The process
    holds both high-waters: the highest total besides the logits plus the highest logits, 60.5 MiB over
    the live peak here (benchmarks/heap_fragmentation.py's full-ckpt shape)."""
    spec, setup = shape(4, 256, 768), TrainSetup(ctx=512, micro_batch=4, precision="fp32", checkpointing="full")
    assert logits_bytes(spec, setup) == GLIBC_MMAP_THRESHOLD_MAX
    moments = every_moment(monkeypatch, spec, setup)
    rest = max(sum(m.values()) - m["logits"] for m in moments)
    logits = max(m["logits"] for m in moments)
    peak = peak_memory(spec, setup).peak_allocated
    assert rest + logits > peak
    assert cpu_extra(spec, setup) == rest + logits - peak
    assert cpu_extra(spec, setup) == pytest.approx(60.5 * 2**20, abs=0.05 * 2**20)


def test_logits_from_the_heap_add_nothing():
    """Logits under the threshold come from the heap, whose high-water is the walk's peak itself."""
    spec, setup = shape(4, 256, 768), TrainSetup(ctx=512, micro_batch=2, precision="fp32", checkpointing="full")
    assert logits_bytes(spec, setup) < GLIBC_MMAP_THRESHOLD_MAX
    assert cpu_extra(spec, setup) == 0


def test_the_term_is_for_a_cpu_only():
    """A GPU's caching allocator reuses its blocks: no heap term in the runtime there."""
    spec, setup = shape(4, 256, 768), TrainSetup(ctx=512, micro_batch=4, precision="fp32", checkpointing="full")
    assert peak_memory(spec, setup).runtime == 0

"""FSDP2 + LoRA: the walk of one rank (``FullyShard``'s LoRA hooks) held to the exact trace of that rank
(``trace_rank_step``, which builds the model as a finetune does: base model, ``lora_for``, checkpointing
wrappers, then ``fully_shard`` on each block and the root; the other ranks a fake process group).

Each hook's test takes one traced config and takes the hook out (its function put back to what it computes
without LoRA): with it the walk is the trace's peak within ``EXACT`` bytes (the FSDP walk of a step without
checkpointing is exact but for the 12 bytes every trace of memplan's step holds beyond the walk), without it
the walk misses. The matrix (slow) holds per-rank walks at 2, 3 and 4 ranks to the project's bars (median ≤ 3%,
worst ≤ 10%) and to 0.1% wherever some block trains; the head alone (``--lora-targets head``) is within 2.1%.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import memplan.memory.sharding as sharding
import memplan.memory.terms as terms
from memplan import memory as m
from memplan.cli import app
from memplan.errors import InputError
from memplan.model import ModelSpec
from memplan.setup import TrainSetup

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runs_helper import one_line_error  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

MEDIAN_BAR, WORST_BAR = 0.03, 0.10
EXACT = 32  # bytes
LLAMA = ModelSpec(arch="llama", layers=4, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=512, tied=False)
LLAMA_TIED = ModelSpec(arch="llama", layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=512, tied=True)
SMALL_VOCAB = ModelSpec(arch="llama", layers=4, hidden=128, heads=4, kv_heads=2, ffn=512, vocab=64, tied=False)
GPT2 = ModelSpec(arch="gpt2", layers=3, hidden=96, heads=3, kv_heads=3, ffn=200, vocab=1001, tied=False,
                 max_positions=64)
ALL = "qkv,proj,up,down"


def _setup(precision: str, checkpointing: str, targets: str, world_size: int = 2, rank: int = 4) -> TrainSetup:
    return TrainSetup(ctx=64, micro_batch=2, precision=precision, checkpointing=checkpointing, world_size=world_size,
                      sharding="fsdp", lora_rank=rank, lora_targets=targets)


_TRACES: dict = {}


def _trace(spec: ModelSpec, setup: TrainSetup, rank: int):
    from trainer.distributed import trace_rank_step

    key = (spec, setup, rank)
    if key not in _TRACES:
        _TRACES[key] = trace_rank_step(spec, setup, rank=rank)
    return _TRACES[key]


def _walk(spec: ModelSpec, setup: TrainSetup, rank: int) -> int:
    return m.peak_memory_of_rank(spec, setup, rank, collectives="nccl").peak_allocated


def _without_lora(spec, setup, group):
    return sharding.param_shapes(spec)[group]


DOWN = (LLAMA, _setup("fp32", "none", "down"), 0)  # only down adapted: the MLP's backward is the peak
# full checkpointing, a small vocabulary: the peak is at the first block's backward, after the others' reduce-scatters
LATE = (SMALL_VOCAB, _setup("bf16-mixed", "full", "up,down,head"), 1)

HOOKS = [
    # the adapters are sharded with the frozen base and all-gathered with it (lora_adapter_param_shapes)
    (sharding, "fsdp_held_shapes", _without_lora, DOWN, 0),
    # only the adapters are reduce-scattered and have optimizer state
    (sharding, "fsdp_trained_shapes", _without_lora, DOWN, 0),
    # the frozen norms make no unsharded gradients
    (sharding, "frozen_vector_grad_bytes", lambda setup, nbytes: nbytes, DOWN, 0),
    # the unsharded gradients a block's post-backward packs are the adapters'
    (sharding, "unsharded_grad_numel",
     lambda spec, setup, group: spec.layer_params if group == "block" else spec.params - spec.layers * spec.layer_params,
     LATE, 0.001),
    # a root without adapters is resharded, not reduce-scattered
    (sharding, "lora_reduces", lambda spec, setup, group: True, DOWN, 0),
    # AdamW's step: one per adapter tensor
    (sharding, "lora_tensors", lambda spec, setup: spec.n_tensors, DOWN, 0),
    # the embedding, final norm and head are frozen (and the first block saves less), as in one process
    (sharding, "lora_freezes_root", lambda setup: False, DOWN, 0),
    # the adapter's input gradient and the base's summed in place
    (terms, "input_gradient_sum_bytes", lambda stack_name, nbytes: nbytes, DOWN, 0),
]


@pytest.mark.parametrize("module,name,replacement,config,relative", HOOKS,
                         ids=[h[1] for h in HOOKS])
def test_each_fsdp_lora_hook_brings_the_walk_to_the_trace_and_its_absence_misses_it(monkeypatch, module, name,
                                                                                    replacement, config, relative):
    spec, setup, rank = config
    traced = _trace(spec, setup, rank).peak_allocated
    bar = max(EXACT, relative * traced)
    assert abs(_walk(spec, setup, rank) - traced) <= bar
    monkeypatch.setattr(module, name, replacement)
    try:
        without = _walk(spec, setup, rank)
    except IndexError:  # (lora_reduces: the frozen root has no tensor to reduce-scatter)
        return
    assert abs(without - traced) > bar, (without, traced)


def test_the_trace_builds_the_finetunes_lora_model():
    """The traced rank holds the frozen base's and the adapters' shards and optimizer state for its adapter shards
    only, as the walk says: AdamW's two fp32 states of each local adapter element and one step per adapter tensor."""
    spec, setup, rank = DOWN
    traced = _trace(spec, setup, rank)
    assert traced.breakdown["optimizer"] == sharding.fsdp_optimizer_state_bytes(spec, setup, rank)
    adapters = spec.layers * (setup.lora_rank * (spec.ffn + spec.hidden))  # down: A (r × F), B (H × r)
    assert traced.breakdown["optimizer"] == 2 * (adapters // 2) * 4 + 2 * spec.layers * terms.ADAM_STEP_BYTES


MATRIX = [
    (LLAMA, _setup("fp32", "none", ALL)),
    (LLAMA, _setup("bf16-mixed", "none", ALL)),
    (LLAMA, _setup("fp32", "full", ALL)),
    (LLAMA, _setup("bf16-mixed", "full", ALL)),
    (LLAMA, _setup("fp32", "none", "q,v")),
    (LLAMA, _setup("fp32", "none", ALL + ",head")),
    (LLAMA, _setup("bf16-mixed", "full", "q,v,head")),
    (LLAMA, _setup("fp32", "none", "head")),
    (GPT2, _setup("fp32", "none", ALL)),
    (GPT2, _setup("bf16-mixed", "full", "q,v")),
    (GPT2, _setup("bf16-mixed", "none", "up,down,head", world_size=3)),
    (GPT2, _setup("bf16-mixed", "full", "q,v,head", world_size=4)),
    (LLAMA_TIED, _setup("fp32", "full", ALL, world_size=4)),
    (LLAMA_TIED, _setup("bf16-mixed", "none", "q,k", world_size=3)),
]


@pytest.mark.slow
def test_the_fsdp_lora_walk_matches_every_ranks_trace():
    errors = []
    for spec, setup in MATRIX:
        for rank in range(setup.world_size):
            traced = _trace(spec, setup, rank).peak_allocated
            error = (_walk(spec, setup, rank) - traced) / traced
            errors.append(abs(error))
            bar = 0.021 if setup.lora_targets == "head" else 0.001
            assert abs(error) <= bar, (spec.arch, setup.precision, setup.checkpointing, setup.lora_targets, rank, error)
    assert statistics.median(errors) <= MEDIAN_BAR and max(errors) <= WORST_BAR


def test_selective_checkpointing_with_lora_is_refused(tmp_path):
    """Not walked (under fsdp the walk missed by up to 6%, in one process llama's by 16.5%, and gpt2's and
    gpt_neox's recomputation fails): estimate, trace and finetune's check refuse it in one line, under fsdp or
    in one process."""
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, '
                      '"num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 512, '
                      '"tie_word_embeddings": false, "max_position_embeddings": 256}')
    args = ["estimate", "--model", str(config), "--ctx", "64", "--batch", "2", "--device", "cpu", "--sharding", "fsdp",
            "--world-size", "2", "--lora-rank", "4"]
    done = CliRunner().invoke(app, [*args, "--checkpointing", "selective"])
    one_line_error(done, "--checkpointing selective", "--lora-rank", "accepted", "none, full")
    assert CliRunner().invoke(app, [*args, "--checkpointing", "full"]).exit_code == 0
    single = ["--arch", "gpt2", "--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128", "--vocab", "64",
              "--ctx", "32", "--batch", "2", "--device", "cpu", "--lora-rank", "4", "--checkpointing", "selective"]
    for command in ("estimate", "trace"):  # the trace had failed with a traceback inside the recomputation
        one_line_error(CliRunner().invoke(app, [command, *single]), "--checkpointing selective", "none, full")
    from memplan.memory.stacks import check_lora_targets

    with pytest.raises(InputError, match="none, full"):  # what memplan finetune checks its plan with
        check_lora_targets("memplan", LLAMA, _setup("fp32", "selective", ALL))


def test_autotune_never_plans_selective_checkpointing_with_lora():
    """A finetune (``memplan finetune`` plans through autotune) searches checkpointing none and full only, under
    fsdp, ddp or one process."""
    from memplan.autotune import autotune
    from memplan.hardware import load_profile

    result = autotune(LLAMA, load_profile("rtx-4090"), ctx=256, global_batch=8, world_size=2, lora_rank=4)
    searched = {(c.setup.sharding, c.setup.checkpointing) for c in result.configs}
    assert ("fsdp", "full") in searched and ("ddp", "full") in searched
    assert not {c for _, c in searched} & {"selective"}
    alone = autotune(LLAMA, load_profile("rtx-4090"), ctx=256, global_batch=8, lora_rank=4)
    assert {c.setup.checkpointing for c in alone.configs} == {"none", "full"}

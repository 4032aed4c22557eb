"""The slow half of tests/walk: the walk held to the trace over whole matrices (every family, precision,
attention, checkpointing and LoRA), the published models at their own widths, and the compiled step.

Each test is the slow test of the tests/walk module named in its section, moved here so that the fast tier
(``python -m pytest tests/unit tests/walk``) holds no slow test; each uses that module's shapes, matrices and
bars (imported by module name: tests/conftest.py puts tests/walk on sys.path), and each fast subset stays
beside its matrix in tests/walk.
"""

from __future__ import annotations

import dataclasses

import itertools
import json
import statistics

import pytest
import test_compiled as compiled
import test_families as families
import test_lora_targets as lora_targets
import test_walk_families as walk_families
import test_walk_libs as walk_libs
import test_walk_libs_sharding as walk_libs_sharding
import test_walk_lora as walk_lora
import test_walk_stacks as walk_stacks
from typer.testing import CliRunner

from memplan.cli import app
from memplan.memory import peak_memory
from memplan.memory.peak import peak_memory_of_rank
from memplan.model import ModelSpec, from_hf_config
from memplan.setup import TrainSetup
from memplan.memory.stacks import stack_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


# ---- tests/walk/test_compiled.py ----------------------------------------------------------------

def test_the_compiled_trace_is_the_compiled_walk():
    """``memplan trace --compile``'s figure (inductor's partitioner on fake tensors) and the walk's compile hook
    agree within 3%; the eager walk does not (the partitioner's saved tensors are what the hook models)."""
    result = CliRunner().invoke(app, ["trace", "--arch", "llama", "--layers", "2", "--hidden", "128", "--heads", "4",
                                      "--kv-heads", "2", "--ffn", "512", "--vocab", "512", "--untied", "--ctx", "128",
                                      "--batch", "4", "--precision", "bf16-mixed", "--compile", "--device", "cpu",
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    traced, traced_compiled = data["memory"]["peak_allocated"], data["trace"]["compiled"]
    assert abs(data["trace"]["analytic_error"]) < 0.03, data["trace"]
    assert data["trace"]["analytic_peak_allocated"] == peak_memory(compiled.LLAMA, TrainSetup(
        ctx=128, micro_batch=4, precision="bf16-mixed", compile=True)).peak_allocated  # the compiled walk's
    eager = peak_memory(compiled.LLAMA, TrainSetup(ctx=128, micro_batch=4, precision="bf16-mixed")).peak_allocated
    assert abs(eager - traced) / traced > 0.03, (eager, traced)
    assert (0 < traced_compiled["forward_saved"] < traced
            and traced_compiled["backward_nodes"] > traced_compiled["forward_nodes"] > 0)


@pytest.mark.parametrize("change", [{"checkpointing": "full"},
                                    {"lora_rank": 8, "lora_targets": "down"}])
def test_the_compiled_walk_is_the_compiled_trace_under_checkpointing_and_lora_on_down(change):
    """Full checkpointing (silu's fp32 chain in the recomputation) and LoRA on down alone, bf16-mixed: the walk's
    compile hook within 3% of the compiled trace, where the eager walk is not (it missed it by −9.9% and +5.6%)."""
    from trainer.compiled_trace import trace_compiled_step

    setup = TrainSetup(ctx=128, micro_batch=4, precision="bf16-mixed", compile=True, **change)
    traced = trace_compiled_step(compiled.LLAMA, setup).peak_allocated
    walked = peak_memory(compiled.LLAMA, setup).peak_allocated
    eager = peak_memory(compiled.LLAMA, setup.replace(compile=False)).peak_allocated
    assert abs(walked - traced) / traced < 0.03, (walked, traced)
    assert abs(eager - traced) / traced > 0.03, (eager, traced)


# ---- tests/walk/test_families.py ----------------------------------------------------------------

def test_the_walk_meets_the_bars_over_every_family_precision_attention_and_checkpointing():
    errors = families._errors(families._matrix())
    assert statistics.median(abs(e) for e in errors.values()) <= families.MEDIAN_BAR, errors
    assert max(abs(e) for e in errors.values()) <= families.WORST_BAR, errors


def test_the_walk_meets_the_bars_for_every_family_under_peft_lora():
    """peft LoRA rank 4 on every matrix, dropout 0 and 0.05, each precision, SDPA, no checkpointing."""
    from trainer.stacks import StackModel, trace_stack

    cases = []
    for (name, spec, setup), dropout in itertools.product(
            families._matrix(attentions=("sdpa",), checkpointings=("none",)), (0.0, 0.05)):
        cases.append((f"{name}-r4-{dropout}", spec, setup.replace(lora_rank=4), dropout))
    errors = {}
    for name, spec, setup, dropout in cases:
        traced = trace_stack("transformers", StackModel(spec=spec), setup, lora_dropout=dropout).peak_allocated
        walked = peak_memory(spec, setup, stack=stack_for("transformers", lora_dropout=dropout, cpu=True)).peak_allocated
        errors[name] = (walked - traced) / traced
    assert statistics.median(abs(e) for e in errors.values()) <= families.MEDIAN_BAR, errors
    assert max(abs(e) for e in errors.values()) <= families.WORST_BAR, errors


@pytest.mark.parametrize("name", list(families.PUBLISHED))
def test_the_walk_of_each_published_model_at_four_layers_is_its_trace_to_a_percent(tmp_path, name):
    """Each published config at its own width and vocabulary, cut to 4 layers, ctx 2048, micro-batch 4,
    bf16-mixed with SDPA and pure bf16 with eager attention: activations are most of the peak."""
    cfg = {**families.PUBLISHED[name][0], "num_hidden_layers": 4, "resid_pdrop": 0.0}
    spec = from_hf_config(families._write(tmp_path, cfg), stack_families=True)
    for precision, attention in (("bf16-mixed", "sdpa"), ("bf16", "eager")):
        setup = TrainSetup(ctx=2048, micro_batch=4, precision=precision, attention=attention)
        error = families._error(spec, setup)
        assert abs(error) <= 0.01, (precision, attention, error)


def test_the_allocator_peak_of_an_eager_step_is_memtrackers():
    """benchmarks/compile_memory.py reads the peak from the profiler's allocator events (which see
    inductor's buffers); on an eager step it is MemTracker's live-tensor peak, to 0.1%."""
    from trainer.measure import measure_step_cpu

    spec = ModelSpec(arch="llama", layers=2, hidden=128, heads=4, kv_heads=4, ffn=344, vocab=1024, tied=False)
    setup = TrainSetup(ctx=128, micro_batch=2, precision="fp32")
    profiled = families._compile_memory().step_peak("memplan", spec, setup, compiled=False)
    tracked = measure_step_cpu(spec, setup).peak_allocated
    assert abs(profiled - tracked) / tracked < 0.001, (profiled, tracked)


def test_compile_moves_the_peak_both_ways_so_it_is_not_modelled():
    """transformers' llama step on this CPU: compiled, bf16-mixed without checkpointing needs less than
    eager (inductor recomputes what eager saves); fp32 with full checkpointing needs more. No one
    factor models both: estimate --compile says the number is the eager step's. The eager peaks are the
    same bytes under transformers 5.24 and 5.25; the compiled fp32 one moved with 5.25's rotary (a
    ``kernels`` function module), +5.75% of eager under 5.24 and +1.98% under 5.25 (bf16-mixed: -25.7%).
    The sign is what is claimed, so "more" is more than 1%."""
    bench = families._compile_memory()
    spec = ModelSpec(arch="llama", layers=2, hidden=256, heads=4, kv_heads=4, ffn=688, vocab=2048, tied=False)
    changes = {}
    for precision, checkpointing in (("bf16-mixed", "none"), ("fp32", "full")):
        setup = TrainSetup(ctx=256, micro_batch=4, precision=precision, checkpointing=checkpointing)
        eager = bench.step_peak("transformers", spec, setup, compiled=False)
        changes[precision, checkpointing] = (bench.step_peak("transformers", spec, setup, compiled=True) - eager) / eager
    assert changes["bf16-mixed", "none"] < -0.05 and changes["fp32", "full"] > 0.01, changes


# ---- tests/walk/test_lora_targets.py ------------------------------------------------------------

def test_memplan_q_k_v_alone_and_head_meet_the_bars_over_families_and_checkpointing():
    grid, llama, gpt2 = lora_targets._grid, lora_targets.LLAMA, lora_targets.GPT2
    attention_and_head = ("q,v", "q", "v", "q,k", "q,v,head", "head", "qkv,head")
    errors = grid("memplan", (*attention_and_head, "q,v,proj,up,down"), ("fp32", "bf16-mixed", "bf16"), ("none",),
                  (llama, gpt2))
    # (under full checkpointing the walk misses gpt2's fp32 step with proj, up and down adapted by 11%, with qkv
    # as with q,v: LoRA under checkpointing is another issue's)
    errors |= grid("memplan", attention_and_head, ("fp32", "bf16-mixed", "bf16"), ("full",), (llama, gpt2))
    lora_targets._assert_bars(errors)


def test_transformers_q_k_v_alone_and_head_meet_the_bars_with_dropout_and_checkpointing():
    grid = lora_targets._grid
    attention_and_head = ("q,v", "q", "k,v", "q,v,head", "head")
    errors = grid("transformers", (*attention_and_head, "q,v,proj,up,down", "down,head"), ("fp32", "bf16-mixed", "bf16"),
                  ("none",), dropouts=(0.0, 0.05))
    # (under full checkpointing the walk misses peft's MLP adapters, with qkv as with q,v, by up to 18%:
    # LoRA under checkpointing is another issue's)
    errors |= grid("transformers", attention_and_head, ("fp32", "bf16-mixed", "bf16"), ("full",), dropouts=(0.0, 0.05))
    lora_targets._assert_bars(errors)
    assert max(abs(e) for e in errors.values()) < 0.01, errors


@pytest.mark.libs
def test_litgpt_q_k_v_alone_and_head_meet_the_bars_over_grouped_and_full_heads():
    llama = lora_targets.LLAMA
    errors = lora_targets._grid("litgpt", ("q,v", "q", "k", "head", "q,v,head", "v,proj,up,down,head"),
                                ("fp32", "bf16-mixed", "bf16"), shapes=(llama, {**llama, "kv_heads": 4}))
    lora_targets._assert_bars(errors)
    assert max(abs(e) for e in errors.values()) < 0.01, errors


@pytest.mark.libs
def test_torchtune_q_k_v_alone_and_head_meet_the_bars_with_checkpointing():
    llama = lora_targets.LLAMA
    errors = lora_targets._grid("torchtune", ("q,v", "q", "q,v,head", "k,proj,up,down,head"), ("fp32", "bf16"),
                                ("none", "full"), shapes=(llama, {**llama, "kv_heads": 4}))
    lora_targets._assert_bars(errors)
    # without checkpointing exact but for the walk's usual bytes; under full checkpointing the walk misses
    # torchtune's LoRA step as it does with qkv (-2.9% bf16, +6.7% fp32 with every block matrix): not these targets'
    assert max(abs(e) for k, e in errors.items() if " none " in k) < 0.01, errors


# ---- tests/walk/test_walk_families.py -----------------------------------------------------------

@pytest.mark.parametrize("hook,spec,setup,dropout", walk_families.HOOK_CASES[1:], ids=walk_families.HOOK_IDS[1:])
def test_each_qwen3_hook_brings_the_walk_to_the_trace_and_its_absence_misses_it(monkeypatch, hook, spec, setup,
                                                                              dropout):
    walk_families._hook_case(monkeypatch, hook, spec, setup, dropout)


def test_qwen3_meets_the_bars_over_the_matrix():
    """Every precision, attention, checkpointing none/full, LoRA none/rank 4 (dropout 0 and 0.05), with an
    untied head: 36 steps (before the hooks, the 72 with tied heads too: median 3.71%, worst -25.8%). The qk
    norms' hooks do not see the head; the tied half of the matrix (`python tests/walk/test_walk_families.py qwen3`
    prints all 72) is left out of the suite for CI's time, and tied heads are walked in the other families'
    matrices."""
    walk_families._assert_bars(walk_families._errors(walk_families._matrix(ties=(False,))))


# ---- tests/walk/test_walk_libs.py ---------------------------------------------------------------

@pytest.mark.libs
@pytest.mark.parametrize("lib", ["litgpt", "torchtune"])
def test_the_libraries_walks_meet_the_bars_over_the_matrix(lib):
    """Precisions × checkpointing × LoRA (none, rank 4 with dropout 0 and 0.05) × tied/untied × kv 2/4."""
    walk_libs._assert_bars(walk_libs._errors(lib, walk_libs._matrix(lib)))


# ---- tests/walk/test_walk_libs_sharding.py ------------------------------------------------------

@pytest.mark.libs
@pytest.mark.distributed
def test_litgpts_ddp_walk_is_two_real_gloo_ranks_of_its_step():
    """litgpt's model and step wrapped as Fabric's DDPStrategy wraps it, two gloo ranks on the CPU, two micro-batches
    (the first under ``no_sync``): each rank's MemTracker peak is the walk's within the trace bar (1%); with
    ``.grad`` taken as views into the buckets (memplan's own DDP) the walk misses it by more than the worst bar."""
    pytest.importorskip("litgpt")
    from trainer.stacks import StackModel
    from trainer.stacks.ranks import measure_stack_ranks

    spec, setup = walk_libs_sharding.LLAMA, walk_libs_sharding.DDP.replace(grad_accum=2)
    ranks = [m.peak_allocated for m in measure_stack_ranks("litgpt", StackModel(spec=spec), setup)]
    lit = stack_for("litgpt", cpu=True)
    walked = peak_memory(spec, setup, stack=lit, collectives="gloo").peak_allocated
    assert len(ranks) == 2 and ranks[0] == ranks[1]
    assert abs(walked - ranks[0]) / ranks[0] <= 0.01, (walked, ranks)
    as_views = peak_memory(spec, setup, stack=_with_bucket_views(lit), collectives="gloo").peak_allocated
    assert abs(as_views - ranks[0]) / ranks[0] > 0.10, (as_views, ranks)


@pytest.mark.libs
@pytest.mark.distributed
def test_torchtunes_fsdp_walk_is_two_real_gloo_ranks_of_its_step():
    """torchtune's model sharded by its recipes' ``training.shard_model`` and the recipes' step, two gloo ranks on the
    CPU, a shape whose peak is the loss's: each rank's MemTracker peak is the walk's within the trace bar (1%);
    with the root kept unsharded from forward to backward (fully_shard's default, memplan's own layout) the walk
    misses it by more than that bar (its embedding and head, W·pad(root)·4 bytes, still held at the loss)."""
    pytest.importorskip("torchtune")
    from trainer.stacks import StackModel
    from trainer.stacks.ranks import measure_stack_ranks

    spec, setup = walk_libs_sharding.SMALL, TrainSetup(ctx=128, micro_batch=4, precision="fp32", world_size=2,
                                                       sharding="fsdp")
    ranks = [m.peak_allocated for m in measure_stack_ranks("torchtune", StackModel(spec=spec), setup,
                                                           wrap_options={"custom_sharded_layers": None})]
    tune = dataclasses.replace(stack_for("torchtune", cpu=True), custom_sharded_layers="none")  # the root layout
    walked = peak_memory(spec, setup, stack=tune, collectives="gloo").peak_allocated
    assert len(ranks) == 2 and ranks[0] == ranks[1]
    assert abs(walked - ranks[0]) / ranks[0] <= 0.01, (walked, ranks)
    kept = peak_memory(spec, setup, stack=_root_kept(tune), collectives="gloo").peak_allocated
    assert abs(kept - ranks[0]) / ranks[0] > 0.01, (kept, ranks)


@pytest.mark.libs
@pytest.mark.distributed
def test_litgpts_finetune_lora_fsdp_walk_is_two_real_gloo_ranks_of_its_step():
    """litgpt's LoRA model sharded by finetune_lora's own ``parallelize_fn`` (every Block checkpointed, an FSDP2 group
    per Block and the root, no MixedPrecisionPolicy), its step on two gloo ranks on the CPU: each rank's MemTracker
    peak is the walk's within the trace bar (1%) for a weights-heavy shape, whose peak is a block's all-gather with
    the root unsharded (fp32), and a small one, whose peak is the last block's recomputation stopping in down's
    adapter (bf16). Without the recomputation's unsaved tensors (``lit_recompute_stop_bytes``) the small one misses
    by more than the bar."""
    pytest.importorskip("litgpt")
    import functools

    from trainer.distributed import measure_ranks
    from trainer.stacks import StackModel
    from trainer.stacks.ranks import _rank_memory

    lit = stack_for("litgpt", cpu=True)
    configs = [(walk_libs_sharding.LLAMA, walk_libs_sharding.LORA_FSDP.replace(lora_rank=8)),
               (walk_libs_sharding.SMALL, walk_libs_sharding.LORA_FSDP.replace(ctx=128, micro_batch=4,
                                                                              precision="bf16"))]
    measured = measure_ranks([(StackModel(spec=spec), setup) for spec, setup in configs], 2,
                             measure=functools.partial(_rank_memory, "litgpt", lora_dropout=None, seed=0))
    for (spec, setup), ranks in zip(configs, measured):
        for rank, m in enumerate(ranks):
            walked = peak_memory_of_rank(spec, setup, rank, stack=lit, collectives="gloo").peak_allocated
            assert abs(walked - m.peak_allocated) / m.peak_allocated <= 0.01, (setup, rank, walked, m.peak_allocated)
    spec, setup = configs[1]
    unstopped = peak_memory(spec, setup, stack=_without_recompute_locals(lit), collectives="gloo").peak_allocated
    assert abs(unstopped - measured[1][0].peak_allocated) / measured[1][0].peak_allocated > 0.01, unstopped


def _without_recompute_locals(stack):
    """``stack`` whose recomputation stops before down, as memplan's own (nothing alive there beyond the walk's)."""
    class Stopped(type(stack)):
        def recompute_reaches_down_adapter(self, setup):
            return False

        def recompute_stop_bytes(self, spec, setup):
            return 0

        def recompute_gradient_bytes(self, spec, setup):
            return 0
    return Stopped(loss_dtype=stack.loss_dtype, lora_dropout=stack.lora_dropout, cpu=stack.cpu)


@pytest.mark.libs
@pytest.mark.distributed
def test_torchtunes_custom_sharded_layers_walk_is_two_real_gloo_ranks_of_its_step():
    """``custom_sharded_layers: ['tok_embeddings', 'output']`` (the published full-finetune configs', the walk's auto
    for an untied full finetune), passed to torchtune's own ``shard_model``, two gloo ranks of a vocabulary-heavy
    shape in fp32: each rank's MemTracker peak is the walk's within the trace bar (1%); walked with the embedding
    and head in the root (``none``) the walk misses it by more than 10% (the root's W·pad(root)·p gathered at its
    reduce-scatter with the embedding's and head's gradients)."""
    pytest.importorskip("torchtune")
    from trainer.stacks import StackModel
    from trainer.stacks.ranks import measure_stack_ranks

    spec, setup = walk_libs_sharding.LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="fp32", world_size=2,
                                                       sharding="fsdp")
    wrap = {"custom_sharded_layers": ["tok_embeddings", "output"]}
    ranks = [m.peak_allocated for m in measure_stack_ranks("torchtune", StackModel(spec=spec), setup,
                                                           wrap_options=wrap)]
    tune = stack_for("torchtune", cpu=True)
    assert tune.custom_sharded_layers == "auto"
    walked = peak_memory(spec, setup, stack=tune, collectives="gloo").peak_allocated
    assert len(ranks) == 2 and ranks[0] == ranks[1]
    assert abs(walked - ranks[0]) / ranks[0] <= 0.01, (walked, ranks)
    root = peak_memory(spec, setup, stack=dataclasses.replace(tune, custom_sharded_layers="none"),
                       collectives="gloo").peak_allocated
    assert abs(root - ranks[0]) / ranks[0] > 0.10, (root, ranks)


@pytest.mark.libs
@pytest.mark.distributed
@pytest.mark.slow
def test_torchtunes_fsdp_kept_after_forward_walk_is_two_real_gloo_ranks_of_its_step():
    """``fsdp_reshard_after_forward: False`` (``--no-fsdp-reshard-after-forward``) passed to torchtune's own
    ``shard_model``, the root layout, two gloo ranks: each rank's MemTracker peak is the walk's within the trace bar
    (1%); walked as resharding after forward, the walk misses it by more than that bar (every layer's and the
    root's all-gathered parameters held from forward to backward). slow: out of CI's time, the first row's twin."""
    pytest.importorskip("torchtune")
    from trainer.stacks import StackModel
    from trainer.stacks.ranks import measure_stack_ranks

    spec, setup = walk_libs_sharding.SMALL, TrainSetup(ctx=128, micro_batch=4, precision="fp32", world_size=2,
                                                       sharding="fsdp")
    wrap = {"custom_sharded_layers": None, "reshard_after_forward": False}
    ranks = [m.peak_allocated for m in measure_stack_ranks("torchtune", StackModel(spec=spec), setup,
                                                           wrap_options=wrap)]
    tune = dataclasses.replace(stack_for("torchtune", cpu=True), custom_sharded_layers="none")
    kept = peak_memory(spec, setup, stack=dataclasses.replace(tune, fsdp_reshard_after_forward=False),
                       collectives="gloo").peak_allocated
    assert len(ranks) == 2 and ranks[0] == ranks[1]
    assert abs(kept - ranks[0]) / ranks[0] <= 0.01, (kept, ranks)
    resharded = peak_memory(spec, setup, stack=tune, collectives="gloo").peak_allocated
    assert abs(resharded - ranks[0]) / ranks[0] > 0.01, (resharded, ranks)


@pytest.mark.libs
@pytest.mark.distributed
def test_litgpts_fsdp1_walk_is_two_real_gloo_ranks_of_its_step():
    """litgpt's model wrapped as Fabric's FSDPStrategy wraps it for pretrain.py (FSDP1, one flat parameter per Block
    and the root's, Fabric's bf16 MixedPrecision) and pretrain's step, two gloo ranks on the CPU, a weights-heavy
    shape whose peak is the root's reduce-scatter: each rank's MemTracker peak is the walk's (``FlatShard``) within
    the trace bar (1%); walked with FSDP2's hook (``FullyShard``: all-gather output and copy-out, fp32
    reduce-scatter) it misses by more than 10%."""
    pytest.importorskip("litgpt")
    from memplan.memory.peak import peak_memory_of_rank
    from memplan.memory.sharding import FullyShard
    from memplan.memory.walk import walk_step
    from trainer.stacks import StackModel
    from trainer.stacks.ranks import measure_stack_ranks

    spec = walk_libs_sharding.LLAMA
    setup = TrainSetup(ctx=16, micro_batch=1, precision="bf16-mixed", world_size=2, sharding="fsdp")
    ranks = [m.peak_allocated for m in measure_stack_ranks("litgpt", StackModel(spec=spec), setup)]
    lit = stack_for("litgpt", cpu=True)
    for rank, measured in enumerate(ranks):
        walked = peak_memory_of_rank(spec, setup, rank, stack=lit, collectives="gloo").peak_allocated
        assert abs(walked - measured) / measured <= 0.01, (rank, walked, ranks)
    as_fsdp2 = walk_step(spec, setup, stack=lit, collectives="gloo",
                         sharding=FullyShard(spec, setup, 0, "gloo", lit)).peak.total
    assert abs(as_fsdp2 - ranks[0]) / ranks[0] > 0.10, (as_fsdp2, ranks)


def _root_kept(stack):
    """``stack`` with fully_shard's default root: unsharded from forward to backward."""
    class Kept(type(stack)):
        fsdp_root_reshards_after_forward = False
    return Kept(loss_dtype=stack.loss_dtype, lora_dropout=stack.lora_dropout, cpu=stack.cpu,
                custom_sharded_layers=getattr(stack, "custom_sharded_layers", "auto"))


def _with_bucket_views(stack):
    """``stack`` with memplan's own DDP: ``.grad`` views into the buckets."""
    class Views(type(stack)):
        ddp_gradient_as_bucket_view = True
    return Views(loss_dtype=stack.loss_dtype, lora_dropout=stack.lora_dropout, cpu=stack.cpu)


# ---- tests/walk/test_walk_lora.py ---------------------------------------------------------------

def test_lora_targets_meet_the_bars_without_checkpointing():
    """llama, gpt2, gpt_neox × every target subset × precisions × dropout 0 and 0.05."""
    walk_lora._assert_bars(walk_lora._errors(walk_lora._matrix(checkpointing=("none",))))


# ---- tests/walk/test_walk_stacks.py -------------------------------------------------------------

def test_the_transformers_walk_meets_the_bars_over_the_matrix():
    """Every family, precision, attention, checkpointing none/full, LoRA none/rank 4 (dropout 0 and 0.05),
    tied and untied: LoRA under full checkpointing included (the recomputation's hooks,
    tests/walk/test_walk_lora_ckpt.py; before them it missed by up to 19%)."""
    errors = walk_stacks._errors(walk_stacks._matrix())
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert statistics.median(abs(e) for e in errors.values()) <= walk_stacks.MEDIAN_BAR, errors
    assert abs(errors[worst]) <= walk_stacks.WORST_BAR, (worst, errors[worst])

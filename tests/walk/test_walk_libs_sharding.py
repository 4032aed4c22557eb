"""litgpt and torchtune over several devices: what ``--sharding`` each stack's walk follows.

litgpt under Fabric's DDP (``Fabric(strategy="ddp")``: ``DistributedDataParallel`` with PyTorch's defaults) keeps
its buckets beside ``.grad`` (``gradient_as_bucket_view=False``), as transformers' Trainer does; torchtune's
distributed recipes shard with FSDP2 through ``training.shard_model``, memplan's own layout but for the root, which
reshards after forward. litgpt's FSDP1 (pretrain.py's and finetune/full.py's Fabric ``FSDPStrategy``) is walked by
``memory.fsdp1.FlatShard``; litgpt's finetune_lora over several devices is FSDP2 by its own ``parallelize_fn`` (every
Block checkpointed: ``memory.stacks.litgpt_sharding``). torchtune's DDP (it has none) is refused in one line naming
why. The walk against two real gloo ranks of each (litgpt's DDP, FSDP1 and FSDP2 steps, torchtune's FSDP2 step) is in
tests/runs/test_walk_matrices.py (it spawns processes); ``python tests/walk/test_walk_libs_sharding.py litgpt``
(or ``torchtune``, in that library's environment; ``litgpt-fsdp``: litgpt's FSDP1, each rank; ``litgpt-lora-fsdp``:
finetune_lora's FSDP2) prints the whole table.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: runs_helper

import pytest
from typer.testing import CliRunner

from memplan.autotune import search_axes
from memplan.cli import app
from memplan.hardware import load_profile
from memplan.memory import peak_memory
from memplan.memory.stacks import stack_for
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from runs_helper import one_line_error

LLAMA = ModelSpec(arch="llama", layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=8000, tied=False)
DDP = TrainSetup(ctx=16, micro_batch=1, precision="fp32", world_size=2, sharding="ddp")
BASE = ["--arch", "llama", "--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "512",
        "--vocab", "8000", "--untied", "--ctx", "16", "--batch", "1", "--device", "cpu", "--precision", "fp32"]


def test_litgpt_ddp_keeps_fabrics_buckets_beside_the_gradients():
    """Fabric's DDPStrategy keeps PyTorch's gradient_as_bucket_view=False: a weights-heavy step on the CPU (the
    for-loop AdamW) peaks in the optimizer step with 2·N·p of gradients, the single-device peak plus N·p."""
    lit = stack_for("litgpt", cpu=True)
    ddp = peak_memory(LLAMA, DDP, stack=lit)
    single = peak_memory(LLAMA, DDP.replace(world_size=1, sharding="none"), stack=lit)
    assert ddp.peak_moment == single.peak_moment == "optimizer step"
    assert ddp.gradients == 2 * LLAMA.params * 4
    assert ddp.peak_allocated == single.peak_allocated + LLAMA.params * 4


def test_litgpt_ddp_under_lora_buckets_litgpts_adapters():
    """Under LoRA only the adapters get gradients, and litgpt's (one A per fc_1 and fc_2, 3r rows of the fused
    qkv's A) are larger than memplan's: the buckets hold litgpt's adapters (``lit_lora_bytes_delta`` included)."""
    from memplan.memory.stacks.litgpt import lit_lora_bytes_delta
    from memplan.memory.terms import trainable_params

    lit = stack_for("litgpt", lora_dropout=0.0)
    setup = DDP.replace(lora_rank=4, lora_targets="qkv,proj,up,down")
    ddp = peak_memory(LLAMA, setup, stack=lit)
    single = peak_memory(LLAMA, setup.replace(world_size=1, sharding="none"), stack=lit)
    adapters = trainable_params(LLAMA, setup) * 4 + lit_lora_bytes_delta(LLAMA, setup)
    assert lit_lora_bytes_delta(LLAMA, setup) > 0
    assert ddp.peak_allocated - single.peak_allocated == adapters


def test_estimate_plans_litgpts_ddp_row():
    """``estimate --stack litgpt --world-size 2 --sharding ddp``, refused before ("accepted: none"), is walked."""
    done = CliRunner().invoke(app, ["estimate", *BASE, "--stack", "litgpt", "--world-size", "2", "--sharding", "ddp",
                                    "--json"])
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    assert data["setup"]["sharding"] == "ddp" and data["setup"]["world_size"] == 2
    assert data["memory"]["gradients"] == 2 * LLAMA.params * 4


@pytest.mark.parametrize("args,needles", [
    (["--stack", "litgpt", "--world-size", "2", "--sharding", "fsdp", "--lora-rank", "4"],
     ["--checkpointing none with --sharding fsdp", "parallelize_fn checkpoints every Block", "accepted: full"]),
    (["--stack", "litgpt", "--checkpointing", "full", "--lora-rank", "4"],
     ["--checkpointing full", "only under FSDP with several devices", "accepted: none; full with --sharding fsdp"]),
    (["--stack", "litgpt", "--world-size", "2", "--sharding", "fsdp", "--grad-accum", "2"],
     ["--grad-accum 2", "no_sync", "accepted: --grad-accum 1"]),
    (["--stack", "litgpt", "--world-size", "2", "--sharding", "fsdp", "--checkpointing", "selective"],
     ["--checkpointing selective", "finetune_full", "accepted: none, full"]),
    (["--stack", "torchtune", "--world-size", "2", "--sharding", "ddp"],
     ["--sharding ddp", "no DDP", "accepted: none, fsdp"]),
])
def test_a_sharding_the_walk_does_not_follow_is_one_line_naming_why(args, needles):
    done = CliRunner().invoke(app, ["estimate", *BASE[:-2], "--precision", "bf16", *args])
    one_line_error(done, *needles)


def test_autotune_searches_ddp_and_fsdp_for_litgpt_over_several_devices():
    """DDP and FSDP: FSDP1 as pretrain runs it, or with LoRA finetune_lora's FSDP2."""
    h100 = load_profile("h100-sxm")
    assert search_axes(stack_for("litgpt"), h100, world_size=2)["sharding"] == ("ddp", "fsdp")
    done = CliRunner().invoke(app, ["autotune", "--params", "22m", "--device", "h100-sxm", "--ctx", "1024",
                                    "--stack", "litgpt", "--world-size", "2", "--json"])
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    assert data["plan"]["sharding"] == "ddp" and data["plan"]["world_size"] == 2


FSDP = DDP.replace(sharding="fsdp")
NEOX = ModelSpec(arch="gpt_neox", layers=2, hidden=68, heads=4, kv_heads=4, ffn=272, vocab=8001, tied=False)


def test_litgpts_fsdp1_flat_parameters_align_each_tensor_and_pad_the_shard():
    """FSDP1 with ``use_orig_params`` starts every tensor of a flat parameter on 16 bytes: a gpt_neox Block of width
    68 (biases of 68 elements) holds 24 padding elements in bf16 (8-element alignment) and none in fp32 (4); each
    rank's shard is ceil(flat/W), and the pieces of the parameters on the two ranks are every element once."""
    from memplan.memory.fsdp1 import fsdp1_flat_numel, fsdp1_local_pieces, fsdp1_shard_numel, lit_block_param_numels

    block = lit_block_param_numels(NEOX)
    assert sum(block) == NEOX.layer_params
    assert fsdp1_flat_numel(block, 4) == NEOX.layer_params
    assert fsdp1_flat_numel(block, 2) == NEOX.layer_params + 24
    assert fsdp1_shard_numel(block, 2, 3) == -(-(NEOX.layer_params + 24) // 3)
    pieces = [fsdp1_local_pieces(block, 2, 2, rank) for rank in (0, 1)]
    assert [a + b for a, b in zip(*pieces)] == block
    assert pieces[0][0] == block[0] and pieces[1][0] == 0  # norm_1 on rank 0 only: no state on rank 1


def test_litgpts_fsdp1_keeps_the_root_gathered_and_one_block_at_a_time():
    """Fabric's FSDPStrategy (FSDP1): at the end of the forward every block is resharded but the root keeps its
    unsharded flat parameter (W·s(root)·c: embedding, head, final norm) for the backward, where torchtune's FSDP2
    root holds nothing more; the step starts with the shards only, 1/W of the model, padded."""
    from memplan.memory.fsdp1 import fsdp1_sharded_weight_bytes, fsdp1_unsharded_bytes
    from memplan.memory.terms import rope_buffer_bytes
    from memplan.memory.walk import walk_step

    lit = stack_for("litgpt")
    walk = walk_step(LLAMA, FSDP, stack=lit)
    at = {m.name: m.bytes["weights"] for m in walk.marks}
    buffers = rope_buffer_bytes(LLAMA, FSDP) + lit.buffer_bytes_delta(LLAMA, FSDP)
    assert at["start of forward"] - buffers == fsdp1_sharded_weight_bytes(LLAMA, FSDP) == (LLAMA.params // 2) * 4
    assert at["end of forward"] - at["start of forward"] == fsdp1_unsharded_bytes(LLAMA, FSDP, "root") == \
        (LLAMA.params - LLAMA.layers * LLAMA.layer_params) * 4


def test_litgpts_fsdp1_reduces_in_bf16_and_casts_the_shard_to_fp32():
    """Fabric's bf16-mixed under FSDP is ``MixedPrecision(param_dtype=reduce_dtype=bf16)`` over fp32 shards: the
    gathered flat parameter and the reduce-scatter are 2 bytes an element, the gradient the optimizer gets is the
    shard cast back to the parameters' fp32 (4), and the optimizer state is fp32 over this rank's pieces."""
    from memplan.memory.fsdp1 import (fsdp1_local_numels, fsdp1_optimizer_state_bytes, fsdp1_reduced_grad_bytes,
                                      fsdp1_shard, fsdp1_sharded_grad_bytes, fsdp1_unsharded_bytes)

    mixed = FSDP.replace(precision="bf16-mixed")
    s = fsdp1_shard(LLAMA, mixed, "block")
    assert fsdp1_unsharded_bytes(LLAMA, mixed, "block") == 2 * s * 2
    assert (fsdp1_reduced_grad_bytes(LLAMA, mixed, "block"), fsdp1_sharded_grad_bytes(LLAMA, mixed, "block")) == \
        (s * 2, s * 4)
    on_rank0 = sum(1 for n in fsdp1_local_numels(LLAMA, mixed, 0) if n)  # parameters with a piece there: a step each
    assert fsdp1_optimizer_state_bytes(LLAMA, mixed, 0) == 2 * (LLAMA.params // 2) * 4 + 4 * on_rank0


def test_litgpts_finetune_full_loss_drops_each_sequences_last_position():
    """finetune/full.py's loss is over ``logits[..., :-1, :]``: at the loss's backward it holds B·V·4 bytes fewer than
    pretrain's over every position (measured on two gloo ranks: the walk +0.21% without it, −0.00% with it)."""
    from memplan.memory.stacks.litgpt import lit_finetune_full_shifted_loss_bytes

    lit = stack_for("litgpt", cpu=True)
    wide = LLAMA.replace(hidden=64, ffn=128, layers=2)
    setup = FSDP.replace(ctx=128, micro_batch=4)
    full = setup.replace(checkpointing="full")
    pretrain_loss, full_loss = lit.chunked_loss_backward_bytes(wide, setup), lit.chunked_loss_backward_bytes(wide, full)
    assert pretrain_loss - full_loss == 4 * wide.vocab * 4
    assert lit_finetune_full_shifted_loss_bytes(wide, setup) == 0  # pretrain's loss covers every position


def test_estimate_plans_litgpts_fsdp():
    """``estimate --stack litgpt --world-size 2 --sharding fsdp``, refused before (one line naming FSDP1
    HYBRID_SHARD), is walked (Fabric's FSDPStrategy): each rank holds half the optimizer state of one device."""
    args = [*BASE[:-2], "--precision", "bf16", "--stack", "litgpt", "--json"]
    one = CliRunner().invoke(app, ["estimate", *args])
    two = CliRunner().invoke(app, ["estimate", *args, "--world-size", "2", "--sharding", "fsdp"])
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    one, two = json.loads(one.stdout)["memory"], json.loads(two.stdout)["memory"]
    assert two["optimizer"] < 0.51 * one["optimizer"]
    full = CliRunner().invoke(app, ["estimate", *args, "--world-size", "2", "--sharding", "fsdp", "--checkpointing",
                                    "full"])
    assert full.exit_code == 0, full.output  # finetune_full's checkpointed blocks


def test_torchtunes_root_reshards_after_forward_where_memplans_keeps_its_parameters():
    """torchtune's shard_model gives the root ``reshard_after_forward=True``: at the end of the forward its
    unsharded parameters (embedding, final norm, head: W·pad(root)·p) are gone, where memplan's own root keeps
    them until its backward ends; the rest of the layout is memplan's (the same shards at the step's start)."""
    from memplan.memory.sharding import fsdp_unsharded_bytes
    from memplan.memory.walk import walk_step

    def at(walk, name):
        return next(m for m in walk.marks if m.name == name).bytes["weights"]

    tune = stack_for("torchtune")
    tt, ours = walk_step(LLAMA, FSDP, stack=tune), walk_step(LLAMA, FSDP)
    assert at(tt, "start of forward") - tune.buffer_bytes_delta(LLAMA, FSDP) == at(ours, "start of forward")
    root = fsdp_unsharded_bytes(LLAMA, FSDP, "root")
    assert at(ours, "end of forward") - at(ours, "start of forward") - root == \
        at(tt, "end of forward") - at(tt, "start of forward") == 0


def test_torchtunes_extra_adapters_are_sharded_with_their_blocks():
    """Under LoRA torchtune's separate q_proj, k_proj, v_proj, w1, w3 adapters (``tt_lora_bytes_delta``) are
    parameters of their layer: each rank holds its shard, 1/W of them, and the state of that shard only."""
    from memplan.memory.sharding import fsdp_optimizer_state_bytes, fsdp_sharded_weight_bytes
    from memplan.memory.stacks.torchtune import tt_lora_bytes_delta
    from memplan.memory.terms import rope_buffer_bytes
    from memplan.memory.walk import walk_step

    setup = FSDP.replace(lora_rank=8, lora_targets="qkv,proj,up,down")
    extra = tt_lora_bytes_delta(LLAMA, setup)
    tune = stack_for("torchtune")
    start = walk_step(LLAMA, setup, stack=tune).marks[0].bytes
    buffers = tune.buffer_bytes_delta(LLAMA, setup) + rope_buffer_bytes(LLAMA, setup)
    assert extra > 0
    assert start["weights"] - fsdp_sharded_weight_bytes(LLAMA, setup) - buffers == extra // 2
    tensors = tune.lora_tensors_delta(LLAMA, setup)
    assert start["optimizer"] - fsdp_optimizer_state_bytes(LLAMA, setup) == 2 * (extra // 2) + 4 * tensors


def test_estimate_plans_torchtunes_fsdp():
    """``estimate --stack torchtune --world-size 2 --sharding fsdp``, refused before, is walked: each rank holds
    half the weights and the optimizer state of one device."""
    args = [*BASE[:-2], "--precision", "bf16", "--stack", "torchtune", "--json"]
    one = CliRunner().invoke(app, ["estimate", *args])
    two = CliRunner().invoke(app, ["estimate", *args, "--world-size", "2", "--sharding", "fsdp"])
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    one, two = json.loads(one.stdout)["memory"], json.loads(two.stdout)["memory"]
    assert two["optimizer"] < 0.51 * one["optimizer"]
    assert two["peak_allocated"] < one["peak_allocated"]


def test_autotune_searches_fsdp_for_torchtune_and_emits_its_distributed_recipe(tmp_path):
    """``autotune --stack torchtune --world-size 2`` considers FSDP (torchtune's only layout over several devices),
    and ``--emit`` names the distributed recipe, how to launch it, and the FSDP2 settings the walk assumed."""
    h100 = load_profile("h100-sxm")
    assert search_axes(stack_for("torchtune"), h100, world_size=2)["sharding"] == ("fsdp",)
    done = CliRunner().invoke(app, ["autotune", "--params", "22m", "--device", "h100-sxm", "--ctx", "1024",
                                    "--stack", "torchtune", "--world-size", "2", "--json", "--emit",
                                    str(tmp_path / "out")])
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    assert data["plan"]["sharding"] == "fsdp" and data["plan"]["world_size"] == 2
    text = (tmp_path / "out" / "torchtune.yaml").read_text()
    recipe = "lora_finetune_distributed" if data["plan"].get("lora_rank") else "full_finetune_distributed"
    assert f"recipe: {recipe}" in text and f"tune run --nproc_per_node 2 {recipe}" in text
    assert "fsdp_reshard_after_forward: true" in text and "fsdp_cpu_offload: false" in text


def test_autotune_emit_for_litgpt_over_several_devices_plans_and_writes_its_fsdp(tmp_path):
    """litgpt's YAML has ``devices`` but no strategy key (its scripts pick FSDP whenever devices > 1): ``--emit`` with
    ``--world-size 2`` searches FSDP alone (the DDP the walk also covers cannot be written) and writes pretrain's
    YAML with ``devices: 2``, its header naming the FSDPStrategy the plan assumed."""
    import yaml

    done = CliRunner().invoke(app, ["autotune", "--params", "22m", "--device", "h100-sxm", "--ctx", "1024",
                                    "--stack", "litgpt", "--world-size", "2", "--json", "--emit", str(tmp_path / "out")])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["plan"]["sharding"] == "fsdp"
    text = (tmp_path / "out" / "litgpt.yaml").read_text()
    assert text.startswith("# litgpt pretrain --config litgpt.yaml") and "HYBRID_SHARD" in text
    assert yaml.safe_load(text)["devices"] == 2


LORA_FSDP = FSDP.replace(lora_rank=4, checkpointing="full")  # litgpt finetune_lora over two devices


def test_estimate_plans_litgpts_finetune_lora_over_several_devices():
    """``estimate --stack litgpt --world-size 2 --sharding fsdp --lora-rank 4 --checkpointing full``, refused before
    ("FSDP2 per Linear ... accepted: none, ddp"), is walked as finetune_lora's FSDP2: each rank holds the state of
    its half of the adapters."""
    args = [*BASE, "--stack", "litgpt", "--lora-rank", "4", "--json"]
    one = CliRunner().invoke(app, ["estimate", *args])
    two = CliRunner().invoke(app, ["estimate", *args, "--world-size", "2", "--sharding", "fsdp", "--checkpointing",
                                   "full"])
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    one, two = json.loads(one.stdout), json.loads(two.stdout)
    assert (two["setup"]["sharding"], two["setup"]["checkpointing"], two["setup"]["world_size"]) == ("fsdp", "full", 2)
    assert two["memory"]["optimizer"] < 0.51 * one["memory"]["optimizer"]


def test_litgpts_fsdp2_is_its_own_hook_gathering_the_parameters_dtype_under_autocast():
    """finetune_lora's FSDP2 has no MixedPrecisionPolicy: under bf16-mixed (Fabric's autocast around fp32
    parameters) each block's all-gather is W·pad(block)·4 bytes, twice the 16-bit gather memplan's own FSDP2
    (MixedPrecisionPolicy(param_dtype=bf16)) makes, and the walk's activations stay autocast's."""
    from memplan.memory.sharding import FullyShard, fsdp_unsharded_bytes
    from memplan.memory.stacks.litgpt_sharding import LitFullyShard
    from memplan.memory.walk import sharding_hook

    mixed = LORA_FSDP.replace(precision="bf16-mixed", lora_targets="proj")  # no adapter beyond memplan's
    lit = sharding_hook(LLAMA, mixed, stack_for("litgpt"))
    ours = FullyShard(LLAMA, mixed)
    assert isinstance(lit, LitFullyShard)
    assert lit.gathered["block"] == fsdp_unsharded_bytes(LLAMA, mixed.replace(precision="fp32"), "block") \
        == 2 * ours.gathered["block"]
    assert lit.copy_in["block"] == 0 < ours.copy_in["block"]
    assert lit.compute_setup.precision == "bf16-mixed" and ours.compute_setup.precision == "bf16"
    assert peak_memory(LLAMA, mixed, stack=stack_for("litgpt")).weights > \
        peak_memory(LLAMA, LORA_FSDP.replace(precision="bf16"), stack=stack_for("litgpt")).weights


def test_litgpts_recomputation_stops_in_down_adapter_with_blocks_locals_alive():
    """A checkpointed litgpt block's recomputation runs on into down's LoRALinear (the last saved tensor is x·Aᵀ)
    and holds there the base matmul's output, ``attention_output``, the MLP's input and, with dropout, the MLP
    product (``lit_recompute_stop_bytes``): with finetune_lora's dropout 0.05 on the CPU in fp32 the walk's peak is
    that stop, its unsaved tensors n·H·4·3 + n·F·4 (n = 16 tokens here) beyond memplan's own stop."""
    from memplan.memory.stacks.litgpt import lit_recompute_stop_bytes

    lit = stack_for("litgpt", cpu=True, lora_dropout=0.05)
    setup = LORA_FSDP.replace(world_size=1, sharding="none", micro_batch=8, ctx=128)
    n = 8 * 128
    assert lit_recompute_stop_bytes(SMALL, setup, 0.05) == n * SMALL.hidden * 4 * 3 + n * SMALL.ffn * 4
    assert lit_recompute_stop_bytes(SMALL, setup.replace(lora_targets="qkv,proj"), 0.05) == 0  # no down adapter
    walked = peak_memory(SMALL, setup, stack=lit)
    assert walked.peak_moment == "block forward: MLP", walked.peak_moment  # the recomputation's stop


@pytest.mark.libs
def test_the_ranks_shard_litgpt_as_finetune_loras_parallelize_fn_does(tmp_path):
    """``wrap_ranks`` under --sharding fsdp with LoRA is litgpt's own ``parallelize_fn``: every Block checkpointed
    and an FSDP2 group of all its parameters, each CheckpointWrapper an FSDP module with no parameter left, no
    Linear a group (no nn.Linear trains under mark_only_lora_as_trainable), the root a group of the rest."""
    pytest.importorskip("litgpt")
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    from trainer.stacks import StackModel
    from trainer.stacks.litgpt import build_model, wrap_ranks

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        setup = LORA_FSDP.replace(lora_targets="qkv,proj,up,down,head")
        net = wrap_ranks(build_model(StackModel(spec=SMALL), setup), setup)
        groups = {name: m._get_fsdp_state()._fsdp_param_group for name, m in net.named_modules()
                  if isinstance(m, FSDPModule)}
        assert len(groups) == 2 * SMALL.layers + 1
        wrappers = [name for name, m in net.named_modules() if isinstance(m, CheckpointWrapper)]
        assert len(wrappers) == SMALL.layers and all(groups[w] is None for w in wrappers)
        blocks = [g for name, g in groups.items() if name.endswith("_checkpoint_wrapped_module")]
        assert len(blocks) == SMALL.layers and all(g is not None for g in blocks)
        assert groups[""] is not None and len(groups[""].fsdp_params) == 5  # wte, ln_f, lm_head and its A, B
        assert sum(len(g.fsdp_params) for g in groups.values() if g is not None) == \
            len(list(net.parameters()))
    finally:
        dist.destroy_process_group()


@pytest.mark.libs
def test_litgpts_checkpointed_lora_block_is_walked_as_its_real_step():
    """litgpt's LoRA model with every Block in ``checkpoint_wrapper`` (what finetune_lora's parallelize_fn does, one
    process here), its real step on the CPU under MemTracker: the walk's peak within the trace bar (1%), fp32, bf16
    and bf16-mixed with finetune_lora's dropout 0.05 (the peak: the recomputation's stop in the last block), and fp32
    without dropout (the peak: down's backward, whose input gradients autograd sums in place)."""
    pytest.importorskip("litgpt")
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from trainer.measure import _random_ids, _tracked_steps
    from trainer.stacks import StackModel
    from trainer.stacks.litgpt import build_model, make_optimizer, train_step

    for precision, dropout in (("fp32", 0.05), ("bf16", 0.05), ("bf16-mixed", 0.05), ("fp32", 0.0)):
        setup = TrainSetup(ctx=128, micro_batch=4, precision=precision, lora_rank=4)
        torch.manual_seed(0)
        net = build_model(StackModel(spec=SMALL), setup, lora_dropout=dropout)
        net.transformer.h = torch.nn.ModuleList([checkpoint_wrapper(b, preserve_rng_state=False)
                                                 for b in net.transformer.h])
        gen = torch.Generator().manual_seed(1)
        real, _, _ = _tracked_steps(net, make_optimizer(net, setup), setup,
                                    lambda gen=gen, setup=setup: _random_ids(SMALL.vocab, setup, "cpu", gen), "cpu",
                                    step_fn=train_step)
        walked = peak_memory(SMALL, setup.replace(checkpointing="full"),
                             stack=stack_for("litgpt", cpu=True, lora_dropout=dropout))
        assert abs(walked.peak_allocated - real) / real <= 0.01, (precision, dropout, walked.peak_allocated, real)


@pytest.mark.libs
def test_litgpt_lora_yaml_for_several_devices_parses_as_finetune_loras_arguments(tmp_path):
    """The emitted YAML for two devices is ``litgpt finetune_lora --config`` with ``devices: 2``, parsed by
    jsonargparse against ``litgpt.finetune.lora.setup``'s own signature (as litgpt's CLI parses it)."""
    pytest.importorskip("litgpt")
    from jsonargparse import ArgumentParser
    from litgpt.finetune.lora import setup as lora_setup

    from memplan.emit import render
    from memplan.plan import Plan

    plan = Plan(model=SMALL.replace(name="small"), setup=LORA_FSDP.replace(precision="bf16"), device="cpu",
                budget_bytes=2**30)
    (tmp_path / "litgpt.yaml").write_text(render(plan, "litgpt")["litgpt.yaml"])
    parser = ArgumentParser()
    parser.add_function_arguments(lora_setup)
    cfg = parser.parse_path(str(tmp_path / "litgpt.yaml"))
    assert (cfg.devices, cfg.precision, cfg.lora_r) == (2, "bf16-true", 4)


def test_torchtunes_custom_sharded_layers_follow_its_published_configs():
    """auto: ``['tok_embeddings', 'output']`` where the published distributed configs set it (the untied llama3
    builders' full finetunes), unset under LoRA (commented out in every LoRA config) and for a tied head."""
    from memplan.memory.stacks.torchtune_fsdp import tt_custom_sharded_layers

    tied = dataclasses.replace(LLAMA, tied=True)
    assert tt_custom_sharded_layers(LLAMA, FSDP, "auto") == ("tok_embeddings", "output")
    assert tt_custom_sharded_layers(LLAMA, FSDP.replace(lora_rank=8), "auto") == ()
    assert tt_custom_sharded_layers(tied, FSDP, "auto") == ()
    assert tt_custom_sharded_layers(LLAMA, FSDP, "none") == ()


def test_torchtunes_own_embedding_and_head_groups_are_gathered_one_at_a_time():
    """With the embedding and the head FSDP2 groups of their own the root holds the final norm only: the forward
    ends with every group resharded, and the peak is no longer the root's reduce-scatter with the embedding and
    head gathered and their gradients beside them: in this vocabulary-heavy shape the walk is lower by more than
    the head's all-gather (W·pad(head)·p), and the head's gathers (one per output chunk) are walked."""
    from memplan.memory.sharding import fsdp_unsharded_bytes
    from memplan.memory.walk import walk_step

    tune = stack_for("torchtune")
    layouts = {"own": tune, "root": dataclasses.replace(tune, custom_sharded_layers="none")}
    walks = {k: walk_step(LLAMA, FSDP, stack=v) for k, v in layouts.items()}
    at = {k: {m.name: m.bytes["weights"] for m in walk.marks} for k, walk in walks.items()}
    assert at["own"]["end of forward"] == at["own"]["start of forward"] == at["root"]["start of forward"]
    peaks = {k: peak_memory(LLAMA, FSDP, stack=v, collectives="gloo") for k, v in layouts.items()}
    assert peaks["root"].peak_moment == "backward: the root's reduce-scatter" != peaks["own"].peak_moment
    assert peaks["root"].peak_allocated - peaks["own"].peak_allocated > fsdp_unsharded_bytes(LLAMA, FSDP, "head")


def test_torchtunes_groups_kept_after_forward_hold_every_layer_at_the_end_of_the_forward():
    """``fsdp_reshard_after_forward: False``: every group keeps its all-gathered parameters from its forward to its
    post-backward, so the forward ends with each layer's and the root's, L·W·pad(block)·p + W·pad(root)·p, beside
    the shards; nothing is all-gathered in the backward."""
    from memplan.memory.sharding import fsdp_unsharded_bytes
    from memplan.memory.walk import walk_step

    tune = dataclasses.replace(stack_for("torchtune"), custom_sharded_layers="none", fsdp_reshard_after_forward=False)
    marks = {m.name: m.bytes for m in walk_step(LLAMA, FSDP, stack=tune).marks}
    held = LLAMA.layers * fsdp_unsharded_bytes(LLAMA, FSDP, "block") + fsdp_unsharded_bytes(LLAMA, FSDP, "root")
    assert marks["end of forward"]["weights"] - marks["start of forward"]["weights"] == held
    assert marks["end of forward"]["temporaries"] == 0
    assert marks["end of backward"]["weights"] == marks["start of forward"]["weights"]


def test_estimate_names_the_torchtune_layout_it_walked():
    """auto's choice is said, not silent: estimate's Setup names custom_sharded_layers (and a kept forward)."""
    args = [*BASE, "--stack", "torchtune", "--world-size", "2", "--sharding", "fsdp"]
    auto = CliRunner().invoke(app, ["estimate", *args])
    kept = CliRunner().invoke(app, ["estimate", *args, "--custom-sharded-layers", "none",
                                    "--no-fsdp-reshard-after-forward"])
    assert auto.exit_code == kept.exit_code == 0, kept.output
    assert "custom_sharded_layers tok_embeddings,output" in " ".join(auto.stdout.split())
    assert "custom_sharded_layers unset, fsdp_reshard_after_forward false" in " ".join(kept.stdout.split())


@pytest.mark.parametrize("args,needles", [
    (["--stack", "torchtune", "--world-size", "2", "--sharding", "fsdp", "--no-fsdp-reshard-after-forward"],
     ["--no-fsdp-reshard-after-forward", "groups of their own", "accepted with it: --custom-sharded-layers none"]),
    (["--stack", "torchtune", "--world-size", "2", "--sharding", "fsdp", "--custom-sharded-layers", "output"],
     ["--custom-sharded-layers output", "accepted: auto, none, tok_embeddings,output"]),
    (["--stack", "torchtune", "--world-size", "2", "--sharding", "fsdp", "--tied", "--custom-sharded-layers",
      "tok_embeddings,output"], ["TiedLinear", "accepted for a tied model: auto, none"]),
    (["--stack", "torchtune", "--custom-sharded-layers", "none"], ["--stack torchtune --sharding fsdp",
                                                                   "accepted otherwise: --custom-sharded-layers auto"]),
])
def test_a_custom_sharded_layers_the_walk_does_not_take_is_one_line(args, needles):
    done = CliRunner().invoke(app, ["estimate", *BASE[:-2], "--precision", "bf16", *args])
    one_line_error(done, *needles)


@pytest.mark.libs
def test_the_ranks_shard_torchtune_as_its_distributed_recipes_do(tmp_path):
    """``wrap_ranks`` is the recipes' ``training.shard_model`` call: every layer and the root are FSDP2 modules whose
    parameters are sharded DTensors, and after a forward the root's are resharded as the layers' are (the
    root was given reshard_after_forward=True; fully_shard's default would have kept them unsharded)."""
    pytest.importorskip("torchtune")
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from trainer.stacks import StackModel
    from trainer.stacks.torchtune import build_model, wrap_ranks

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        net = wrap_ranks(build_model(StackModel(spec=SMALL), TrainSetup(ctx=16, precision="fp32")), FSDP)
        sharded = [m for m in net.modules() if isinstance(m, FSDPModule)]
        assert len(sharded) == SMALL.layers + 1 and sharded[0] is net
        net(tokens=torch.randint(0, SMALL.vocab, (1, 16)))
        assert all(type(p).__name__ == "DTensor" for p in net.parameters())  # every group resharded
    finally:
        dist.destroy_process_group()


@pytest.mark.libs
def test_the_ranks_wrap_litgpt_as_fabrics_ddp_strategy_does(tmp_path):
    """``wrap_ranks`` is ``DDPStrategy.setup_module``: the same DDP settings (one gloo rank here)."""
    pytest.importorskip("litgpt")
    import torch
    import torch.distributed as dist
    from lightning.fabric.strategies import DDPStrategy

    from trainer.stacks.litgpt import wrap_ranks

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        strategy = DDPStrategy(parallel_devices=[torch.device("cpu")])
        net = torch.nn.Linear(4, 4)
        net._memplan_precision = None
        fabrics, ours = strategy.setup_module(torch.nn.Linear(4, 4)), wrap_ranks(net, DDP)
        assert ours.gradient_as_bucket_view is fabrics.gradient_as_bucket_view is False
        assert ours.broadcast_buffers == fabrics.broadcast_buffers
        assert ours.find_unused_parameters == fabrics.find_unused_parameters
    finally:
        dist.destroy_process_group()


@pytest.mark.libs
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_ranks_wrap_litgpt_as_fabrics_fsdp_strategy_does(tmp_path, checkpointing):
    """``wrap_ranks`` under ``--sharding fsdp`` is ``FSDPStrategy.setup_module`` with litgpt's strategy: one FSDP1
    unit per Block and the root, Fabric's ``use_orig_params=True`` and its precision plugin's MixedPrecision (bf16
    for bf16-mixed), every Block checkpointed for finetune_full (``--checkpointing full``), none for pretrain."""
    pytest.importorskip("litgpt")
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel

    from trainer.stacks import StackModel
    from trainer.stacks.litgpt import build_model, wrap_ranks

    setup = TrainSetup(ctx=16, precision="bf16-mixed", world_size=2, sharding="fsdp", checkpointing=checkpointing)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        net = wrap_ranks(build_model(StackModel(spec=SMALL), setup), setup)  # (one gloo rank here)
        units = [m for m in net.modules() if isinstance(m, FullyShardedDataParallel)]
        assert len(units) == SMALL.layers + 1 and units[0] is net
        assert net._use_orig_params and net.mixed_precision.param_dtype == net.mixed_precision.reduce_dtype == \
            torch.bfloat16
        wrapped = sum(isinstance(m, CheckpointWrapper) for m in net.modules())
        assert wrapped == (SMALL.layers if checkpointing == "full" else 0)
    finally:
        dist.destroy_process_group()


WIDE_ARGS = ["--arch", "llama", "--layers", "2", "--hidden", "512", "--heads", "4", "--kv-heads", "2", "--ffn", "2048",
        "--vocab", "512", "--untied", "--ctx", "4", "--batch", "1", "--device", "cpu"]


def _traced_rank(stack: str, args: list[str]) -> dict:
    """``memplan trace --stack S --world-size 2 --sharding fsdp --json``: rank 0 of the library's own FSDP step
    under a fake process group, against the walk of that rank (collectives as NCCL's)."""
    done = CliRunner().invoke(app, ["trace", "--stack", stack, *args, "--world-size", "2", "--sharding", "fsdp",
                                    "--json"])
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    assert data["trace"]["rank"] == 0 and data["trace"]["analytic_stack"] == stack
    assert "fake process group" in data["trace"]["method"]
    return data


@pytest.mark.libs
def test_trace_takes_rank_0_of_torchtunes_fsdp_step_as_the_walk_does_with_nccl():
    """torchtune's recipes' shard_model on fake tensors: the walk (its default layout: tok_embeddings and output
    groups of their own) within the sharded trace's 0.1%; the fake process group allocates as NCCL does: gloo's
    reduce-scatter copy (``gloo_reduce_scatter_copy_bytes``), which a wide block with a small vocabulary peaks on,
    is not there."""
    pytest.importorskip("torchtune")
    from memplan.memory.peak import peak_memory_of_rank

    data = _traced_rank("torchtune", [*WIDE_ARGS, "--precision", "fp32"])
    traced = data["memory"]["peak_allocated"]
    assert abs(data["trace"]["analytic_error"]) <= 0.001, data["trace"]
    spec = ModelSpec(arch="llama", layers=2, hidden=512, heads=4, kv_heads=2, ffn=2048, vocab=512, tied=False)
    setup = TrainSetup(ctx=4, micro_batch=1, precision="fp32", world_size=2, sharding="fsdp")
    gloo = peak_memory_of_rank(spec, setup, 0, stack=stack_for("torchtune", cpu=True), collectives="gloo")
    assert gloo.peak_allocated > 1.02 * traced


@pytest.mark.libs
@pytest.mark.parametrize("args", [["--precision", "bf16", "--lora-rank", "4", "--checkpointing", "full"],
                                  ["--precision", "bf16-mixed"]], ids=["finetune_lora-fsdp2", "pretrain-fsdp1"])
def test_trace_takes_rank_0_of_litgpts_fsdp_step_as_the_walk_does(args):
    """litgpt's finetune_lora FSDP2 (its parallelize_fn) and its scripts' FSDP1 (FullyShardedDataParallel runs on
    fake tensors under the fake process group) on fake tensors: the walk within the sharded trace's 0.1%."""
    pytest.importorskip("litgpt")
    data = _traced_rank("litgpt", [*BASE[:-2], *args])
    assert abs(data["trace"]["analytic_error"]) <= 0.001, data["trace"]


SMALL = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=320, tied=False)
RANKS_TABLE = [  # (name, spec, setup): the configs of docs/commands/estimate.md's figures, two ranks each
    ("small fp32", SMALL, TrainSetup(ctx=128, micro_batch=4, precision="fp32")),
    ("small bf16-mixed", SMALL, TrainSetup(ctx=128, micro_batch=4, precision="bf16-mixed")),
    ("small bf16", SMALL, TrainSetup(ctx=128, micro_batch=4, precision="bf16")),
    ("small fp32, 2 micro-batches", SMALL, TrainSetup(ctx=128, micro_batch=4, precision="fp32", grad_accum=2)),
    ("small fp32, LoRA rank 4", SMALL, TrainSetup(ctx=128, micro_batch=4, precision="fp32", lora_rank=4)),
    ("heavy fp32", LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="fp32")),
    ("heavy bf16", LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="bf16")),
    ("heavy bf16-mixed", LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="bf16-mixed")),
    ("heavy fp32, 2 micro-batches", LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="fp32", grad_accum=2)),
    ("heavy bf16-mixed, 2 micro-batches, LoRA 8", LLAMA,
     TrainSetup(ctx=16, micro_batch=1, precision="bf16-mixed", grad_accum=2, lora_rank=8)),
]


FSDP_TABLE = [  # (name, spec, setup): torchtune's FSDP2 over two ranks (fp32, bf16, LoRA, checkpointing)
    ("small fp32", SMALL, TrainSetup(ctx=128, micro_batch=4, precision="fp32")),
    ("small bf16", SMALL, TrainSetup(ctx=128, micro_batch=4, precision="bf16")),
    ("small fp32, LoRA rank 4", SMALL, TrainSetup(ctx=128, micro_batch=4, precision="fp32", lora_rank=4)),
    ("small fp32, full checkpointing", SMALL, TrainSetup(ctx=128, micro_batch=4, precision="fp32",
                                                          checkpointing="full")),
    ("heavy fp32", LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="fp32")),
    ("heavy bf16", LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="bf16")),
    ("heavy bf16, LoRA 8, full checkpointing", LLAMA,
     TrainSetup(ctx=16, micro_batch=1, precision="bf16", lora_rank=8, checkpointing="full")),
    ("heavy fp32, 2 micro-batches", LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="fp32", grad_accum=2)),
]
TABLES = {"litgpt": ("ddp", RANKS_TABLE), "torchtune": ("fsdp", FSDP_TABLE)}
WIDE = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=8000, tied=False)
FSDP1_TABLE = [  # (name, spec, setup): litgpt's FSDP1 (Fabric's FSDPStrategy) over two ranks; full: finetune_full
    ("small fp32", SMALL, TrainSetup(ctx=128, micro_batch=4, precision="fp32")),
    ("small bf16", SMALL, TrainSetup(ctx=128, micro_batch=4, precision="bf16")),
    ("small bf16-mixed", SMALL, TrainSetup(ctx=128, micro_batch=4, precision="bf16-mixed")),
    ("small fp32, finetune_full", SMALL, TrainSetup(ctx=128, micro_batch=4, precision="fp32", checkpointing="full")),
    ("wide fp32", WIDE, TrainSetup(ctx=128, micro_batch=4, precision="fp32")),
    ("wide fp32, finetune_full", WIDE, TrainSetup(ctx=128, micro_batch=4, precision="fp32", checkpointing="full")),
    ("heavy fp32", LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="fp32")),
    ("heavy bf16", LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="bf16")),
    ("heavy bf16-mixed", LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="bf16-mixed")),
    ("heavy fp32, finetune_full", LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="fp32", checkpointing="full")),
    ("heavy bf16, finetune_full", LLAMA, TrainSetup(ctx=16, micro_batch=1, precision="bf16", checkpointing="full")),
    ("gpt_neox width 68 fp32", NEOX, TrainSetup(ctx=16, micro_batch=1, precision="fp32")),
    ("gpt_neox width 68 bf16", NEOX, TrainSetup(ctx=16, micro_batch=1, precision="bf16")),
    ("gpt_neox width 68 bf16-mixed, finetune_full", NEOX,
     TrainSetup(ctx=16, micro_batch=1, precision="bf16-mixed", checkpointing="full")),
]


def _fsdp1_table() -> None:
    """litgpt's FSDP1 step on two real gloo ranks against the walk (``FlatShard``, gloo) of each rank."""
    from memplan.memory.peak import peak_memory_of_rank
    from trainer.stacks import StackModel
    from trainer.stacks.ranks import measure_stack_ranks

    stack = stack_for("litgpt", cpu=True)
    for name, spec, one in FSDP1_TABLE:
        many = one.replace(world_size=2, sharding="fsdp")
        ranks = [m.peak_allocated for m in measure_stack_ranks("litgpt", StackModel(spec=spec), many)]
        walked = [peak_memory_of_rank(spec, many, r, stack=stack, collectives="gloo").peak_allocated for r in (0, 1)]
        print(f"{name:44s} " + "  ".join(f"rank {r}: ranks {m:>11,} walk {w:>11,} {(w - m) / m:+.2%}"
                                         for r, (m, w) in enumerate(zip(ranks, walked))), flush=True)


def _ranks_table(lib: str) -> None:
    """Each config on two real gloo ranks of ``lib``'s distributed step (litgpt: DDP; torchtune: FSDP2) against
    the walk (gloo); one device's real step against its walk, whose error the ranks' carry; and the ranks' peak
    over one device's (DDP's excess; FSDP2's saving, negative) measured and walked."""
    from trainer.stacks import StackModel, measure_stack
    from trainer.stacks.ranks import measure_stack_ranks

    sharding, table = TABLES[lib]
    stack = stack_for(lib, cpu=True)
    for name, spec, one in table:
        many = one.replace(world_size=2, sharding=sharding)
        ranks = max(m.peak_allocated for m in measure_stack_ranks(lib, StackModel(spec=spec), many))
        single = measure_stack(lib, StackModel(spec=spec), one).peak_allocated
        walked = peak_memory(spec, many, stack=stack, collectives="gloo").peak_allocated
        walked_one = peak_memory(spec, one, stack=stack).peak_allocated
        print(f"{name:42s} ranks {ranks:>11,} walk {walked:>11,} {(walked - ranks) / ranks:+.2%}   one device: "
              f"{(walked_one - single) / single:+.2%}; the ranks' excess over it: measured {ranks - single:,}, "
              f"walked {walked - walked_one:,}", flush=True)


LIT_FSDP_TABLE = [  # (name, spec, setup): litgpt finetune_lora's FSDP2 over two ranks (docs/commands/estimate.md)
    ("small fp32, LoRA rank 4", SMALL, LORA_FSDP.replace(ctx=128, micro_batch=4)),
    ("small bf16, LoRA rank 4", SMALL, LORA_FSDP.replace(ctx=128, micro_batch=4, precision="bf16")),
    ("small bf16-mixed, LoRA rank 4", SMALL, LORA_FSDP.replace(ctx=128, micro_batch=4, precision="bf16-mixed")),
    ("heavy fp32, LoRA rank 8", LLAMA, LORA_FSDP.replace(lora_rank=8)),
    ("heavy bf16, LoRA rank 8", LLAMA, LORA_FSDP.replace(lora_rank=8, precision="bf16")),
]


def _litgpt_fsdp_table() -> None:
    """Each config of ``LIT_FSDP_TABLE`` on two real gloo ranks of litgpt's model sharded by finetune_lora's
    ``parallelize_fn`` and its step, against the walk (gloo) of each rank."""
    from memplan.memory.peak import peak_memory_of_rank
    from trainer.stacks import StackModel
    from trainer.stacks.ranks import measure_stack_ranks

    stack = stack_for("litgpt", cpu=True)
    for name, spec, setup in LIT_FSDP_TABLE:
        for rank, m in enumerate(measure_stack_ranks("litgpt", StackModel(spec=spec), setup)):
            walked = peak_memory_of_rank(spec, setup, rank, stack=stack, collectives="gloo").peak_allocated
            print(f"{name:32s} rank {rank} ranks {m.peak_allocated:>11,} walk {walked:>11,} "
                  f"{(walked - m.peak_allocated) / m.peak_allocated:+.2%}", flush=True)


if __name__ == "__main__":  # the walk against two real ranks: python tests/walk/test_walk_libs_sharding.py litgpt
    import torch  # (litgpt-fsdp: litgpt's FSDP1 table, each rank)

    torch.set_num_threads(1)
    which = sys.argv[1] if len(sys.argv) > 1 else "litgpt"
    {"litgpt-fsdp": _fsdp1_table, "litgpt-lora-fsdp": _litgpt_fsdp_table}.get(which, lambda: _ranks_table(which))()

"""litgpt and torchtune over several devices: what ``--sharding`` each stack's walk follows.

litgpt under Fabric's DDP (``Fabric(strategy="ddp")``: ``DistributedDataParallel`` with PyTorch's defaults) keeps
its buckets beside ``.grad`` (``gradient_as_bucket_view=False``), as transformers' Trainer does; litgpt's own
FSDP layouts and torchtune's distributed recipes are refused in one line naming why. The walk against two real
gloo ranks of litgpt's DDP step is in tests/runs/test_walk_matrices.py (it spawns processes).
"""

from __future__ import annotations

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
    (["--stack", "litgpt", "--world-size", "2", "--sharding", "fsdp"],
     ["--sharding fsdp", "FSDP1 HYBRID_SHARD", "FSDP2 per Linear", "accepted: none, ddp"]),
    (["--stack", "torchtune", "--world-size", "2", "--sharding", "fsdp"],
     ["--sharding fsdp", "shard_model", "accepted: none"]),
    (["--stack", "torchtune", "--world-size", "2", "--sharding", "ddp"],
     ["--sharding ddp", "no DDP", "accepted: none"]),
])
def test_a_sharding_the_walk_does_not_follow_is_one_line_naming_why(args, needles):
    done = CliRunner().invoke(app, ["estimate", *BASE[:-2], "--precision", "bf16", *args])
    one_line_error(done, *needles)


def test_autotune_searches_ddp_for_litgpt_over_several_devices():
    h100 = load_profile("h100-sxm")
    assert search_axes(stack_for("litgpt"), h100, world_size=2)["sharding"] == ("ddp",)
    done = CliRunner().invoke(app, ["autotune", "--params", "22m", "--device", "h100-sxm", "--ctx", "1024",
                                    "--stack", "litgpt", "--world-size", "2", "--json"])
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    assert data["plan"]["sharding"] == "ddp" and data["plan"]["world_size"] == 2


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


def _ranks_table() -> None:
    """Each config on two real gloo ranks of litgpt's DDP step against the walk (gloo), and the ranks' excess over
    one device's real step against the walk's excess over its single-device walk."""
    from trainer.stacks import StackModel, measure_stack
    from trainer.stacks.ranks import measure_stack_ranks

    lit = stack_for("litgpt", cpu=True)
    for name, spec, one in RANKS_TABLE:
        ddp = one.replace(world_size=2, sharding="ddp")
        ranks = max(m.peak_allocated for m in measure_stack_ranks("litgpt", StackModel(spec=spec), ddp))
        single = measure_stack("litgpt", StackModel(spec=spec), one).peak_allocated
        walked = peak_memory(spec, ddp, stack=lit, collectives="gloo").peak_allocated
        walked_one = peak_memory(spec, one, stack=lit).peak_allocated
        print(f"{name:42s} ranks {ranks:>11,} walk {walked:>11,} {(walked - ranks) / ranks:+.2%}   DDP's excess: "
              f"measured {ranks - single:,}, walked {walked - walked_one:,}", flush=True)


if __name__ == "__main__":  # the walk against two real ranks: python tests/walk/test_walk_libs_sharding.py
    import torch

    torch.set_num_threads(1)
    _ranks_table()

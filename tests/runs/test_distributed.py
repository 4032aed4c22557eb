"""Beyond one device: DDP and FSDP2 training on gloo, per-rank memory, communication time.

The training tests launch 2 ranks on this CPU (gloo) as the product does (`memplan train --nproc 2`, or
RUN/launch.json written through the library and `torchrun --nproc-per-node 2 -m trainer RUN`) with a tiny
model and compare its loss curve with one process training the same global batch.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memplan import comm
from memplan import memory as m
from memplan.errors import InputError
from memplan.hardware import load_profile
from memplan.model import ModelSpec
from memplan.setup import TrainSetup

pytestmark = pytest.mark.distributed

LLAMA = ModelSpec(arch="llama", layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=512, tied=True)
GPT2 = ModelSpec(arch="gpt2", layers=3, hidden=96, heads=3, kv_heads=3, ffn=200, vocab=1001, tied=False,
                 max_positions=64)
SETUP = TrainSetup(ctx=64, micro_batch=2, precision="fp32")
ROOT = Path(__file__).resolve().parents[2]


def sharded(setup: TrainSetup, world_size: int, sharding: str) -> TrainSetup:
    return setup.replace(world_size=world_size, sharding=sharding)


# ---- DDP memory --------------------------------------------------------------------------------

def test_ddp_holds_every_gradient_in_its_buckets_for_the_whole_step():
    ddp = sharded(SETUP, 2, "ddp")
    assert m.ddp_bucket_bytes(LLAMA, ddp) == LLAMA.params * 4
    walk = m.peak_memory(LLAMA, ddp)
    start = {mark.name: mark for mark in walk.moments}["start of forward"]
    assert start.bytes["gradients"] == LLAMA.params * 4  # before the first op of the step
    single = m.peak_memory(LLAMA, SETUP)
    assert walk.peak_allocated > single.peak_allocated
    # DDP's step is the step with accumulation's gradient handling: new gradients are added into .grad
    accum = m.peak_memory(LLAMA, SETUP.replace(grad_accum=2))
    assert walk.peak_allocated == accum.peak_allocated - m.input_bytes(LLAMA, SETUP)


def test_ddp_under_lora_buckets_and_all_reduces_the_adapters_gradients_only():
    # DDP's Reducer buckets only the parameters that require a gradient: the frozen base has none. Two real
    # gloo ranks of the 2-layer model below held 139,264 B of gradients (the adapters') where the walk had
    # counted the whole model's 3,803,648 (a +27% peak)
    lora = sharded(SETUP.replace(lora_rank=8), 2, "ddp")
    adapters = m.lora_params(LLAMA, lora) * 4
    assert m.ddp_bucket_bytes(LLAMA, lora) == adapters < LLAMA.params * 4
    start = {mark.name: mark for mark in m.peak_memory(LLAMA, lora).moments}["start of forward"]
    assert start.bytes["gradients"] == adapters
    assert sum(c.nbytes * c.count for c in comm.step_collectives(LLAMA, lora)) == adapters


def test_every_ddp_rank_is_alike_and_world_size_does_not_change_it():
    two, eight = m.peak_memory(LLAMA, sharded(SETUP, 2, "ddp")), m.peak_memory(LLAMA, sharded(SETUP, 8, "ddp"))
    assert two.to_json() == eight.to_json()
    assert m.peak_memory_of_rank(LLAMA, sharded(SETUP, 2, "ddp"), 1).to_json() == two.to_json()


# ---- FSDP memory -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [LLAMA, GPT2, LLAMA.replace(tied=False), ModelSpec(arch="gpt_neox", layers=2, hidden=64,
                                                                                     heads=4, kv_heads=4, ffn=256,
                                                                                     vocab=300, tied=False)])
def test_parameter_shapes_are_the_reference_models_and_add_up_to_the_parameter_count(spec):
    import torch

    from trainer.model import build_model

    shapes = m.param_shapes(spec)
    assert spec.layers * sum(r * c for r, c in shapes["block"]) + sum(r * c for r, c in shapes["root"]) == spec.params
    model = build_model(spec, device="meta")
    block = [tuple(p.shape) + (1,) * (2 - p.dim()) for p in model.blocks[0].parameters()]
    assert block == shapes["block"]
    root = [tuple(p.shape) + (1,) * (2 - p.dim()) for n, p in model.named_parameters() if not n.startswith("blocks.")]
    assert root == shapes["root"]
    assert isinstance(model.embed.weight, torch.nn.Parameter)


def test_shards_split_rows_as_torch_chunk_does():
    import torch

    for rows in (1, 5, 7, 8, 1001):
        for world in (2, 3, 4, 8):
            chunks = [len(c) for c in torch.arange(rows).chunk(world)]
            chunks += [0] * (world - len(chunks))
            assert [m.shard_rows(rows, world, r) for r in range(world)] == chunks
    assert m.padded_shard_numel([(5, 3), (4, 1)], 4) == 2 * 3 + 1 * 1


def test_fsdp_shards_weights_gradients_and_optimizer_states():
    fsdp = sharded(SETUP, 2, "fsdp")
    n = LLAMA.params  # every tensor's rows divide by 2
    assert m.fsdp_sharded_weight_bytes(LLAMA, fsdp) == n * 4 // 2
    assert m.fsdp_all_sharded_grad_bytes(LLAMA, fsdp) == n * 4 // 2
    assert m.fsdp_optimizer_state_bytes(LLAMA, fsdp) == 2 * n * 4 // 2 + LLAMA.n_tensors * 4
    # uneven rows: every rank stores the padded shard, the optimizer state only its own rows
    uneven = sharded(SETUP, 3, "fsdp")
    padded = m.fsdp_sharded_weight_bytes(GPT2, uneven)
    assert padded > GPT2.params * 4 / 3
    states = [m.fsdp_optimizer_state_bytes(GPT2, uneven.replace(optimizer="sgd"), r) for r in range(3)]
    assert sum(states) == GPT2.params * 4 and states[0] >= states[1] >= states[2]


def test_fsdp_mixed_precision_gathers_bf16_and_reduces_fp32():
    mixed = sharded(SETUP.replace(precision="bf16-mixed"), 4, "fsdp")
    block = m.fsdp_group_numel(LLAMA, mixed, "block")
    assert m.fsdp_unsharded_bytes(LLAMA, mixed, "block") == 4 * block * 2
    assert m.fsdp_copy_in_bytes(LLAMA, mixed, "block") == block * 2
    assert m.fsdp_reduce_scatter_input_bytes(LLAMA, mixed, "block") == 4 * block * 4
    assert m.fsdp_copy_in_bytes(LLAMA, sharded(SETUP, 4, "fsdp"), "block") == 0  # fp32: the shard itself is sent
    assert m.gloo_reduce_scatter_copy_bytes(LLAMA, mixed, "block", "nccl") == 0
    assert m.gloo_reduce_scatter_copy_bytes(LLAMA, mixed, "block", "gloo") == 4 * block * 4


def test_fsdp_per_device_memory_falls_with_more_devices_and_rank_zero_holds_the_most():
    big = ModelSpec(arch="llama", layers=8, hidden=1024, heads=8, kv_heads=8, ffn=2816, vocab=32000, tied=True)
    setup = TrainSetup(ctx=512, micro_batch=1, precision="bf16-mixed")
    peaks = [m.peak_memory(big, sharded(setup, w, "fsdp")).peak_allocated for w in (2, 4, 8)]
    assert peaks[0] > peaks[1] > peaks[2]
    assert peaks[0] < m.peak_memory(big, setup).peak_allocated
    gpt = sharded(SETUP, 3, "fsdp")
    ranks = [m.peak_memory_of_rank(GPT2, gpt, r).peak_allocated for r in range(3)]
    assert ranks[0] == max(ranks) == m.peak_memory(GPT2, gpt).peak_allocated


def test_the_fsdp_walk_matches_the_exact_trace_of_a_rank():
    """FakeTensor trace of the last rank (uneven shards) of a 3-way FSDP2 step, the others a fake
    process group: the walk names every tensor FSDP2 allocates (within 0.1%)."""
    from trainer.distributed import trace_rank_step

    setup = sharded(SETUP.replace(precision="bf16-mixed", checkpointing="selective", grad_accum=2), 3, "fsdp")
    traced = trace_rank_step(GPT2, setup, rank=2)
    predicted = m.peak_memory_of_rank(GPT2, setup, 2, collectives="nccl")
    assert abs(predicted.peak_allocated - traced.peak_allocated) <= 0.001 * traced.peak_allocated


def test_unknown_collectives_and_fsdp_with_8bit_adam_are_refused():
    with pytest.raises(ValueError):
        m.peak_memory(LLAMA, SETUP, collectives="mpi")
    with pytest.raises(InputError, match="adamw8bit does not run under --sharding fsdp"):
        sharded(SETUP.replace(optimizer="adamw8bit"), 2, "fsdp")


# ---- communication -----------------------------------------------------------------------------

def test_ring_collectives_by_hand():
    link = comm.Link(kind="test", bandwidth_bytes_per_second=100e9, latency_seconds=1e-5)
    assert comm.all_reduce_seconds(8e9, 8, link) == pytest.approx(2 * 7 / 8 * 0.08 + 14e-5)
    assert comm.all_gather_seconds(8e9, 4, link) == pytest.approx(3 / 4 * 0.08 + 3e-5)
    assert comm.reduce_scatter_seconds(8e9, 4, link) == comm.all_gather_seconds(8e9, 4, link)
    assert comm.all_reduce_seconds(8e9, 1, link) == 0.0


def test_links_come_from_the_profiles_and_mi300x_scales_with_its_peers():
    h100 = comm.link_of(load_profile("h100-sxm"), 8)
    assert h100.bandwidth_bytes_per_second == 450e9 and h100.kind == "nvlink4" and "nccl" in h100.source
    mi = load_profile("mi300x")
    assert comm.link_of(mi, 2).bandwidth_bytes_per_second == 64e9
    assert comm.link_of(mi, 8).bandwidth_bytes_per_second == 448e9
    with pytest.raises(InputError, match="no \\[interconnect\\]"):
        comm.link_of(mi.replace(interconnect={}), 2)


def test_a_step_communicates_what_ddp_and_fsdp_move():
    setup = SETUP.replace(precision="bf16-mixed", grad_accum=3)
    ddp = comm.step_collectives(LLAMA, sharded(setup, 4, "ddp"))
    assert sum(c.nbytes * c.count for c in ddp) == LLAMA.params * 4  # all gradients, once per step
    assert all(c.op == "all-reduce" for c in ddp)
    fsdp = comm.step_collectives(LLAMA, sharded(setup, 4, "fsdp"))
    moved = {op: sum(c.nbytes * c.count for c in fsdp if c.op == op) for op in ("all-gather", "reduce-scatter")}
    n = LLAMA.params  # divisible by 4: no padding
    # per micro-batch: root + every block gathered for forward, blocks again for backward, in bf16
    assert moved["all-gather"] == 3 * (2 * n - (n - LLAMA.layers * LLAMA.layer_params)) * 2
    assert moved["reduce-scatter"] == 3 * n * 4  # fp32 gradients, every micro-batch
    assert comm.step_collectives(LLAMA, SETUP) == []
    assert comm.ddp_buckets(60 * comm.MIB) == [comm.MIB, 25 * comm.MIB, 25 * comm.MIB, 9 * comm.MIB]


def test_overlap_hides_communication_behind_the_backward_on_gpus_only():
    spec = ModelSpec(arch="llama", layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=32000, tied=True)
    setup = sharded(TrainSetup(ctx=2048, micro_batch=4), 8, "fsdp")
    h100 = load_profile("h100-sxm")
    c = comm.communication(spec, setup, h100, forward_seconds=1.0, backward_seconds=2.0)
    assert c.overlapped and 0 < c.exposed_seconds < c.total_seconds
    bare = comm.communication(spec, setup, h100, forward_seconds=0.0, backward_seconds=0.0)
    assert bare.exposed_seconds == pytest.approx(bare.total_seconds)
    cpu = comm.communication(spec, setup, load_profile("cpu"), forward_seconds=1.0, backward_seconds=2.0)
    assert not cpu.overlapped and cpu.exposed_seconds == cpu.total_seconds
    assert cpu.total_seconds > 100 * c.total_seconds  # 1 Gbit/s Ethernet against NVLink 4


# ---- command line ------------------------------------------------------------------------------

def test_estimate_plans_per_device_memory_for_sharded_runs(memplan_cli):
    base = ["estimate", "--params", "1b", "--ctx", "2048", "--device", "h100-sxm", "--json"]
    single = json.loads(memplan_cli(*base).stdout)
    fsdp = json.loads(memplan_cli(*base, "--world-size", "8", "--sharding", "fsdp").stdout)
    ddp = json.loads(memplan_cli(*base, "--world-size", "8", "--sharding", "ddp").stdout)
    assert fsdp["setup"]["world_size"] == 8 and fsdp["setup"]["sharding"] == "fsdp"
    assert fsdp["memory"]["optimizer"] < single["memory"]["optimizer"] / 7
    assert fsdp["memory"]["peak_allocated"] < single["memory"]["peak_allocated"] < ddp["memory"]["peak_allocated"]
    assert fsdp["max_micro_batch"] > single["max_micro_batch"]
    bad = memplan_cli("estimate", "--params", "22m", "--world-size", "2")
    assert bad.returncode == 2 and "needs --sharding ddp or fsdp" in bad.stderr
    bad = memplan_cli("trace", "--params", "22m", "--world-size", "2", "--sharding", "ddp")
    assert bad.returncode == 2 and "DDP's C++ reducer cannot run on fake tensors" in bad.stderr


def test_estimate_adds_the_exposed_communication_to_the_step_and_shows_the_collectives(memplan_cli):
    base = ["estimate", "--params", "125m", "--ctx", "1024", "--json", "--world-size", "8", "--sharding"]
    for device, sharding in (("h100-sxm", "fsdp"), ("h100-sxm", "ddp"), ("cpu", "ddp")):
        data = json.loads(memplan_cli(*base, sharding, "--device", device).stdout)
        t, c = data["time"], data["time"]["communication"]
        assert c["total_seconds"] == pytest.approx(sum(c["collectives"].values()))
        assert t["breakdown"]["communication"]["seconds"] == pytest.approx(c["exposed_seconds"])
        assert t["step_seconds"] == pytest.approx(sum(x["seconds"] for x in t["breakdown"].values()))
        if device == "cpu":  # gloo: nothing hidden
            assert not c["overlapped"] and c["exposed_seconds"] == c["total_seconds"]
        else:  # NVLink, hidden behind the backward but for what nothing precedes or follows
            assert c["overlapped"] and 0 < c["exposed_seconds"] < c["total_seconds"]
            assert c["link"]["kind"] == "nvlink4"
        names = set(c["collectives"])
        assert (any(n.startswith("all-reduce") for n in names) if sharding == "ddp" else
                any(n.startswith("all-gather") for n in names) and any(n.startswith("reduce-scatter") for n in names))
    single = json.loads(memplan_cli("estimate", "--params", "125m", "--ctx", "1024", "--json").stdout)
    assert "communication" not in single["time"] and single["time"]["breakdown"]["communication"]["seconds"] == 0


def test_validate_world_size_2_measures_every_rank_within_the_bars(memplan_cli):
    result = memplan_cli("validate", "--world-size", "2", "--quick", "--json", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    from memplan.validate import load_matrix

    quick = [c for c in load_matrix("distributed") if c.quick]
    assert len(data["rows"]) == 2 * len(quick)
    assert {r["setup"]["sharding"] for r in data["rows"]} == {"ddp", "fsdp"}
    assert sorted(r["rank"] for r in data["rows"]) == sorted([0, 1] * len(quick))
    assert data["median_abs_error"] <= 0.03 and data["max_abs_error"] <= 0.10
    for row in data["rows"]:
        for term in ("weights", "gradients", "optimizer"):  # read off the rank's own tensors
            assert row["predicted_terms"][term] == row["measured_terms"][term], (row["name"], term)


# ---- training ----------------------------------------------------------------------------------

STEPS = 20
MODEL = ["--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
         "--ctx", "32", "--precision", "fp32", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A prepared corpus of 400 short documents, a 320-token BPE."""
    import random

    from trainer.data import PrepareConfig, prepare, resolve_inputs

    root = tmp_path_factory.mktemp("dist-corpus")
    rng = random.Random(0)
    words = ("the model trains on tokens while the planner predicts memory for each step and the ranks share "
             "every batch of windows").split()
    with open(root / "docs.jsonl", "w") as f:
        for i in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))
                                + f" document {i}."}) + "\n")
    prepare(resolve_inputs([str(root / "docs.jsonl")]), root / "data", PrepareConfig(tokenizer="bpe:320", workers=1))
    return root / "data"


def launch(*args: str, nproc: int = 2, via: str = "torchrun") -> subprocess.Popen:
    """Start (not wait for) a 2-process run, in a session of its own (killable as a group): `memplan train --nproc
    N ARGS` (via="memplan"), or `torchrun --standalone --nproc-per-node N -m trainer RUN` (ARGS: the run directory
    alone, whose launch.json ``prepare`` wrote), as a user who launches torchrun themselves does."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    if via == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "trainer", *args]
    else:
        cmd = [sys.executable, "-m", "memplan", "train", "--nproc", str(nproc), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)


def prepare(run: Path, corpus: Path, *, nproc: int, sharding: str, max_steps: int, save_every: int) -> Path:
    """RUN/launch.json of MODEL and QUIET's run for ``nproc`` processes, resolved and written through the library
    as `memplan train --nproc N` does before it starts the ranks (``trainer.launch.prepare_train``); returns RUN."""
    from memplan.cli.options import CheckFlags, LimitFlags, run_control_from
    from memplan.planning import SetupAsked
    from trainer.launch import prepare_train
    from trainer.train_run import TrainRequest, TrainUI

    request = TrainRequest(
        data=str(corpus), out=str(run), model=dict(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128),
        setup=SetupAsked(ctx=32, precision="fp32", batch=2, grad_accum=1),
        control=run_control_from(LimitFlags(max_steps=str(max_steps), save_every=str(save_every), eval_every="10"),
                                 CheckFlags(sample_tokens="0", eval_batches="1")),
        hyper=dict(lr=3e-3, warmup_steps=None, min_lr_ratio=None, weight_decay=None, clip=None, seed=0),
        sharding=sharding, nproc=nproc)
    run_dir, _ = prepare_train(request, TrainUI(), [])
    return run_dir


def train_here(*args: str) -> tuple[int, str]:
    """`memplan train ARGS` in this process (one process, no process group): its exit code and its stderr."""
    import torch
    from typer.testing import CliRunner

    from memplan.cli import app

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun sets each rank: tiny models, and cores shared with other work
    try:
        result = CliRunner().invoke(app, ["train", *args])
    finally:
        torch.set_num_threads(threads)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.stderr


def losses(run_dir) -> dict[int, float]:
    """Step → loss of the run as it stands (a resumed run's steps from the resume on)."""
    from trainer.rundir import read_metrics

    return {row["step"]: row["loss"] for row in read_metrics(run_dir, latest=True) if row.get("kind") == "train"}


def events(run_dir, name: str) -> list[dict]:
    return [row for row in map(json.loads, open(run_dir / "metrics.jsonl")) if row.get("event") == name]


QUIET = ["--sample-tokens", "0", "--eval-batches", "1", "--eval-every", "10", "--seed", "0"]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """One process, the global batch of the 2-rank runs: 2 micro-batches of 2 windows per step; a
    checkpoint at step 10."""
    run = tmp_path_factory.mktemp("single") / "run"
    code, err = train_here("--data", str(corpus), "--out", str(run), *MODEL, *QUIET, "--batch", "2", "--grad-accum", "2",
                           "--max-steps", str(STEPS), "--save-every", "10")
    assert code == 0, err[-3000:]
    return run


@pytest.fixture(scope="module")
def two_ranks(corpus, tmp_path_factory):
    """DDP through `torchrun -m trainer RUN` (RUN/launch.json written through the library), FSDP2 through `memplan
    train --nproc 2` (side by side), each rank a micro-batch of 2 windows per step; checkpoints every 10 steps.
    Returns (run, stdout, stderr)."""
    runs, launched = {}, {}
    runs["ddp"] = prepare(tmp_path_factory.mktemp("ddp") / "run", corpus, nproc=2, sharding="ddp", max_steps=STEPS,
                          save_every=10)
    launched["ddp"] = launch(str(runs["ddp"]), via="torchrun")
    runs["fsdp"] = tmp_path_factory.mktemp("fsdp") / "run"
    launched["fsdp"] = launch("--data", str(corpus), "--out", str(runs["fsdp"]), *MODEL, *QUIET, "--batch", "2",
                              "--grad-accum", "1", "--sharding", "fsdp", "--max-steps", str(STEPS),
                              "--save-every", "10", via="memplan")
    out = {}
    for sharding, proc in launched.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        out[sharding] = (runs[sharding], stdout, stderr)
    return out


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_ranks_follow_the_single_process_loss_curve(two_ranks, reference, sharding):
    run, stdout, stderr = two_ranks[sharding]
    curve, single = losses(run), losses(reference)
    assert sorted(curve) == list(range(1, STEPS + 1))
    assert single[STEPS] < single[1] - 0.5  # it learns
    for step in curve:
        assert curve[step] == pytest.approx(single[step], abs=1e-3), step
    (start,) = events(run, "start")
    assert start["setup"]["world_size"] == 2 and start["setup"]["sharding"] == sharding
    assert start["tokens_per_step"] == 2 * 2 * 32  # the single process's global batch
    assert "world_size = 2" in (run / "plan.toml").read_text()
    # rank 0 alone prints: one plan, one summary
    assert stderr.count("Training ") == 1 and stdout.count("Done: 20 steps") == 1


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_a_distributed_checkpoint_holds_every_ranks_shards_and_the_whole_weights(two_ranks, reference, sharding):
    from trainer import checkpoint_format as ckpt

    run = two_ranks[sharding][0]
    path = run / "checkpoints" / "step-00000010"
    assert sorted(p.name for p in (path / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    meta = ckpt.verify_checkpoint(path)  # every file, the shards too, listed with its sha256
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "model.safetensors"} <= set(meta["files"])
    assert meta["distributed"] == {"world_size": 2, "sharding": sharding, "sharded": "dcp"}
    # rank 0 gathered the whole model: the same weights as the single process's at the same step
    mine = ckpt.read_weights(path / ckpt.MODEL_FILE)
    single = ckpt.read_weights(reference / "checkpoints" / "step-00000010" / ckpt.MODEL_FILE)
    assert mine.keys() == single.keys()
    for name in mine:
        assert (mine[name] - single[name]).abs().max() < 1e-4, name
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # nothing left behind


def test_saved_by_two_ranks_resumed_by_one(corpus, reference, two_ranks, tmp_path):
    """The FSDP run's step-10 checkpoint (sharded over 2 ranks) continued in one process."""
    run = tmp_path / "run"
    shutil.copytree(two_ranks["fsdp"][0], run)
    shutil.rmtree(run / "checkpoints" / "step-00000020")
    code, err = train_here("--data", str(corpus), "--out", str(run), "--resume", "--max-steps", str(STEPS))
    assert code == 0, err[-3000:]
    (resume,) = events(run, "resume")
    assert resume["step"] == 10 and resume["checkpoint"] == str(run / "checkpoints" / "step-00000010")
    assert resume["setup"]["world_size"] == 1 and resume["setup"]["grad_accum"] == 2  # the same global batch
    curve, single = losses(run), losses(reference)
    assert sorted(curve) == list(range(1, STEPS + 1))
    for step in range(11, STEPS + 1):
        assert curve[step] == pytest.approx(single[step], abs=1e-3), step
    assert "grad_accum = 2" in (run / "plan.toml").read_text() and "world_size = 1" in (run / "plan.toml").read_text()


def test_saved_by_one_process_resumed_by_two_then_killed_mid_save(corpus, reference, tmp_path):
    """The single process's step-10 checkpoint continued by 2 FSDP2 ranks (rank 0 reads it, the ranks
    keep their shards), saving every step; the launcher and both ranks are killed (SIGKILL) while a
    checkpoint is being written. The newest complete checkpoint verifies and one process resumes
    from it; the half-written one is never taken for a checkpoint and is cleaned away."""
    import signal
    import time

    import psutil

    from trainer import checkpoint_format as ckpt

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints" / "step-00000020")
    proc = launch("--data", str(corpus), "--out", str(run), "--resume", "--max-steps", str(STEPS), "--save-every",
                  "1", "--sharding", "fsdp", via="memplan")
    checkpoints, caught = run / "checkpoints", None
    deadline = time.monotonic() + 300
    while caught is None and proc.poll() is None and time.monotonic() < deadline:
        if (checkpoints / "step-00000012").is_dir():  # two saved by the ranks: catch the next one being written
            caught = next((p for p in checkpoints.iterdir() if p.name.startswith(".tmp-")), None)
        time.sleep(0.005)
    for process in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        process.send_signal(signal.SIGKILL)  # the launcher and every rank (each in a session of its own)
    _, stderr = proc.communicate()
    assert caught is not None, f"no save was caught in progress: {stderr[-3000:]}"

    lines = [json.loads(x) for x in open(run / "metrics.jsonl") if x.strip()]
    (resume,) = [x for x in lines if x.get("event") == "resume"]
    assert resume["setup"]["world_size"] == 2 and resume["setup"]["grad_accum"] == 1  # the same global batch
    resumed = {x["step"]: x["loss"] for x in lines[lines.index(resume):] if x.get("kind") == "train"}
    single = losses(reference)
    assert len(resumed) >= 2
    for step, loss in resumed.items():
        assert loss == pytest.approx(single[step], abs=1e-3), step

    ref = ckpt.latest_checkpoint(checkpoints)
    assert ref.step >= 12 and (ref.path / "dcp" / ".metadata").is_file()
    ckpt.verify_checkpoint(ref.path)
    code, err = train_here("--data", str(corpus), "--out", str(run), "--resume", "--max-steps", str(ref.step + 1))
    assert code == 0, err[-3000:]
    assert ckpt.latest_checkpoint(checkpoints).step == ref.step + 1
    assert losses(run)[ref.step + 1] == pytest.approx(single[ref.step + 1], abs=1e-3)
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".")]  # the leftovers were cleaned


def test_ranks_read_disjoint_windows_that_make_up_the_single_process_batch(corpus):
    import torch

    from trainer.data import PreparedData, TrainStream

    data = PreparedData(corpus)
    ranks = [TrainStream(data, batch=2, ctx=32, seed=3, rank=r, world_size=2) for r in range(2)]
    single = TrainStream(data, batch=4, ctx=32, seed=3)
    for _ in range(30):
        (x0, y0), (x1, y1), (x, y) = next(ranks[0]), next(ranks[1]), next(single)
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        assert not any(torch.equal(a, b) for a in x0 for b in x1)


def test_a_plan_for_two_devices_is_refused_in_one_process(corpus, tmp_path):
    from memplan.plan import Plan

    plan = tmp_path / "plan.toml"
    Plan(model=LLAMA.replace(vocab=320), setup=sharded(SETUP, 2, "ddp")).save(plan)
    code, err = train_here("--data", str(corpus), "--out", str(tmp_path / "run"), "--plan", str(plan))
    assert code == 2
    err = err.strip().splitlines()
    assert err[-1] == ("memplan: error: the plan is for --world-size 2 but 1 process(es) run it; launch "
                       "it with `memplan train --nproc 2` (torchrun)")
    assert sum("error" in line for line in err) == 1
    assert not (tmp_path / "run").exists()


def test_bad_distributed_options_are_one_line_errors(corpus, tmp_path):
    from typer.testing import CliRunner

    from memplan.cli import app
    from memplan.plan import Plan

    plan = tmp_path / "plan.toml"
    Plan(model=LLAMA.replace(vocab=320), setup=sharded(SETUP, 3, "ddp")).save(plan)
    out = str(tmp_path / "run")
    for args, message in [
        (["--nproc", "2", "--plan", str(plan)], "the plan is for --world-size 3; launch it with `memplan train "
                                                "--nproc 3`"),
        (["--nproc", "2", "--sharding", "zero"], "--sharding: 'zero' (accepted: ddp, fsdp;"),
        (["--sharding", "fsdp", *MODEL], "--sharding fsdp: needs several processes; add --nproc N"),
        (["--nproc", "0", *MODEL], "--nproc"),
    ]:
        result = CliRunner().invoke(app, ["train", "--data", str(corpus), "--out", out, *args])
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert result.stderr.startswith("memplan: error: " + message), result.stderr
    assert not (tmp_path / "run").exists()


# ---- autotune over several devices -------------------------------------------------------------

def test_autotune_tries_ddp_and_fsdp_over_the_devices_given():
    from memplan.autotune import autotune
    from memplan.model import from_size

    result = autotune(from_size("7b"), load_profile("rtx-4090"), ctx=2048, world_size=8)
    assert result.space["sharding"] == ["ddp", "fsdp"]
    plan = result.plan.setup
    assert plan.world_size == 8 and plan.sharding == "fsdp"
    assert "FSDP is needed to fit" in result.chosen.why
    assert not any(c.fits for c in result.candidates if c.setup.sharding == "ddp")  # 7B does not fit one 4090
    assert result.to_json()["plan"]["sharding"] == "fsdp" and result.to_json()["plan"]["world_size"] == 8
    single = autotune(from_size("7b"), load_profile("rtx-4090"), ctx=2048)
    assert single.space["sharding"] == ["none"] and single.plan is None


def test_autotune_says_when_more_devices_are_the_only_way_and_how_many():
    from memplan.autotune import autotune, fsdp_devices_needed, precision_candidates
    from memplan.estimate import memory_on
    from memplan.model import from_size

    spec, gtx = from_size("3b"), load_profile("gtx-1650")
    result = autotune(spec, gtx, ctx=512, global_batch=8)
    assert result.plan is None
    line = next(a for a in result.advice if a.startswith("more devices"))
    assert "the only way to fit this model at this context" in line
    k = int(line.split("--world-size ")[1].split()[0])
    needed, setup, mem = fsdp_devices_needed(spec, gtx, 512, 8, precision_candidates(gtx), result.limit_bytes)
    assert needed == k and setup.sharding == "fsdp" and mem.peak_reserved <= result.limit_bytes
    fewer = setup.replace(world_size=k - 1, grad_accum=max(1, round(8 / (k - 1))))
    assert memory_on(spec, fewer, gtx).peak_reserved > result.limit_bytes  # one device fewer does not fit
    again = autotune(spec, gtx, ctx=512, global_batch=k, world_size=k)  # one sequence per device, as advised
    assert again.plan is not None and again.plan.setup.sharding == "fsdp"

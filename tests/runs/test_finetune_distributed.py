"""A finetune in 2 processes over gloo: `memplan finetune --nproc 2` (the finetune resolved once into RUN/launch.json,
then torchrun, `python -m trainer RUN` in each rank), and the trainer's API with the finetune's factories in 2
spawned ranks.

Every rank holds the base run's weights and the same LoRA adapters (DDP), only the adapters train, rank 0 writes the
run. Two ranks with a micro-batch of 2 rows read what one process reads with 2 micro-batches of 2 rows, so their
loss curve and weights are the single process's (as tests/runs/test_distributed.py checks for `memplan train`).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runs_helper import tiny_corpus, tiny_run  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
QUIET = ["--sample-tokens", "0", "--eval-batches", "1", "--eval-every", str(STEPS), "--save-every", str(STEPS),
         "--seed", "0", "--lr", "1e-2"]


def write_sft(path: Path, n: int = 40) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Which animal is number {i}?",
                                "response": f"The {['cat', 'dog', 'owl', 'fox'][i % 4]} is number {i}."}) + "\n")
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft-dist")
    return tiny_run(root / "run", tiny_corpus(root), steps=10), write_sft(root / "sft.jsonl")


def finetune_here(*args: str):
    """`memplan finetune ARGS` in this process (one process)."""
    import torch
    from typer.testing import CliRunner

    from memplan.cli import app

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun sets each rank
    try:
        return CliRunner().invoke(app, ["finetune", *args, "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)


def finetune_in_two(*args: str) -> subprocess.CompletedProcess:
    """`memplan finetune --nproc 2 ARGS` (torchrun over gloo on this CPU)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "memplan", "finetune", "--nproc", "2", *args, "--device", "cpu"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def losses(run: Path) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if line.get("kind") == "train"}


def weights(run: Path, step: int = STEPS) -> dict:
    from trainer import checkpoint_format as ckpt

    return ckpt.read_weights(run / "checkpoints" / f"step-{step:08d}" / ckpt.MODEL_FILE)


def base_weights(run: Path) -> dict:
    from trainer import checkpoint_format as ckpt

    return ckpt.read_weights(ckpt.latest_checkpoint(run / "checkpoints").path / ckpt.MODEL_FILE)


def test_nproc_resolves_the_finetune_once_and_each_rank_reads_it_from_the_run_directory(base, tmp_path, monkeypatch,
                                                                                       capsys):
    """The launcher resolves (its plan made for 2 processes) and writes launch.json with kind finetune; torchrun
    gets the run directory alone; a rank reads the file, and refuses a tampered one in one line."""
    import torch.distributed.run

    from trainer.__main__ import entry
    from trainer.finetune_run import read_launch_file

    run, sft = base
    calls = []
    monkeypatch.setattr(torch.distributed.run, "run", calls.append)
    monkeypatch.setenv("MEMPLAN_LAUNCHED_BY", "")
    out = tmp_path / "ft"
    r = finetune_here("--nproc", "2", "--run", str(run), "--data", str(sft), "--out", str(out), "--lora-rank", "4",
                      "--batch", "2", "--max-steps", "2", *QUIET)
    assert r.exit_code == 0, r.output
    (args,) = calls
    assert args.module and args.training_script == "trainer" and args.training_script_args == [str(out)]
    launch = read_launch_file(out)
    assert launch.plan["setup"]["world_size"] == 2 and launch.plan["setup"]["lora_rank"] == 4
    assert launch.request.run == str(run) and launch.request.control["max_steps"] == 2 and launch.request.nproc == 2
    assert sorted(p.name for p in out.iterdir()) == ["launch.json"]  # the ranks write the rest
    # one process given the run: the plan is for 2, so it is refused as the plan says, before anything is written
    monkeypatch.delenv("MEMPLAN_LAUNCHED_BY")
    with pytest.raises(SystemExit) as e:
        entry([str(out)])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "python -m trainer: error: the plan is for --world-size 2 but 1 process(es) run it; launch it with "
        "`memplan finetune --nproc 2` (torchrun)"]
    tampered = json.loads((out / "launch.json").read_text())
    tampered["request"]["lora_rank"] = "four"
    (out / "launch.json").write_text(json.dumps(tampered))
    with pytest.raises(SystemExit) as e:
        entry([str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "'lora_rank'" in err[0] and "four" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["launch.json"]


@pytest.mark.parametrize("lora", [4, 0])
def test_two_ranks_finetune_as_one_process_does(base, tmp_path, lora):
    """LoRA: the adapters train, identically to one process's, on top of the base weights, which stay as the
    base run has them. A full finetune (--lora-rank 0): every weight trains, as one process's."""
    import torch

    run, sft = base
    common = ["--run", str(run), "--data", str(sft), "--lora-rank", str(lora), "--max-steps", str(STEPS), *QUIET]
    single = tmp_path / "single"
    result = finetune_here(*common, "--out", str(single), "--batch", "2", "--grad-accum", "2")
    assert result.exit_code == 0, result.output
    two = tmp_path / "two"
    done = finetune_in_two(*common, "--out", str(two), "--batch", "2", "--grad-accum", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("Done: ") == 1  # rank 0 alone prints

    curve, reference = losses(two), losses(single)
    assert sorted(curve) == list(range(1, STEPS + 1))
    assert all(v is not None and torch.isfinite(torch.tensor(v)) for v in curve.values())
    for step in curve:
        assert curve[step] == pytest.approx(reference[step], abs=1e-3), step
    meta = json.loads((two / "checkpoints" / f"step-{STEPS:08d}" / "meta.json").read_text())
    assert meta["distributed"] == {"world_size": 2, "sharding": "ddp", "sharded": "dcp"}
    assert meta["plan"]["setup"]["world_size"] == 2 and meta["plan"]["setup"]["lora_rank"] == lora
    assert meta["finetune"]["base_run"] == str(run.resolve())

    mine, theirs, start = weights(two), weights(single), base_weights(run)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert (mine[name] - theirs[name]).abs().max() < 1e-4, name
    adapters = [n for n in mine if "lora_" in n]
    if lora:
        assert adapters and all(n.endswith(("lora_a", "lora_b")) for n in adapters)
        assert all(mine[n].abs().max() > 0 for n in adapters if n.endswith("lora_b"))  # B starts at zero
        for name, tensor in start.items():  # every base weight, frozen, as the base run saved it
            stored = name.replace(".qkv.", ".qkv.base.").replace(".proj.", ".proj.base.").replace(
                ".up.", ".up.base.").replace(".down.", ".down.base.")
            assert torch.equal(mine[stored if stored in mine else name], tensor), name
    else:
        assert not adapters and mine.keys() == start.keys()
        assert all(not torch.equal(mine[n], start[n]) for n in mine if n.endswith("qkv.weight"))

    if lora:  # the 2 ranks' checkpoint continued in one process, as the single process's continues
        more = ["--run", str(run), "--data", str(sft), "--resume", "--max-steps", str(STEPS + 2)]
        for out in (single, two):
            result = finetune_here(*more, "--out", str(out))
            assert result.exit_code == 0, result.output
        (resume,) = [line for line in map(json.loads, (two / "metrics.jsonl").read_text().splitlines())
                     if line.get("event") == "resume"]
        assert resume["setup"]["world_size"] == 1 and resume["setup"]["grad_accum"] == 2  # the same global batch
        curve, reference = losses(two), losses(single)
        for step in (STEPS + 1, STEPS + 2):
            assert curve[step] == pytest.approx(reference[step], abs=1e-3), step


def _rank(rank: int, port: int, run: str, sft: str, out: str, dumps: str, sharding: str) -> None:
    """One of 2 ranks: a LoRA finetune through ``Trainer.start`` with ``finetune_task``'s factories; its
    parameters (adapters and frozen base) after the run into ``dumps``: as this rank holds them (DDP), or
    gathered whole by rank 0 (FSDP2 shards them)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    from memplan.hardware import load_profile
    from memplan.plan import Plan
    from memplan.setup import TrainSetup
    from trainer import distributed
    from trainer.__main__ import _exit
    from trainer.finetune import base_of, finetune_task, load_sft
    from trainer.loop import TrainConfig, Trainer

    base_plan, tokenizer, record, checkpoint = base_of(run)
    data = load_sft(sft, tokenizer, record, ctx=64, base_checkpoint=checkpoint, base_run=Path(run))
    setup = TrainSetup(ctx=64, micro_batch=2, precision="fp32", lora_rank=4, world_size=2, sharding=sharding)
    plan = Plan(model=base_plan.model, setup=setup, device="cpu")
    config = TrainConfig(max_steps=STEPS, lr=1e-2, weight_decay=0.0, sample_tokens=0, eval_batches=1)
    try:
        trainer = Trainer.start(out, plan, data, config, load_profile("cpu"), task=finetune_task(data))
        trainer.run()
        if sharding == "ddp":
            torch.save({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, f"{dumps}/rank{rank}.pt")
        else:
            whole = distributed.full_weights(trainer.wrapped)  # every rank takes part; rank 0 gets them
            if rank == 0:
                torch.save(whole, f"{dumps}/rank0.pt")
    finally:
        distributed.shutdown()
    # Leave as a rank of `python -m trainer` does: past this point is interpreter finalization, where a C++
    # thread of gloo's runtime aborts about one FSDP2 rank in ten here ("terminate called without an active
    # exception", SIGABRT) after everything above has finished; it failed CI once.
    _exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_every_rank_holds_the_base_weights_and_the_same_trained_adapters(base, tmp_path, sharding):
    """The factories run in every rank: no rank trains a seeded model without the base weights or the
    adapters (what a subclass whose model-building override the distributed path skipped did). FSDP2 (which
    autotune may plan for a finetune over several devices) builds through them too."""
    import torch
    import torch.multiprocessing as mp

    from trainer.lora import LoRALinear  # noqa: F401  (the names below are LoRALinear's)

    run, sft = base
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    mp.start_processes(_rank, args=(_free_port(), str(run), str(sft), str(tmp_path / "ft"), str(dumps), sharding),
                       nprocs=2, start_method="spawn")
    params = torch.load(dumps / "rank0.pt", weights_only=True)
    if sharding == "ddp":
        other = torch.load(dumps / "rank1.pt", weights_only=True)
        assert params.keys() == other.keys()
        for name in params:
            assert torch.equal(params[name], other[name]), name  # DDP: the same model in every rank
    adapters = [n for n in params if n.endswith(("lora_a", "lora_b"))]
    assert len(adapters) == 2 * 4 * 2  # A and B on qkv, proj, up, down of both blocks
    assert all(params[n].abs().max() > 0 for n in adapters if n.endswith("lora_b"))  # trained from zero
    start = base_weights(run)
    for name, tensor in params.items():
        if name.endswith(("lora_a", "lora_b")) or name not in start and name.replace(".base.", ".") not in start:
            continue  # (a tied model's head is its embedding)
        assert torch.equal(tensor, start[name.replace(".base.", ".")]), name  # frozen, as the base run saved them
    written = weights(tmp_path / "ft")
    for name in adapters:  # rank 0 wrote the run: its checkpoint holds these adapters
        assert torch.equal(written[name], params[name]), name

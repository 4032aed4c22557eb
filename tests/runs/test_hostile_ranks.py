"""A failure in one rank's part of a distributed checkpoint save (issue 29, item 5a) ends every rank with one
line naming the failed rank and its cause, instead of leaving the others waiting in a collective; a rank that
hangs is named once the save's timeout ($MEMPLAN_SAVE_TIMEOUT, a few seconds here) has passed. Two processes
under torchrun over gloo (tests/runs/hostile_save_ranks.py), each writing how its save ended. One launch saves
once per fault, each into a run of its own (a torchrun launch is most of the test's time); the hang comes last."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


FAULTS = ("prepare", "state", "write", "weights", "finish")
FAILING = 0
HANGING = 1  # tests/runs/hostile_save_ranks.py's HANG_RANK
SAVE_TIMEOUT = 6  # seconds: long enough for a loaded machine's two ranks to meet at each part of a save
HANG = SAVE_TIMEOUT + 5  # the hung rank's sleep: past the others' timeout, then it goes on and finds them gone
LAUNCH_LIMIT = 100  # seconds; before the timeout, a rank failing in the state or hanging left the others waiting


def save_with_failures(out: Path, faults: tuple[str, ...], failing: int, sharding: str = "ddp"
                       ) -> tuple[dict, dict, str]:
    """Each fault's save, one after the other in the same two ranks (one launch of torchrun): fault -> rank ->
    the line that rank's save ended with, fault -> rank -> its seconds; and the end of torchrun's output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "MEMPLAN_SAVE_TIMEOUT": str(SAVE_TIMEOUT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "runs" / "hostile_save_ranks.py"), str(out), ",".join(faults), str(failing),
           str(HANG), sharding]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=LAUNCH_LIMIT)
    except subprocess.TimeoutExpired:
        import psutil

        for child in psutil.Process(proc.pid).children(recursive=True):  # torchrun's ranks: sessions of their own
            child.kill()
        proc.kill()
        output, _ = proc.communicate()
        ended = {f: sorted(p.name for p in (out / f).glob("rank*.txt")) for f in faults if (out / f).is_dir()}
        pytest.fail(f"a rank still waited after {LAUNCH_LIMIT} s (a save never ended; saves ended: {ended}): "
                    f"{output[-2000:]}")

    def read(fault: str, suffix: str) -> dict[int, str]:
        return {r: (out / fault / f"rank{r}.{suffix}").read_text().strip() for r in range(2)
                if (out / fault / f"rank{r}.{suffix}").exists()}

    return ({f: read(f, "txt") for f in faults}, {f: read(f, "seconds") for f in faults}, output[-2000:])


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    out = tmp_path_factory.mktemp("saves")
    return out, *save_with_failures(out, FAULTS + ("hang",), FAILING)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_rank_failing_in_a_save_ends_every_rank_naming_it(saves, fault):
    out, ended, seconds, output = saves
    lines = ended[fault]
    assert set(lines) == {0, 1}, (lines, output)
    for rank, line in lines.items():
        assert line.startswith("RankFailed: checkpoint step 1: "), line
        assert f"rank {FAILING} failed: OSError: [Errno 5] planted failure in {fault}" in line, line
    assert not (out / fault / "run" / "checkpoints" / ckpt_name()).exists()


def assert_hung_rank_named(saves, fault: str) -> None:
    """The save that ``fault`` hung: rank 0 names the hung rank once $MEMPLAN_SAVE_TIMEOUT has passed, without
    waiting out the hang; the hung rank, going on, finds the others gone; no checkpoint is left."""
    out, ended, seconds, output = saves
    lines = ended[fault]
    assert set(lines) == {0, 1}, (lines, output)
    assert lines[0] == (f"RankFailed: checkpoint step 1: rank {HANGING} did not answer within {SAVE_TIMEOUT} s "
                        "($MEMPLAN_SAVE_TIMEOUT) (hung, or died)"), lines[0]
    assert float(seconds[fault][0]) < HANG, seconds  # it did not wait for the hung rank
    assert lines[1].startswith("RankFailed: checkpoint step 1: "), lines[1]  # which found the others gone
    assert not (out / fault / "run" / "checkpoints" / ckpt_name()).exists()


def test_a_rank_that_hangs_in_a_save_is_named_once_the_timeout_passes(saves):
    assert_hung_rank_named(saves, "hang")


# FSDP2 (issue 29, item 5a's last part): the whole weights are all-gathered from every rank's shards, which ran on
# the training process group (10 minutes) before: a rank failing just before the gather, or hanging inside it,
# left the others in FSDP2's all-gather.

@pytest.fixture(scope="module")
def fsdp_saves(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-saves")
    return out, *save_with_failures(out, ("none", "weights", "gather"), FAILING, "fsdp")


def test_an_fsdp_save_holds_the_whole_weights_torchs_full_state_dict_gathers(fsdp_saves):
    """The gather over the save's group (shards of 7 and 3 rows over two ranks: uneven) is exactly FSDP2's."""
    import torch

    from trainer.checkpoint_format import read_weights

    out, ended, seconds, output = fsdp_saves
    assert ended["none"] == {0: "saved", 1: "saved"}, (ended["none"], output)
    saved = read_weights(out / "none" / "run" / "checkpoints" / ckpt_name() / "model.safetensors")
    expected = torch.load(out / "none" / "expected.pt")
    assert sorted(saved) == sorted(expected) and len(saved) == 4, (sorted(saved), sorted(expected))
    assert all(torch.equal(saved[k], expected[k]) for k in saved)


def test_an_fsdp_rank_failing_before_the_gather_ends_every_rank_naming_it(fsdp_saves):
    out, ended, seconds, output = fsdp_saves
    lines = ended["weights"]
    assert set(lines) == {0, 1}, (lines, output)
    for rank, line in lines.items():
        assert line == f"RankFailed: checkpoint step 1: rank {FAILING} failed: OSError: [Errno 5] planted failure " \
                       "in weights", line


def test_an_fsdp_rank_that_hangs_inside_the_gather_is_named_once_the_timeout_passes(fsdp_saves):
    assert_hung_rank_named(fsdp_saves, "gather")


def ckpt_name() -> str:
    from trainer.checkpoint_format import checkpoint_name

    return checkpoint_name(1)

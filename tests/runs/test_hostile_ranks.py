"""A failure in one rank's part of a distributed checkpoint save (issue 29, item 5a) ends every rank with one
line naming the failed rank and its cause, instead of leaving the others waiting in a collective: two processes
under torchrun over gloo (tests/runs/hostile_save_ranks.py), each writing how its save ended. One launch
saves once per fault, each into a run of its own (a torchrun launch is most of the test's time)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


FAULTS = ("prepare", "finish")
FAILING = 0


def save_with_failures(out: Path, faults: tuple[str, ...], failing: int) -> tuple[dict[str, dict[int, str]], str]:
    """Each fault's save, one after the other in the same two ranks (one launch of torchrun): fault -> rank ->
    the line that rank's save ended with; and the end of torchrun's output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "runs" / "hostile_save_ranks.py"), str(out), ",".join(faults), str(failing)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        import psutil

        for child in psutil.Process(proc.pid).children(recursive=True):  # torchrun's ranks: sessions of their own
            child.kill()
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"a rank still waited after 120 s (a save never ended): {output[-2000:]}")
    lines = {fault: {r: (out / fault / f"rank{r}.txt").read_text().strip() for r in range(2)
                     if (out / fault / f"rank{r}.txt").exists()} for fault in faults}
    return lines, output[-2000:]


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    out = tmp_path_factory.mktemp("saves")
    return out, *save_with_failures(out, FAULTS, FAILING)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_rank_failing_in_a_save_ends_every_rank_naming_it(saves, fault):
    out, ended, output = saves
    lines = ended[fault]
    assert set(lines) == {0, 1}, (lines, output)
    for rank, line in lines.items():
        assert line.startswith("RankFailed: checkpoint step 1: "), line
        assert f"rank {FAILING} failed: OSError: [Errno 5] planted failure in {fault}" in line, line
    assert not (out / fault / "run" / "checkpoints" / ckpt_name()).exists()


def ckpt_name() -> str:
    from trainer.checkpoint_format import checkpoint_name

    return checkpoint_name(1)

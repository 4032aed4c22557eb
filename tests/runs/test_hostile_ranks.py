"""A failure in one rank's part of a distributed checkpoint save (issue 29, item 5a) ends every rank with one
line naming the failed rank and its cause, instead of leaving the others waiting in a collective: two processes
under torchrun over gloo (tests/runs/hostile_save_ranks.py), each writing how its save ended."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def save_with_a_failure(tmp_path: Path, fault: str, failing: int) -> dict[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "runs" / "hostile_save_ranks.py"), str(tmp_path), fault, str(failing)]
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
        pytest.fail(f"a rank still waited after 120 s (the save never ended): {output[-2000:]}")
    lines = {r: (tmp_path / f"rank{r}.txt").read_text().strip() for r in range(2)
             if (tmp_path / f"rank{r}.txt").exists()}
    assert set(lines) == {0, 1}, (lines, output[-2000:])
    return lines


@pytest.mark.parametrize("fault, failing", [("prepare", 0), ("finish", 0)])
def test_a_rank_failing_in_a_save_ends_every_rank_naming_it(tmp_path, fault, failing):
    lines = save_with_a_failure(tmp_path, fault, failing)
    for rank, line in lines.items():
        assert line.startswith("RankFailed: checkpoint step 1: "), line
        assert f"rank {failing} failed: OSError: [Errno 5] planted failure in {fault}" in line, line
    assert not (tmp_path / "run" / "checkpoints" / ckpt_name()).exists()


def ckpt_name() -> str:
    from trainer.checkpoint import checkpoint_name

    return checkpoint_name(1)

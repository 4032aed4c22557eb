"""A gloo rank measured under MemTracker returns from a collective only once gloo's worker thread has freed what the
call made (``trainer.distributed.frees_what_it_made``): the rank's peak is then its step's, not that thread's timing."""

from __future__ import annotations

import os
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from trainer.distributed import Made, alive, collectives_free_what_they_made, frees_what_it_made


def _freed_late(hold_s: float):
    """A stand-in for a gloo collective: it makes a tensor (an op, which the dispatch mode sees) and returns while
    another thread still holds it, as gloo's worker holds its work for a while after the caller's wait returns.
    Returns the call and a weak reference to what it made."""
    made = []

    def collective(out):
        copy = torch.empty(1024)
        made.append(weakref.ref(copy.untyped_storage()))
        out.copy_(torch.zeros(4))
        threading.Timer(hold_s, copy.untyped_storage).start()  # the timer's thread holds ``copy`` until it fires
        del copy
    return collective, made


def test_a_synchronous_collective_returns_after_what_it_made_is_freed():
    """Without the wait the call returns with its copy alive (the other thread holds it for 0.2 s); with it, the
    copy is gone at return. The argument ``out`` is the caller's and is not waited for."""
    out = torch.empty(4)
    collective, made = _freed_late(0.2)
    collective(out)
    assert made[0]() is not None
    time.sleep(0.5)

    collective, made = _freed_late(0.2)
    start = time.monotonic()
    frees_what_it_made(collective)(out)
    assert made[0]() is None and time.monotonic() - start < 2.0


def test_the_wait_ends_at_its_bound_when_the_tensor_is_kept():
    """What the call made and something still keeps ends the wait at ``timeout`` (the call returns, nothing hangs)."""
    kept = []

    def collective():
        kept.append(torch.empty(8))
    start = time.monotonic()
    frees_what_it_made(collective, timeout=0.3)()
    assert 0.3 <= time.monotonic() - start < 2.0 and kept


def test_an_asynchronous_collective_passes_through():
    """A call that returns its Work (``async_op``) is not waited for: the caller waits for the work later."""
    work = object()
    assert frees_what_it_made(lambda: work, timeout=5.0)() is work


def test_the_names_are_restored_after_the_block():
    original = dist.reduce_scatter_single
    with collectives_free_what_they_made():
        assert dist.reduce_scatter_single is not original
        assert dist.distributed_c10d.reduce_scatter_single is dist.reduce_scatter_single
    assert dist.reduce_scatter_single is original and dist.distributed_c10d.reduce_scatter_single is original


CALLS = 100


def _rank(rank: int, store: str, out_dir: str) -> None:
    """Two gloo ranks reduce-scatter ``CALLS`` times within ``collectives_free_what_they_made``; each counts the
    calls that returned with something they made still alive (every op's output storage, in any thread, under
    ``Made``), less the call's arguments."""
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        late = 0
        with collectives_free_what_they_made():
            for _ in range(CALLS):
                grad, shard = torch.randn(2 * 2**20, dtype=torch.bfloat16), torch.empty(2**20, dtype=torch.bfloat16)
                with Made() as made:
                    dist.reduce_scatter_single(shard, grad)
                mine = frozenset({grad.untyped_storage().data_ptr(), shard.untyped_storage().data_ptr()})
                late += bool(alive(made.storages, mine))
        with open(os.path.join(out_dir, f"late{rank}"), "w") as f:
            f.write(str(late))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_gloo_ranks_return_from_each_reduce_scatter_with_its_copy_freed(tmp_path):
    """Real gloo: gloo's reduce-scatter splits a flat copy of its input on its worker thread, and that thread drops
    it after the caller's wait returns (unwrapped, 2 to 5 of each rank's 100 calls returned with it alive, in three
    runs here). Within ``collectives_free_what_they_made`` none of 2 × 100 calls does."""
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    assert [int((tmp_path / f"late{r}").read_text()) for r in range(2)] == [0, 0]

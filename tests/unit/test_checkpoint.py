"""trainer.checkpoint_format: atomic saves (also under SIGKILL), keep-last-k, the newest by name, verification
that names the bad file, canonical weight names, tied weights, RNG states."""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from memplan.errors import InputError
from memplan.model import ModelSpec
from trainer import checkpoint_format as ckpt
from trainer.model import build_model

REPO = Path(__file__).resolve().parents[2]
SPEC = ModelSpec(arch="llama", layers=2, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=100, tied=True)


def model(checkpointing: str = "none", seed: int = 0, spec: ModelSpec = SPEC):
    torch.manual_seed(seed)
    return build_model(spec, "sdpa", checkpointing)


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_then_load_round_trips_weights_state_and_meta(tmp_path):
    m = model()
    state = {"optimizer": {"lr": 0.1, "moments": torch.arange(5.0)}, "step": 7}
    path = ckpt.save_checkpoint(tmp_path, 7, m, state, {"note": "x"}, extra_files={"tokenizer.json": b"{}"})
    assert path == tmp_path / "step-00000007"
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "model.safetensors", "state.pt", "tokenizer.json"]
    other = model(seed=1)
    assert not same_weights(m, other)
    meta, loaded = ckpt.load_checkpoint(path, other)
    assert same_weights(m, other)
    assert torch.equal(loaded["optimizer"]["moments"], torch.arange(5.0)) and loaded["step"] == 7
    assert meta["step"] == 7 and meta["note"] == "x"
    for name in ("model.safetensors", "state.pt", "tokenizer.json"):
        assert meta["files"][name]["bytes"] == (path / name).stat().st_size
        assert meta["files"][name]["sha256"] == ckpt.file_sha256(path / name)


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    m = model()
    path = ckpt.save_checkpoint(tmp_path, 1, m, {}, {})
    stored = ckpt.read_weights(path / ckpt.MODEL_FILE)
    assert "embed.weight" in stored and "head.weight" not in stored
    other = model(seed=3)
    ckpt.load_checkpoint(path, other)
    assert other.head.weight is other.embed.weight and same_weights(m, other)


def test_weights_have_the_plain_models_names_whatever_the_wrappers(tmp_path):
    wrapped = model("full")  # blocks.N.block.… under checkpointing
    assert any(".block." in n for n in wrapped.state_dict())
    path = ckpt.save_checkpoint(tmp_path, 1, wrapped, {}, {})
    plain = model("none", seed=5)
    assert set(ckpt.read_weights(path / ckpt.MODEL_FILE)) <= set(plain.state_dict())
    ckpt.load_checkpoint(path, plain)
    assert same_weights(plain, model("none"))
    assert ckpt.canonical_name("_orig_mod.blocks.3.block.mlp.up.weight") == "blocks.3.mlp.up.weight"


def test_loading_into_another_shape_is_an_error_naming_the_file(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, model(), {}, {})
    wider = model(spec=SPEC.replace(hidden=128, ffn=256))
    with pytest.raises(InputError, match=r"model\.safetensors.*another model shape"):
        ckpt.load_checkpoint(path, wider)
    deeper = model(spec=SPEC.replace(layers=3))
    with pytest.raises(InputError, match="lacks blocks.2"):
        ckpt.load_checkpoint(path, deeper)


def test_keeps_the_newest_k_and_finds_the_newest_by_step(tmp_path):
    m = model()
    for step in (5, 10, 15, 20, 100):
        ckpt.save_checkpoint(tmp_path, step, m, {"step": step}, {}, keep=2)
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)] == [20, 100]
    assert ckpt.latest_checkpoint(tmp_path).path.name == "step-00000100"
    # half-written or half-deleted leftovers never count, and the next save clears them
    (tmp_path / ".tmp-step-00000200-999").mkdir()
    (tmp_path / ".trash-step-00000020-999").mkdir()
    assert ckpt.latest_checkpoint(tmp_path).step == 100
    ckpt.save_checkpoint(tmp_path, 101, m, {}, {}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000100", "step-00000101"]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    m = model()
    ckpt.save_checkpoint(tmp_path, 3, m, {"v": 1}, {})
    ckpt.save_checkpoint(tmp_path, 3, m, {"v": 2}, {})
    assert ckpt.load_checkpoint(tmp_path / "step-00000003")[1]["v"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000003"]


def test_a_save_that_fails_before_the_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    m = model()
    ckpt.save_checkpoint(tmp_path, 1, m, {"v": 1}, {})

    def failing_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.os, "rename", failing_rename)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(tmp_path, 2, m, {"v": 2}, {})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path).path)[1]["v"] == 1


_SAVER = textwrap.dedent("""
    import sys, torch
    from trainer import checkpoint_format as ckpt
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 2048)  # 8 MiB of weights: each save takes a while
    big = {"moments": torch.randn(3_000_000)}  # 12 MiB of state
    step = 0
    while True:
        step += 1
        ckpt.save_checkpoint(sys.argv[1], step, model, {**big, "step": step}, {"step": step}, keep=2)
""")


def test_sigkill_during_saves_always_leaves_a_loadable_newest_checkpoint(tmp_path):
    """Kill a process that does nothing but save, at several moments; the newest checkpoint always
    verifies and loads, and at least one kill landed in the middle of a save."""
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    delays = (0.05, 0.31, 0.67)
    dirs = [tmp_path / f"trial{i}" for i in range(len(delays))]
    procs = [subprocess.Popen([sys.executable, str(script), str(d)], env=env) for d in dirs]  # started together
    try:
        for proc, directory, delay in zip(procs, dirs, delays):
            deadline = time.monotonic() + 120
            while ckpt.latest_checkpoint(directory) is None:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(delay)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
    mid_save = 0
    for directory in dirs:
        mid_save += any(p.name.startswith((".tmp-", ".trash-")) for p in directory.iterdir())
        newest = ckpt.latest_checkpoint(directory)
        meta, state = ckpt.load_checkpoint(newest.path, torch.nn.Linear(1024, 2048))
        assert meta["step"] == state["step"] == newest.step
    assert mid_save >= 1, "no kill landed during a save; the test proved nothing"


def _break(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(raw[: len(raw) // 2]))
    else:
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))


@pytest.mark.parametrize("name", ["model.safetensors", "state.pt"])
@pytest.mark.parametrize("how,needle", [("truncate", "truncated"), ("flip", "sha256")])
def test_a_damaged_file_is_named_and_the_older_checkpoint_suggested(tmp_path, name, how, needle):
    m = model()
    ckpt.save_checkpoint(tmp_path, 1, m, {"v": 1}, {})
    newest = ckpt.save_checkpoint(tmp_path, 2, m, {"v": 2}, {})
    _break(newest / name, how)
    with pytest.raises(InputError) as err:
        ckpt.load_checkpoint(newest, model())
    message = str(err.value)
    assert str(newest / name) in message and needle in message and "step-00000001" in message


def test_a_missing_or_unreadable_meta_is_named(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, model(), {}, {})
    (path / "meta.json").write_text("{not json")
    with pytest.raises(InputError, match=r"meta\.json: not valid JSON"):
        ckpt.load_checkpoint(path)
    (path / "meta.json").unlink()
    with pytest.raises(InputError, match=r"meta\.json: missing"):
        ckpt.load_checkpoint(path)


def test_unverified_load_still_names_a_file_it_cannot_read(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, model(), {"v": 1}, {})
    _break(path / "state.pt", "truncate")
    with pytest.raises(InputError, match=r"state\.pt: cannot be read"):
        ckpt.load_checkpoint(path, verify=False)
    _break(path / "model.safetensors", "truncate")
    with pytest.raises(InputError, match=r"model\.safetensors: not a readable safetensors file"):
        ckpt.load_checkpoint(path, model(), verify=False)


def test_rng_states_round_trip_through_a_weights_only_load():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)
    buf = io.BytesIO()
    torch.save(ckpt.rng_state(), buf)
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    buf.seek(0)
    ckpt.set_rng_state(torch.load(buf, weights_only=True))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws

"""Hostile inputs of issue 30 (and the full-disk export of issue 29 item 3): a crafted checkpoint's metadata,
manifests naming files outside their corpus, concurrent exports, sizes beyond the shape search, logger checks
before anything is written, full disks under calibrate/autotune/export, and the small ones (a different
``--run`` on resume, renamed symlinks left behind, 0700 outputs, huge integers echoed)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import InputError

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str, **kwargs):
    return CliRunner().invoke(app, list(args), catch_exceptions=False, **kwargs)


# ---- 1: DCP metadata builds only the exact globals it holds ----------------------------------------------------

def _stack_global_payload(module: str, name: str, command: str) -> bytes:
    """A protocol-4 pickle calling ``module``'s dotted ``name`` (e.g. ``os.system``, resolved through the
    module's own imports) on ``command``: PROTO 4, module, name, STACK_GLOBAL, (command,), REDUCE, STOP."""
    def text(s: str) -> bytes:
        raw = s.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(command) + b"\x85" + b"R" + b"."


def test_a_dotted_name_in_dcp_metadata_runs_nothing(tmp_path):
    from trainer import distributed

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    marker = tmp_path / "code-ran"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        distributed.save_sharded(tmp_path / "dcp", model, optimizer)
        distributed.load_sharded(tmp_path / "dcp", model, optimizer)  # a genuine one still loads
        payload = _stack_global_payload("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}")
        (tmp_path / "dcp" / ".metadata").write_bytes(payload)
        with pytest.raises(InputError, match=r"\.metadata: holds torch\.distributed\.checkpoint\.metadata\.os\.system"):
            distributed.load_sharded(tmp_path / "dcp", model, optimizer)
    assert not marker.exists(), "the crafted metadata ran os.system"

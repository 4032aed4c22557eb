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


# ---- 2: a corpus manifest names only files inside the corpus ---------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from runs_helper import tiny_corpus

    return tiny_corpus(tmp_path_factory.mktemp("corpus"))


def _copied_corpus(corpus: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(corpus, dest)
    return dest


@pytest.mark.parametrize("where", ["parent", "absolute"])
@pytest.mark.parametrize("entry", ["shard", "tokenizer"])
def test_a_manifest_naming_a_file_outside_the_corpus_is_refused(tmp_path, corpus, entry, where):
    """A shard or tokenizer copied outside the corpus (same bytes, same sha256) and named there by a rewritten
    manifest.json (``../x`` or an absolute path) is refused in one line, not read."""
    import json
    import shutil

    from trainer.data import PreparedData

    copy = _copied_corpus(corpus, tmp_path / "corpus")
    manifest = json.loads((copy / "manifest.json").read_text())
    item = manifest["train"]["shards"][0] if entry == "shard" else manifest["tokenizer"]
    outside = tmp_path / f"outside-{Path(item['file']).name}"
    shutil.copyfile(copy / item["file"], outside)
    item["file"] = f"../{outside.name}" if where == "parent" else str(outside)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=r"manifest\.json: lists (shard|tokenizer) .*not a file inside the corpus"):
        PreparedData(copy).tokenizer

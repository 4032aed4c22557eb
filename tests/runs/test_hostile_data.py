"""Hostile data for prepare / eval / train (issue 14, items 8, 16, 17 and the data cases of 18).

8.  A source with too few documents is held out by a window of its text, at the fraction asked.
16. ``eval`` verifies the held-out shards it reads; an out-of-range token id is one line naming the
    shard, the id and the vocabulary (eval, and train --no-verify-data).
17. A huge one-line document is read, cleaned and tokenized in bounded pieces (peak RSS bounded).
18. A full disk, a bad --out parent, a file gone or unreadable mid-prepare, SIGTERM / SIGINT / kill -9,
    and binary files named .txt: one line each, and no temporary directory left for later.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import fill_disk
from memplan.cli import app
from runs_helper import one_line_error, story, tiny_corpus, tiny_run
from trainer import data
from trainer.data import PreparedData
from trainer.tokenizer import EOT

REPO = Path(__file__).resolve().parents[2]
WORDS = ["river", "stone", "lantern", "orchard", "copper", "meadow", "harbour", "violet", "thunder", "pebble"]


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def prose(n_words: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(WORDS), n_words)
    nums = rng.integers(0, 1000, n_words)
    return " ".join(f"{WORDS[p]}{n}" if n % 7 == 0 else WORDS[p] for p, n in zip(picks, nums)) + "."


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}


def temp_dirs(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.") and p.is_dir())


def rewrite_sha(corpus: Path, split: str, index: int = 0) -> None:
    """Make the manifest agree with a shard changed on disk (as a consistent but wrong corpus would)."""
    m = json.loads((corpus / "manifest.json").read_text())
    sh = m[split]["shards"][index]
    sh["sha256"] = hashlib.sha256((corpus / sh["file"]).read_bytes()).hexdigest()
    (corpus / "manifest.json").write_text(json.dumps(m))


# ---- 16: eval verifies its shards; token ids are checked against the vocabulary ----------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("trained")
    corpus = tiny_corpus(root)
    run = tiny_run(root / "run", corpus, steps=4)
    torch.set_num_threads(threads)
    return root, corpus, run


def copy_corpus(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("own", [False, True], ids=["--data", "own-data"])
def test_eval_refuses_an_overwritten_held_out_shard(trained, tmp_path, own):
    root, corpus, run = trained
    target = corpus if own else copy_corpus(corpus, tmp_path / "copy")
    shard = target / json.loads((target / "manifest.json").read_text())["val"]["shards"][0]["file"]
    saved = shard.read_bytes()
    ids = np.frombuffer(saved, dtype="<u2").copy()
    shard.write_bytes(np.roll(ids, 7).astype("<u2").tobytes())  # same size, same ids, other order
    try:
        args = ["eval", "--run", str(run)] + ([] if own else ["--data", str(target)])
        one_line_error(cli(*args), str(shard), "sha256")
    finally:
        shard.write_bytes(saved)


def test_eval_names_the_shard_and_id_outside_the_vocabulary(trained, tmp_path):
    _, corpus, run = trained
    target = copy_corpus(corpus, tmp_path / "copy")
    m = json.loads((target / "manifest.json").read_text())
    shard = target / m["val"]["shards"][0]["file"]
    ids = np.fromfile(shard, dtype="<u2")
    ids[5] = 9999
    ids.tofile(shard)
    rewrite_sha(target, "val")
    line = one_line_error(cli("eval", "--run", str(run), "--data", str(target)), str(shard), "9999",
                          f"vocabulary of {m['vocab_size']}")
    assert "Traceback" not in line


def test_train_without_verify_names_the_shard_and_id_outside_the_vocabulary(trained, tmp_path):
    _, corpus, _ = trained
    target = copy_corpus(corpus, tmp_path / "copy")
    m = json.loads((target / "manifest.json").read_text())
    shard = target / m["train"]["shards"][0]["file"]
    ids = np.fromfile(shard, dtype="<u2")
    ids[1::50] = 65000  # every window holds one
    ids.tofile(shard)
    result = cli("train", "--data", str(target), "--out", str(tmp_path / "run"), "--arch", "llama", "--layers", "2",
                 "--hidden", "64", "--heads", "2", "--kv-heads", "2", "--ffn", "128", "--ctx", "64", "--batch", "4",
                 "--precision", "fp32", "--sample-tokens", "0", "--max-steps", "2", "--no-verify-data")
    assert result.exit_code == 2, result.output
    # train prints its header on stderr first; the failure is one line after it
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == errors[0]
    for needle in (str(shard), "65000", f"vocabulary of {m['vocab_size']}"):
        assert needle in errors[0], (needle, errors[0])


# ---- 8: few documents are held out by a window of their text ----------------------------------------

@pytest.mark.parametrize("n_docs", [1, 2, 3])
def test_few_long_documents_hold_out_the_fraction_by_a_window(tmp_path, n_docs):
    src = tmp_path / "books"
    src.mkdir()
    for i in range(n_docs):
        (src / f"book{i}.txt").write_text(prose(6000, seed=i))
    out = tmp_path / "out"
    result = cli("prepare", "-i", str(src), "--out", str(out), "--tokenizer", "bpe:320", "--val-fraction", "0.05",
                 "--workers", "1")
    assert result.exit_code == 0, result.output
    d = PreparedData(out)
    s = d.manifest["sources"][0]
    assert s["val_split"] == "window"
    share = s["val_tokens"] / s["tokens"]
    window = 1 / s["tokens"] * 20  # a cut at a space: a word or two of tokens either way
    assert abs(share - 0.05) <= window + 0.002, share  # before: 0 (one file) or 0.5 (two)
    assert "whole documents cannot hold out 5%" in " ".join(result.stdout.split())


# ---- 17: a huge one-line document streams ---------------------------------------------------------------

# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec, so a child of this (torch-sized)
# process would start at the parent's size
_PEAK = """
import sys
from trainer import data
data.prepare(data.resolve_inputs([sys.argv[1]]), sys.argv[2], data.PrepareConfig(tokenizer="bpe:320", workers=1))
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def peak_rss_kib(src: Path, out: Path) -> int:
    done = subprocess.run([sys.executable, "-c", _PEAK, str(src), str(out)], env=env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_a_huge_one_line_document_is_prepared_in_memory_bounded_by_a_piece(tmp_path):
    text = prose(700_000)  # ~5 MB without a newline
    one = tmp_path / "one.txt"
    one.write_text(text)
    words = text.split(" ")
    many = tmp_path / "many.txt"
    many.write_text(EOT.join(" ".join(words[i:i + 200]) for i in range(0, len(words), 200)))
    peak_one, peak_many = peak_rss_kib(one, tmp_path / "o1"), peak_rss_kib(many, tmp_path / "o2")
    # What the one document may cost beyond the same text as many: a few pieces alive at once (the
    # reader's block and carry, the cleaner's copies, the tokenizers library's per-sequence state while
    # it encodes a piece: alignments of 16 bytes per byte, a token record per ~4 characters), 512 bytes
    # per character of a piece in all: 32 MiB, whatever the document's size. Read whole, it took ~170
    # bytes per character of the document (850 MB here).
    bound_kib = 512 * data.DOC_CHUNK_CHARS // 1024
    print(f"peak RSS: one document {peak_one} KiB, many {peak_many} KiB, bound {bound_kib} KiB")
    assert peak_one - peak_many <= bound_kib, (peak_one, peak_many, bound_kib)


def test_pieces_cut_at_spaces_encode_to_the_ids_of_the_whole(tmp_path):
    from trainer.data import split_text
    from trainer.tokenizer import train_bpe

    text = prose(3000) + "\n\n  indented line\n" + prose(2000, seed=1)
    tok = train_bpe([text], 400)
    pieces = list(split_text(text, 500))
    assert len(pieces) > 20 and "".join(pieces) == text
    assert sum(tok.encode_batch(pieces), []) == tok.encode(text)


def test_a_document_cleaned_in_pieces_is_the_document_cleaned_whole():
    from trainer.data import PieceCleaner, split_text

    raw = ("  Title\r\n\r\n\r\n\r\n" + "word  \tother   " * 400 + "\n\x07\n   code(x)  \n\n\n\n\nend  \n") * 3
    cleaner = PieceCleaner(data.CleanConfig(min_chars=1))
    got = "".join(cleaner.feed(p) for p in split_text(raw, 97))
    assert got == data.filter_document(raw, data.CleanConfig(min_chars=1))[0]
    assert cleaner.digest == data.document_hash(got) and cleaner.finish() is None


# ---- 18: disk full, bad --out, files gone, signals, binary files -------------------------------------

def write_stories(path: Path, n: int = 400) -> Path:
    path.write_text("".join(json.dumps({"text": story(i)}) + "\n" for i in range(n)))
    return path


def test_disk_full_is_one_line_naming_the_path_and_leaves_no_temp_dir(tmp_path, small_disk):
    src = tmp_path / "big.txt"
    src.write_text(prose(200_000))  # ~1.5 MB: staging it alone overflows what is left
    fill_disk(small_disk, leave=256 * 1024)
    out = small_disk / "out"
    result = cli("prepare", "-i", str(src), "--out", str(out), "--tokenizer", "bpe:300", "--workers", "1")
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "no space left" in lines[0].lower() and str(small_disk) in lines[0], lines[0]
    assert temp_dirs(out) == [] and not out.exists()


@pytest.mark.parametrize("case", ["parent-is-a-file", "read-only"])
def test_an_unusable_out_parent_is_one_line(tmp_path, case, request):
    src = write_stories(tmp_path / "s.jsonl")
    if case == "read-only":
        parent = request.getfixturevalue("read_only_dir")
        needle = "cannot write"
    else:
        parent = tmp_path / "afile"
        parent.write_text("x")
        needle = "not a directory"
    out = parent / "deeper" / "out"
    one_line_error(cli("prepare", "-i", str(src), "--out", str(out), "--tokenizer", "bpe:300"), str(out), needle)


@pytest.mark.parametrize("how", ["deleted", "unreadable"])
def test_an_input_file_gone_during_prepare_is_one_line_naming_it(tmp_path, monkeypatch, how):
    src = tmp_path / "books"
    src.mkdir()
    for i in range(3):
        (src / f"b{i}.txt").write_text(prose(300, seed=i))
    victim = src / "b1.txt"
    resolve = data.resolve_inputs

    def resolve_then_lose(*args, **kw):  # the file is listed, then goes before it is read
        sources = resolve(*args, **kw)
        if how == "deleted":
            victim.unlink()
        else:
            real_open = open

            def failing_open(path, *a, **k):
                if Path(path) == victim:
                    raise PermissionError(13, "Permission denied", str(path))
                return real_open(path, *a, **k)

            monkeypatch.setattr("builtins.open", failing_open)
        return sources

    monkeypatch.setattr(data, "resolve_inputs", resolve_then_lose)
    out = tmp_path / "out"
    one_line_error(cli("prepare", "-i", str(src), "--out", str(out), "--tokenizer", "bpe:300", "--workers", "1"),
                   str(victim))
    monkeypatch.undo()
    assert temp_dirs(out) == [] and not out.exists()


def spawn_prepare(src: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "memplan", "prepare", "-i", str(src), "--out", str(out),
                             "--tokenizer", "bpe:2000", "--workers", "2"], env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def wait_for_temp_dir(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 60
    while not any(n.startswith(f".{out.name}.prepare-") for n in temp_dirs(out)):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "prepare made no temporary directory"
        time.sleep(0.02)
    time.sleep(0.3)  # into the work


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("big") / "big.jsonl"
    src.write_text("".join(json.dumps({"text": prose(400, seed=i)}) + "\n" for i in range(6000)))
    return src


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_prepare_removes_its_temp_dir(tmp_path, big_source, sig):
    out = tmp_path / "out"
    proc = spawn_prepare(big_source, out)
    wait_for_temp_dir(proc, out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode not in (0, None), err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and signal.Signals(sig).name in lines[0] and "Traceback" not in err, err
    assert temp_dirs(out) == [] and not out.exists()


def test_a_prepare_after_kill_9_removes_the_dead_ones_temp_dir_and_says_so(tmp_path, big_source):
    out = tmp_path / "out"
    proc = spawn_prepare(big_source, out)
    wait_for_temp_dir(proc, out)
    proc.kill()
    proc.wait(timeout=30)
    stale = [n for n in temp_dirs(out) if ".prepare-" in n]
    assert stale  # kill -9 runs no clean-up
    src = write_stories(tmp_path / "s.jsonl")
    result = cli("prepare", "-i", str(src), "--out", str(out), "--tokenizer", "bpe:300", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert temp_dirs(out) == [] and PreparedData(out).train_tokens > 0
    assert f"removed {out.parent / stale[0]}" in " ".join(result.stdout.split())


def test_an_old_corpus_set_aside_by_a_killed_prepare_is_put_back_not_removed(tmp_path):
    src = write_stories(tmp_path / "s.jsonl")
    out = tmp_path / "out"
    assert cli("prepare", "-i", str(src), "--out", str(out), "--tokenizer", "bpe:300", "--workers", "1").exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    aside = tmp_path / ".out.old-k9k9k9k9"  # where _move_into_place sets it aside, killed before the new rename
    os.rename(out, aside)
    result = cli("prepare", "-i", str(src), "--out", str(out), "--tokenizer", "bpe:300", "--workers", "1")
    one_line_error(result, "already holds a prepared corpus")  # put back, so --force is needed to replace it
    assert f"restored the corpus in {aside}" in " ".join(result.stdout.split())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not aside.exists()


def test_a_signal_while_the_new_corpus_replaces_the_old_waits_until_it_is_in_place(tmp_path, monkeypatch):
    src = write_stories(tmp_path / "s.jsonl")
    out = tmp_path / "out"
    assert cli("prepare", "-i", str(src), "--out", str(out), "--tokenizer", "bpe:300", "--workers", "1").exit_code == 0
    rename = os.rename

    def rename_then_signal(a, b):  # SIGTERM arrives just after the old corpus is set aside
        rename(a, b)
        if ".old-" in str(b):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(data.os, "rename", rename_then_signal)
    result = cli("prepare", "-i", str(src), "--out", str(out), "--tokenizer", "bpe:320", "--workers", "1", "--force")
    monkeypatch.undo()
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert "already complete" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert PreparedData(out).vocab_size == 320 and temp_dirs(out) == []


ELF = b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 64  # NUL bytes, as every executable has
LATIN1 = ("Grüße aus Köln, schöne Straße. " * 400).encode("latin-1")  # not UTF-8: one bad byte in ~10


@pytest.mark.parametrize("blob", [ELF, LATIN1], ids=["elf", "latin-1"])
@pytest.mark.parametrize("alone", [False, True], ids=["with-text", "alone"])
def test_a_binary_file_named_txt_is_skipped_with_a_warning_or_refused_alone(tmp_path, blob, alone):
    src = tmp_path / "docs"
    src.mkdir()
    (src / "program.txt").write_bytes(blob)
    if not alone:
        (src / "real.txt").write_text(prose(500))
    out = tmp_path / "out"
    result = cli("prepare", "-i", str(src), "--out", str(out), "--tokenizer", "bpe:300", "--workers", "1")
    if alone:
        one_line_error(result, str(src / "program.txt"), "not a text file")
        assert not out.exists() and temp_dirs(out) == []
        return
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "skipped 1 file(s) that are not text" in text and str(src / "program.txt") in text
    m = PreparedData(out).manifest
    assert m["sources"][0]["documents"] == 1 and m["sources"][0]["skipped_files"][0][0] == str(src / "program.txt")


def _dies(item):
    import os

    if item == 3:
        os._exit(9)  # a worker killed mid-item (OOM killer, kill -9)
    return item


def test_a_worker_that_dies_is_an_error_not_a_hang():
    """multiprocessing.Pool waits forever for the result of a worker that died; ordered_map must raise."""
    from concurrent.futures.process import BrokenProcessPool

    from trainer.data import ordered_map

    with pytest.raises(BrokenProcessPool):
        list(ordered_map(_dies, range(8), workers=2))

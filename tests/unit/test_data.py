"""memplan prepare and the data loader: cleaning, formats, shards, manifest, split, stream, errors.

Tiny hand-made corpora live in tmp_path; the embedded default corpus is prepared once per session
(the ``embedded`` fixture; deselect its tests with ``-k "not embedded"``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import InputError
from trainer import data
from trainer.data import (CleanConfig, PreparedData, TrainStream, clean_text, filter_document, text_fraction,
                          val_document_count)
from trainer.tokenizer import (EOT, Tokenizer, parse_tokenizer_spec, token_dtype_name, train_bpe)

REPO = Path(__file__).resolve().parents[2]


# ---- helpers ---------------------------------------------------------------------------------------

def run(*args: str):
    return CliRunner().invoke(app, ["prepare", *args])


def assert_one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("memplan: error: "), line
    for needle in needles:
        assert needle.lower() in line.lower(), (needle, line)
    return line


def sentence(i: int, topic: str = "rivers") -> str:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    return (f"Document {i} about {topic}: " + " ".join(words[(i + k) % 8] for k in range(12))
            + f". The number is {i * 7919}.")


def write_jsonl(path: Path, texts, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def shard_tokens(directory: Path, split: str) -> np.ndarray:
    m = json.loads((directory / "manifest.json").read_text())
    parts = [np.fromfile(directory / sh["file"], dtype=np.dtype(m["dtype"]).newbyteorder("<"))
             for sh in m[split]["shards"]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def decode_documents(tok: Tokenizer, ids: np.ndarray) -> list[str]:
    """Split a split's ids at end-of-text ids (one before every document) and decode each document."""
    ids = ids.astype(np.int64)
    assert ids.size == 0 or ids[0] == tok.eot_id, "a split starts with end-of-text"
    cuts = np.flatnonzero(ids == tok.eot_id)
    bounds = list(cuts) + [ids.size]
    return [tok.decode(ids[a + 1:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:])]


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def dir_snapshot(directory: Path) -> dict:
    return {p.name: file_sha(p) for p in sorted(directory.iterdir())}


# ---- cleaning ---------------------------------------------------------------------------------------

def test_clean_applies_nfc_normalisation():
    assert clean_text("cafe\u0301") == "caf\u00e9"


def test_clean_removes_control_characters_but_keeps_newline_and_tab():
    assert clean_text("a\x00b\x07c\x1bd\ufeffe\x85f\n\tg") == "abcdef\n\tg"


def test_clean_turns_carriage_returns_into_newlines():
    assert clean_text("one\r\ntwo\rthree") == "one\ntwo\nthree"


def test_clean_collapses_inner_whitespace_keeps_indentation_and_drops_trailing():
    assert clean_text("a  b\t\tc   \n    def f(x):   return  x  \n") == "a b c\n    def f(x): return x"


def test_clean_squeezes_more_than_two_blank_lines_and_trims_the_ends():
    assert clean_text("\n\n\npara one\n\n\n\n\n\npara two\n\n\npara three\n\n\n") == \
        "para one\n\n\npara two\n\n\npara three"
    assert clean_text("x\n  \n \t \n  \n\ny") == "x\n\n\ny"  # whitespace-only lines are blank lines


def test_text_fraction_counts_letters_digits_punctuation_and_space():
    assert text_fraction("Hello, world! x = [1, 2] + {3}") == 1.0
    assert text_fraction("«Grüße», 東京 — ¿qué?") == 1.0  # non-ASCII letters and punctuation are text
    assert text_fraction("ab☃☃") == pytest.approx(0.5)  # ☃ is a symbol (So)
    assert text_fraction("\ufffd\ufffd\ufffda") == pytest.approx(0.25)  # replacement characters from bad UTF-8


def test_filter_drops_short_documents():
    cfg = CleanConfig(min_chars=20)
    assert filter_document("too short", cfg) == (None, "short")
    assert filter_document("   " + "x" * 19 + "   \n\n", cfg) == (None, "short")  # length after cleaning
    assert filter_document("long enough to keep, surely", cfg)[0] == "long enough to keep, surely"


def test_filter_drops_documents_that_are_mostly_not_text():
    junk = "\ufffd" * 60 + " mojibake"
    assert filter_document(junk, CleanConfig(min_chars=5)) == (None, "nontext")


def test_filter_removes_lines_of_mostly_non_text_and_keeps_the_rest():
    raw = "A table of results follows below.\n┌────────┬────────┐\n│ value  │ 42     │\nThe end of the table."
    text, reason = filter_document(raw, CleanConfig(min_chars=5))
    assert reason is None
    assert text == "A table of results follows below.\n│ value │ 42 │\nThe end of the table."


def test_dedupe_drops_exact_duplicates_after_cleaning_across_sources(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [sentence(1), sentence(2), sentence(1), sentence(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [sentence(2) + "   ", sentence(4), "  " + sentence(5) + "\n\n"])
    (tmp_path / "c.txt").write_text(sentence(5))
    res = run("--input", str(a), "--input", str(b), "--input", str(tmp_path / "c.txt"),
              "--out", str(tmp_path / "out"), "--tokenizer", "bpe:300", "--val-fraction", "0")
    assert res.exit_code == 0, res.output
    stats = {s["name"]: s for s in json.loads((tmp_path / "out" / "stats.json").read_text())["sources"]}
    assert (stats["a"]["documents"], stats["a"]["duplicates_dropped"]) == (3, 1)
    assert (stats["b"]["documents"], stats["b"]["duplicates_dropped"]) == (2, 1)  # sentence(2) seen in a
    assert (stats["c"]["documents"], stats["c"]["duplicates_dropped"]) == (0, 1)  # sentence(5) seen in b
    tok = Tokenizer.from_dir(tmp_path / "out")
    assert decode_documents(tok, shard_tokens(tmp_path / "out", "train")) == \
        [sentence(1), sentence(2), sentence(3), sentence(4), sentence(5)]


# ---- tokenizers ---------------------------------------------------------------------------------------

def test_tokenizer_spec_parsing():
    assert parse_tokenizer_spec("bpe:8192").vocab_size == 8192
    assert parse_tokenizer_spec("BPE:257").vocab_size == 257
    assert parse_tokenizer_spec("gpt2").kind == "tiktoken"
    for bad, needle in (("bpe:abc", "integer"), ("bpe:", "integer"), ("bpe:256", "at least 257"),
                        ("bpe:-5", "integer"), ("nonsense.json", "not a file")):
        with pytest.raises(InputError, match=needle):
            parse_tokenizer_spec(bad)


def test_trained_bpe_round_trips_any_text_and_has_eot_zero():
    texts = [sentence(i) for i in range(50)] + ["Grüße aus 東京 🎉\n\tindented"]
    tok = train_bpe(texts, 300)
    assert tok.eot_id == 0 and tok.kind == "bpe" and tok.vocab_size <= 300
    for t in ["  leading spaces", "Grüße aus 東京 🎉\n\tindented", "never seen: ζ∑ℵ\r\n"]:
        assert tok.decode(tok.encode(t)) == t


def test_literal_endoftext_inside_a_document_is_plain_text():
    tok = train_bpe([sentence(i) for i in range(20)], 300)
    ids = tok.encode(f"before {EOT} after")
    assert tok.eot_id not in ids
    assert tok.decode(ids) == f"before {EOT} after"


def test_loaded_tokenizer_without_an_eot_token_gets_one(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    hf = HF(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.eot_id == 3 and tok.vocab_size == 4
    assert tok.encode("ab") == [2]


def test_dtype_is_uint16_while_every_id_fits_in_16_bits():
    assert token_dtype_name(257) == "uint16"
    assert token_dtype_name(50257) == "uint16"
    assert token_dtype_name(65536) == "uint16"  # ids 0..65535
    assert token_dtype_name(65537) == "uint32"
    assert token_dtype_name(128256) == "uint32"


def test_vocab_over_65535_writes_uint32_shards_end_to_end(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({f"unused{i}": len(vocab) + i for i in range(70_000 - len(vocab))})
    hf = HF(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.save(str(tmp_path / "big.json"))  # no <|endoftext|>: it is added as id 70000 > 65535
    corpus = write_jsonl(tmp_path / "docs.jsonl", [sentence(i) for i in range(6)])
    res = run("--input", str(corpus), "--out", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "big.json"),
              "--val-fraction", "0.17")  # one document of six: a split between documents
    assert res.exit_code == 0, res.output
    d = PreparedData(tmp_path / "out")
    assert d.dtype.name == "uint32" and d.vocab_size == 70_001 and d.eot_id == 70_000
    assert (tmp_path / "out" / "train-00000.bin").stat().st_size == 4 * d.train_tokens
    docs = decode_documents(d.tokenizer, shard_tokens(tmp_path / "out", "train"))
    assert docs == [sentence(i) for i in range(5)]


def test_tiktoken_wrapper_encodes_without_special_tokens():
    pytest.importorskip("tiktoken")
    tok = Tokenizer.from_tiktoken(tiny_tiktoken_encoding("tiny"))
    assert (tok.eot_id, tok.vocab_size, tok.kind) == (257, 258, "tiktoken")
    ids = tok.encode(f"ab {EOT}")
    assert ids[0] == 256 and 257 not in ids
    assert tok.decode(ids + [257]) == f"ab {EOT}{EOT}"


def tiny_tiktoken_encoding(name: str = "gpt2"):
    """A 258-token tiktoken Encoding (bytes, one merge, <|endoftext|>), standing in for gpt2 offline."""
    import tiktoken

    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"ab"] = 256
    return tiktoken.Encoding(name, pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={EOT: 257})


@pytest.mark.parametrize("workers", ["1", "2"])
def test_gpt2_through_tiktoken_records_the_encoding_name_and_hash(tmp_path, monkeypatch, workers):
    tiktoken = pytest.importorskip("tiktoken")
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: tiny_tiktoken_encoding(name))
    corpus = write_jsonl(tmp_path / "c.jsonl", [sentence(i) for i in range(10)])
    res = run("-i", str(corpus), "--out", str(tmp_path / "o"), "--tokenizer", "gpt2", "--workers", workers,
              "--val-fraction", "0.1")  # one document of ten: a split between documents
    assert res.exit_code == 0, res.output
    d = PreparedData(tmp_path / "o")
    entry = d.manifest["tokenizer"]
    assert (entry["kind"], entry["encoding"], d.eot_id, d.vocab_size) == ("tiktoken", "gpt2", 257, 258)
    assert "file" not in entry and not (tmp_path / "o" / "tokenizer.json").exists()
    assert entry["sha256"] == Tokenizer.from_tiktoken(tiny_tiktoken_encoding()).sha256()
    train = decode_documents(d.tokenizer, shard_tokens(tmp_path / "o", "train"))
    val = decode_documents(d.tokenizer, shard_tokens(tmp_path / "o", "val"))
    assert train + val == [sentence(i) for i in range(10)] and len(val) == 1
    ranks = {bytes([b]): b for b in range(256)}  # a different table under the same name is refused
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: tiktoken.Encoding(
        name, pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={EOT: 256}))
    with pytest.raises(InputError, match="gpt2.*sha256"):
        PreparedData(tmp_path / "o").tokenizer


# ---- input formats ------------------------------------------------------------------------------------

def test_txt_is_one_document_or_several_split_at_endoftext(tmp_path):
    (tmp_path / "one.txt").write_text(sentence(1) + "\n\n" + sentence(2) + "\n")
    (tmp_path / "stories.txt").write_text(f"{sentence(3)}\n{EOT}\n{sentence(4)}\n{EOT}\n\n{sentence(5)}{EOT}\n")
    res = run("-i", str(tmp_path / "one.txt"), "-i", str(tmp_path / "stories.txt"), "--out", str(tmp_path / "o"),
              "--tokenizer", "bpe:300", "--val-fraction", "0")
    assert res.exit_code == 0, res.output
    d = PreparedData(tmp_path / "o")
    assert [(s.name, s.documents) for s in d.sources] == [("one", 1), ("stories", 3)]
    assert decode_documents(d.tokenizer, shard_tokens(tmp_path / "o", "train")) == \
        [sentence(1) + "\n\n" + sentence(2), sentence(3), sentence(4), sentence(5)]


def test_jsonl_reads_the_text_field(tmp_path):
    write_jsonl(tmp_path / "records.jsonl", [sentence(i) for i in range(4)], field="body")
    res = run("-i", str(tmp_path / "records.jsonl"), "--text-field", "body", "--out", str(tmp_path / "o"),
              "--tokenizer", "bpe:300", "--val-fraction", "0")
    assert res.exit_code == 0, res.output
    d = PreparedData(tmp_path / "o")
    assert decode_documents(d.tokenizer, shard_tokens(tmp_path / "o", "train")) == [sentence(i) for i in range(4)]


def test_parquet_reads_the_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"id": list(range(5)), "text": [sentence(i) for i in range(4)] + [None]})
    pq.write_table(table, tmp_path / "table.parquet", row_group_size=2)
    res = run("-i", str(tmp_path / "table.parquet"), "--out", str(tmp_path / "o"), "--tokenizer", "bpe:300",
              "--val-fraction", "0")
    assert res.exit_code == 0, res.output
    d = PreparedData(tmp_path / "o")
    assert decode_documents(d.tokenizer, shard_tokens(tmp_path / "o", "train")) == [sentence(i) for i in range(4)]
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())["sources"][0]
    assert stats["filtered_short"] == 1  # the null row


def test_directory_is_one_source_read_recursively_in_path_order(tmp_path):
    root = tmp_path / "mixed"
    (root / "b" / "deep").mkdir(parents=True)
    (root / "a.txt").write_text(sentence(1))
    write_jsonl(root / "b" / "deep" / "z.jsonl", [sentence(3), sentence(4)])
    (root / "b" / "c.txt").write_text(sentence(2))
    (root / "notes.md").write_text(sentence(99))  # not an input extension: ignored inside a directory
    (root / ".hidden.txt").write_text(sentence(98))  # hidden: ignored
    res = run("-i", str(root), "--out", str(tmp_path / "o"), "--tokenizer", "bpe:300", "--val-fraction", "0")
    assert res.exit_code == 0, res.output
    d = PreparedData(tmp_path / "o")
    assert d.source_names == ("mixed",)
    assert decode_documents(d.tokenizer, shard_tokens(tmp_path / "o", "train")) == \
        [sentence(1), sentence(2), sentence(3), sentence(4)]


class FakeDatasets:
    """Stands in for the `datasets` package: load_dataset(name, split, streaming) over fixed records, and a
    load_dataset_builder whose split has no data files (as a cache of arrow files has none): read through
    load_dataset."""

    def __init__(self, records=None, error=None):
        self.records, self.error, self.calls = records, error, []

    def load_dataset_builder(self, name):
        from types import SimpleNamespace

        if self.error:
            raise self.error
        return SimpleNamespace(config=SimpleNamespace(data_files={}))

    def load_dataset(self, name, split, streaming):
        self.calls.append((name, split, streaming))
        if self.error:
            raise self.error
        return iter(self.records)


def test_hf_dataset_is_streamed_and_named_after_the_dataset(tmp_path, monkeypatch):
    fake = FakeDatasets(records=[{"text": sentence(i), "n": i} for i in range(8)])
    monkeypatch.setitem(sys.modules, "datasets", fake)
    res = run("-i", "hf:someone/TinyThing:validation", "--out", str(tmp_path / "o"), "--tokenizer", "bpe:300",
              "--max-docs", "5", "--val-fraction", "0.2")
    assert res.exit_code == 0, res.output
    assert fake.calls == [("someone/TinyThing", "validation", True)]
    d = PreparedData(tmp_path / "o")
    assert d.source_names == ("TinyThing",) and d.sources[0].documents == 5


def test_hf_dataset_that_cannot_be_loaded(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets(error=ConnectionError("no route to host\nmore")))
    assert_one_line_error(run("-i", "hf:someone/Thing", "--out", str(tmp_path / "o")),
                          "hf:someone/Thing", "ConnectionError", "network")


def test_hf_folder_dataset_prepares_as_its_jsonl_file_and_another_format_says_its_records_arrive_whole(
        tmp_path, monkeypatch):
    """A local folder dataset (hf:DIR) of .jsonl is read by memplan's own reader: the same shards as the file
    itself; one of .csv goes through datasets.load_dataset, and prepare says so in a note."""
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    texts = [sentence(i) for i in range(40)]
    (tmp_path / "j" / "data").mkdir(parents=True)
    write_jsonl(tmp_path / "j" / "data" / "train.jsonl", texts)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "train.csv").write_text("text\n" + "".join(f'"{t}"\n' for t in texts), encoding="utf-8")
    outs = {}
    for name, src in (("file", str(tmp_path / "j" / "data" / "train.jsonl")), ("hf", f"hf:{tmp_path / 'j'}"),
                      ("csv", f"hf:{tmp_path / 'c'}")):
        res = run("-i", src, "--out", str(tmp_path / name), "--tokenizer", "bpe:300")
        assert res.exit_code == 0, res.output
        outs[name] = res.output
    assert "csv builder" not in outs["hf"]
    assert "csv builder" in outs["csv"] and "records come whole" in outs["csv"], outs["csv"]
    for split in ("train", "val"):
        assert shard_tokens(tmp_path / "hf", split).tolist() == shard_tokens(tmp_path / "file", split).tolist()
        assert shard_tokens(tmp_path / "csv", split).tolist() == shard_tokens(tmp_path / "file", split).tolist()


def test_sources_with_the_same_stem_get_distinct_names(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    write_jsonl(tmp_path / "x" / "train.jsonl", [sentence(1)])
    write_jsonl(tmp_path / "y" / "train.jsonl", [sentence(2)])
    sources = data.resolve_inputs([str(tmp_path / "x" / "train.jsonl"), str(tmp_path / "y" / "train.jsonl")])
    assert [s.name for s in sources] == ["train", "train-2"]


# ---- shards, manifest, split ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Three sources of 20, 1 and 2 documents; val fraction 0.2; shards of at most 500 tokens."""
    root = tmp_path_factory.mktemp("small")
    docs = {"alpha": [sentence(i, "alpha") for i in range(20)],
            "beta": [sentence(100, "beta")],
            "gamma": [sentence(200, "gamma"), sentence(201, "gamma") + f" It mentions {EOT} literally."]}
    for name, texts in docs.items():
        write_jsonl(root / f"{name}.jsonl", texts)
    args = [a for name in docs for a in ("-i", str(root / f"{name}.jsonl"))]
    res = run(*args, "--out", str(root / "out"), "--tokenizer", "bpe:320", "--val-fraction", "0.2",
              "--shard-tokens", "500", "--workers", "2")
    assert res.exit_code == 0, res.output
    return root / "out", docs, res


def test_shards_decode_to_the_cleaned_documents_with_eot_separators(small):
    out, docs, _ = small
    tok = Tokenizer.from_dir(out)
    train = decode_documents(tok, shard_tokens(out, "train"))
    val = decode_documents(tok, shard_tokens(out, "val"))
    # alpha: the last 4 of 20 documents; beta (one document) and gamma (two) are cut inside their last
    # document, whose held-out tail starts a document of its own in the val split
    assert train[:16] == docs["alpha"][:16] and val[:4] == docs["alpha"][16:]
    assert train[16] + val[4] == docs["beta"][0]
    assert train[17] == docs["gamma"][0] and train[18] + val[5] == docs["gamma"][1]
    assert len(train) == 19 and len(val) == 6
    n_eot = int((shard_tokens(out, "train") == tok.eot_id).sum() + (shard_tokens(out, "val") == tok.eot_id).sum())
    assert n_eot == 25  # one per document and per held-out tail: the literal "<|endoftext|>" in gamma is text


def test_shards_respect_the_shard_size_and_are_hashed_in_the_manifest(small):
    out, _, _ = small
    m = json.loads((out / "manifest.json").read_text())
    assert len(m["train"]["shards"]) >= 2
    for split in ("train", "val"):
        assert sum(sh["tokens"] for sh in m[split]["shards"]) == m[split]["tokens"]
        for sh in m[split]["shards"]:
            assert 0 < sh["tokens"] <= 500
            assert file_sha(out / sh["file"]) == sh["sha256"]
            assert (out / sh["file"]).stat().st_size == 2 * sh["tokens"]
    assert m["dtype"] == "uint16" and m["eot_id"] == 0
    assert m["tokenizer"]["kind"] == "bpe" and m["tokenizer"]["file"] == "tokenizer.json"
    assert m["tokenizer"]["sha256"] == file_sha(out / "tokenizer.json")
    assert m["format_version"] == data.FORMAT_VERSION


def test_val_split_holds_out_the_last_documents_or_the_last_fraction_of_the_text(small):
    out, docs, _ = small
    d = PreparedData(out)
    by = {s.name: s for s in d.sources}
    m = {s["name"]: s for s in d.manifest["sources"]}
    assert [(m[n]["train_documents"], m[n]["val_documents"], m[n]["val_split"]) for n in ("alpha", "beta", "gamma")] \
        == [(16, 4, "documents"), (1, 1, "window"), (2, 1, "window")]
    val = shard_tokens(out, "val")
    train = shard_tokens(out, "train")
    s = by["alpha"]
    assert decode_documents(d.tokenizer, val[s.val_offset:s.val_offset + s.val_tokens]) == docs["alpha"][16:]
    assert decode_documents(d.tokenizer, train[s.train_offset:s.train_offset + s.train_tokens]) == docs["alpha"][:16]
    for name in ("beta", "gamma"):  # the last fifth of the text, cut at a space: within a word of 0.2
        s = by[name]
        held = "".join(decode_documents(d.tokenizer, val[s.val_offset:s.val_offset + s.val_tokens]))
        total = sum(len(t) for t in docs[name])
        assert abs(len(held) / total - 0.2) <= 12 / total, (name, len(held), total)
    assert sum(s.train_tokens for s in d.sources) == d.train_tokens
    assert sum(s.val_tokens for s in d.sources) == d.val_tokens


def test_cli_prints_a_table_per_source_and_notes_sources_split_inside_a_document(small):
    _, _, res = small
    for word in ("alpha", "beta", "gamma", "total", "docs", "chars", "tokens", "dups", "filtered"):
        assert word in res.stdout
    text = " ".join(res.stdout.split())
    assert "'beta': 1 document; whole documents cannot hold out 20%" in text
    assert "'gamma': 2 documents" in text and "'alpha': " not in text


def test_val_document_count():
    assert [val_document_count(n, 0.05) for n in (0, 1, 2, 10, 30, 100, 1000)] == [0, 0, 1, 1, 2, 5, 50]
    assert [val_document_count(n, 0.5) for n in (2, 3, 4)] == [1, 2, 2]
    assert val_document_count(1000, 0.0) == 0


def test_prepare_is_deterministic_and_independent_of_workers(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [sentence(i) for i in range(40)])
    for w in ("1", "2"):
        assert run("-i", str(corpus), "--out", str(tmp_path / f"w{w}"), "--tokenizer", "bpe:300",
                   "--workers", w).exit_code == 0
    assert dir_snapshot(tmp_path / "w1") == dir_snapshot(tmp_path / "w2")


# ---- loader: opening and verifying -----------------------------------------------------------------------

def copy_prepared(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_prepared_data_exposes_what_the_training_loop_needs(small):
    out, _, _ = small
    d = PreparedData(out)
    m = json.loads((out / "manifest.json").read_text())
    assert (d.vocab_size, d.eot_id, d.train_tokens, d.val_tokens) == \
        (m["vocab_size"], 0, m["train"]["tokens"], m["val"]["tokens"])
    assert d.source_names == ("alpha", "beta", "gamma")
    assert d.tokenizer.vocab_size == d.vocab_size
    d.verify()


def test_truncated_shard_is_an_input_error_naming_the_file(small, tmp_path):
    out = copy_prepared(small[0], tmp_path / "c")
    shard = out / "train-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(InputError, match="train-00001.bin.*truncated"):
        PreparedData(out)


def test_missing_shard_is_an_input_error_naming_the_file(small, tmp_path):
    out = copy_prepared(small[0], tmp_path / "c")
    (out / "val-00000.bin").unlink()
    with pytest.raises(InputError, match="val-00000.bin.*missing"):
        PreparedData(out)


def test_corrupt_shard_passes_open_and_fails_verify_naming_the_file(small, tmp_path):
    out = copy_prepared(small[0], tmp_path / "c")
    shard = out / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    d = PreparedData(out)  # same size: the cheap check passes
    with pytest.raises(InputError, match="train-00000.bin.*sha256"):
        d.verify()


def test_truncated_manifest_is_an_input_error_naming_it(small, tmp_path):
    out = copy_prepared(small[0], tmp_path / "c")
    text = (out / "manifest.json").read_text()
    (out / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(InputError, match="manifest.json"):
        PreparedData(out)


def test_manifest_with_a_missing_key_is_an_input_error(small, tmp_path):
    out = copy_prepared(small[0], tmp_path / "c")
    m = json.loads((out / "manifest.json").read_text())
    del m["eot_id"]
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(InputError, match="manifest.json.*eot_id"):
        PreparedData(out)


def test_changed_tokenizer_is_an_input_error_naming_it(small, tmp_path):
    out = copy_prepared(small[0], tmp_path / "c")
    (out / "tokenizer.json").write_text((out / "tokenizer.json").read_text().replace("<|endoftext|>", "<|eot|>"))
    d = PreparedData(out)
    with pytest.raises(InputError, match="tokenizer.json.*sha256"):
        d.tokenizer


def test_not_a_prepared_directory_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no manifest.json"):
        PreparedData(tmp_path)
    with pytest.raises(InputError, match="no such directory"):
        PreparedData(tmp_path / "absent")


# ---- loader: the training stream and evaluation windows ---------------------------------------------------

def synthetic(directory: Path, n_train: int, val_spans: dict[str, int], shard_tokens: int = 1000) -> PreparedData:
    """A prepared directory whose token at position i is i (so a window's first token is its start)."""
    directory.mkdir(parents=True)
    writers = {}
    for split, ids in (("train", np.arange(n_train)), ("val", np.arange(sum(val_spans.values())))):
        w = data.ShardWriter(directory, split, np.dtype("<u2"), shard_tokens)
        w.write(ids)
        writers[split] = w.close()
    sources, at = [], 0
    for name, n in val_spans.items():
        sources.append({"name": name, "documents": 1, "tokens": n, "train_offset": 0, "train_tokens": 0,
                        "val_offset": at, "val_tokens": n})
        at += n
    manifest = {"format": data.FORMAT_NAME, "format_version": data.FORMAT_VERSION, "dtype": "uint16",
                "vocab_size": 65536, "eot_id": 0, "tokenizer": {"kind": "bpe", "file": "tokenizer.json"},
                "train": {"tokens": n_train, "shards": writers["train"]},
                "val": {"tokens": at, "shards": writers["val"]}, "sources": sources}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return PreparedData(directory)


@pytest.fixture
def toy(tmp_path):
    return synthetic(tmp_path / "toy", 6000, {"a": 1000, "b": 300, "tiny": 20})


def test_stream_yields_int64_x_and_y_shifted_by_one(toy):
    x, y = next(TrainStream(toy, batch=4, ctx=64, seed=0))
    assert x.shape == y.shape == (4, 64)
    assert str(x.dtype) == "torch.int64"
    assert (y == x + 1).all()  # the toy's token i is i
    assert x.is_contiguous() and y.is_contiguous()


def test_an_epoch_visits_every_window_once_in_a_seeded_order(toy):
    s = TrainStream(toy, batch=8, ctx=64, seed=3)
    n_windows = (6000 - 1) // 64  # 93
    assert s.batches_per_epoch == n_windows // 8
    starts = [int(v) for _ in range(s.batches_per_epoch) for v in next(s)[0][:, 0]]
    assert len(set(starts)) == len(starts)  # non-overlapping: distinct starts on a ctx grid
    assert all(v % 64 == 0 and v // 64 < n_windows for v in starts)
    assert starts != sorted(starts)  # shuffled
    next(s)
    assert s.epoch == 1  # the 5 windows left over did not make a batch
    again = TrainStream(toy, batch=8, ctx=64, seed=3)
    assert [int(v) for v in next(again)[0][:, 0]] == starts[:8]
    other = TrainStream(toy, batch=8, ctx=64, seed=4)
    assert [int(v) for v in next(other)[0][:, 0]] != starts[:8]


def test_later_epochs_shift_the_window_grid_by_a_seeded_offset(toy):
    s = TrainStream(toy, batch=8, ctx=64, seed=0)
    offsets = [s.epoch_plan(e)[0] for e in range(6)]
    assert offsets[0] == 0 and all(0 <= o < 64 for o in offsets) and len(set(offsets[1:])) > 1
    offset, perm = s.epoch_plan(1)
    assert len(perm) == (6000 - 1 - offset) // 64
    for _ in range(s.batches_per_epoch):
        next(s)
    x, y = next(s)
    assert s.epoch == 1
    assert all((int(v) - offset) % 64 == 0 for v in x[:, 0])


def test_stream_resumes_with_exactly_the_following_batches(toy):
    a = TrainStream(toy, batch=8, ctx=64, seed=11)
    for _ in range(7):
        next(a)
    state = json.loads(json.dumps(a.state_dict()))
    assert set(state) >= {"epoch", "position", "seed"}
    expected = [next(a) for _ in range(30)]  # crosses two epoch boundaries (11 batches per epoch)
    b = TrainStream(toy, batch=8, ctx=64, seed=999)
    b.load_state_dict(state)
    for (xa, ya), (xb, yb) in zip(expected, (next(b) for _ in range(30))):
        assert (xa == xb).all() and (ya == yb).all()
    assert b.state_dict() == a.state_dict()


def test_stream_state_from_another_ctx_or_corpus_is_refused(toy, tmp_path):
    state = TrainStream(toy, batch=2, ctx=64, seed=0).state_dict()
    with pytest.raises(InputError, match="ctx"):
        TrainStream(toy, batch=2, ctx=32, seed=0).load_state_dict(state)
    other = synthetic(tmp_path / "other", 7000, {"a": 100})
    with pytest.raises(InputError, match="same prepared data"):
        TrainStream(other, batch=2, ctx=64, seed=0).load_state_dict(state)


def test_rank_slices_are_disjoint_and_their_union_is_the_single_process_batch(toy):
    world = 3
    ranks = [TrainStream(toy, batch=2, ctx=32, seed=5, rank=r, world_size=world) for r in range(world)]
    single = TrainStream(toy, batch=2 * world, ctx=32, seed=5)
    import torch

    for _ in range(40):  # several epochs (31 batches of 6 windows per epoch)
        parts = [next(r) for r in ranks]
        x1, y1 = next(single)
        starts = [set(int(v) for v in x[:, 0]) for x, _ in parts]
        assert sum(len(s) for s in starts) == len(set().union(*starts)) == 2 * world  # disjoint
        assert (torch.cat([x for x, _ in parts]) == x1).all()
        assert (torch.cat([y for _, y in parts]) == y1).all()
    assert all(r.state_dict() == single.state_dict() for r in ranks)


def test_stream_refuses_a_corpus_too_small_for_one_batch(toy):
    with pytest.raises(InputError, match="too few"):
        TrainStream(toy, batch=64, ctx=128, seed=0)
    with pytest.raises(InputError, match="rank"):
        TrainStream(toy, batch=1, ctx=8, rank=2, world_size=2)


def test_val_batches_per_source_are_fixed_windows_inside_the_source(toy):
    # sources: a = val tokens [0, 1000), b = [1000, 1300), tiny = [1300, 1320)
    batches = list(toy.val_batches("b", batch=3, ctx=64))
    starts = [int(v) for x, _ in batches for v in x[:, 0]]
    assert starts == [1000, 1064, 1128, 1192]  # (300 - 1) // 64 = 4 windows, a partial last batch
    assert [x.shape[0] for x, _ in batches] == [3, 1]
    assert all((y == x + 1).all() and int(x.max()) < 1300 for x, y in batches)
    again = [int(v) for x, _ in toy.val_batches("b", batch=3, ctx=64) for v in x[:, 0]]
    assert again == starts
    assert list(toy.val_batches("tiny", batch=2, ctx=64)) == []  # fewer than ctx + 1 tokens
    assert toy.val_windows("tiny", ctx=64) == 0


def test_val_batches_with_max_batches_spread_over_the_whole_split(toy):
    starts = [int(v) for x, _ in toy.val_batches("a", batch=2, ctx=64, max_batches=1) for v in x[:, 0]]
    assert starts == [0, 7 * 64]  # 15 windows, 2 evenly spaced
    all_sources = [int(v) for x, _ in toy.val_batches(None, batch=4, ctx=64) for v in x[:, 0]]
    assert len(all_sources) == (1320 - 1) // 64
    with pytest.raises(InputError, match="nope"):
        list(toy.val_batches("nope", batch=1, ctx=8))


# ---- CLI: bad input is one line and exit 2 ---------------------------------------------------------------

def test_missing_input_file(tmp_path):
    assert_one_line_error(run("-i", str(tmp_path / "absent.txt"), "--out", str(tmp_path / "o")),
                          "absent.txt", "no such file")


def test_unknown_extension(tmp_path):
    (tmp_path / "table.csv").write_text("a,b\n")
    assert_one_line_error(run("-i", str(tmp_path / "table.csv"), "--out", str(tmp_path / "o")),
                          ".csv", ".txt", ".jsonl", ".parquet")


def test_directory_without_inputs(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.md").write_text("x")
    assert_one_line_error(run("-i", str(tmp_path / "d"), "--out", str(tmp_path / "o")), "no .txt")


def test_jsonl_without_the_text_field(tmp_path):
    write_jsonl(tmp_path / "r.jsonl", [sentence(1)], field="content")
    line = assert_one_line_error(run("-i", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o")),
                                 "r.jsonl:1", "'text'", "content", "--text-field")
    assert "id" in line
    assert not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["r.jsonl"]  # no temp directory left behind


def test_jsonl_with_a_broken_line(tmp_path):
    (tmp_path / "r.jsonl").write_text(json.dumps({"text": sentence(1)}) + "\n{not json\n")
    assert_one_line_error(run("-i", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o")), "r.jsonl:2", "JSON")


def test_empty_corpus_after_filtering(tmp_path):
    write_jsonl(tmp_path / "r.jsonl", ["tiny", "short", "\ufffd" * 50])
    assert_one_line_error(run("-i", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o")),
                          "empty corpus", "--min-chars")


@pytest.mark.parametrize("spec, needles", [
    ("bpe:abc", ("bpe:abc", "integer", "bpe:8192")),
    ("bpe:100", ("bpe:100", "at least 257")),
    ("bpe:256", ("at least 257",)),
    ("missing-tokenizer.json", ("missing-tokenizer.json", "bpe:N", "gpt2")),
])
def test_bad_tokenizer(tmp_path, spec, needles):
    write_jsonl(tmp_path / "r.jsonl", [sentence(1)])
    assert_one_line_error(run("-i", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o"), "--tokenizer", spec),
                          *needles)


@pytest.mark.parametrize("fraction", ["0.7", "-0.1", "0.51"])
def test_val_fraction_outside_the_accepted_range(tmp_path, fraction):
    write_jsonl(tmp_path / "r.jsonl", [sentence(1)])
    assert_one_line_error(run("-i", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o"),
                              "--val-fraction", fraction), "--val-fraction", "[0, 0.5]")


def test_val_fraction_that_is_not_a_number(tmp_path):
    assert_one_line_error(run("--out", str(tmp_path / "o"), "--val-fraction", "half"), "--val-fraction")


def test_zero_workers(tmp_path):
    assert_one_line_error(run("--out", str(tmp_path / "o"), "--workers", "0"), "--workers")
    assert_one_line_error(run("--out", str(tmp_path / "o"), "--workers", "many"), "--workers")


def test_missing_out(tmp_path):
    assert_one_line_error(run(), "--out", "required")


def test_gpt2_offline_without_a_cached_encoding(tmp_path, monkeypatch):
    pytest.importorskip("tiktoken")
    import tiktoken.load
    import tiktoken.registry

    def offline(url):
        raise ConnectionError(f"cannot reach {url}")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # nothing loaded earlier in this process
    write_jsonl(tmp_path / "r.jsonl", [sentence(1)])
    assert_one_line_error(run("-i", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o"), "--tokenizer", "gpt2"),
                          "gpt2", "TIKTOKEN_CACHE_DIR", "bpe:N")


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert_one_line_error(run("-i", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "o")),
                          "pyarrow", "pip install pyarrow")


def test_hf_dataset_without_the_datasets_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert_one_line_error(run("-i", "hf:roneneldan/TinyStories", "--out", str(tmp_path / "o")),
                          "hf:roneneldan/TinyStories", "datasets")


def test_out_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    assert_one_line_error(run("--out", str(tmp_path / "f")), "is a file")


# ---- CLI: --force and atomic output ----------------------------------------------------------------------

def test_existing_corpus_is_kept_without_force_and_replaced_with_it(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [sentence(i) for i in range(10)])
    out = tmp_path / "out"
    assert run("-i", str(corpus), "--out", str(out), "--tokenizer", "bpe:300").exit_code == 0
    before = dir_snapshot(out)
    assert_one_line_error(run("-i", str(corpus), "--out", str(out), "--tokenizer", "bpe:400"), "--force")
    assert dir_snapshot(out) == before
    res = run("-i", str(corpus), "--out", str(out), "--tokenizer", "bpe:400", "--force")
    assert res.exit_code == 0, res.output
    assert dir_snapshot(out) != before
    assert json.loads((out / "manifest.json").read_text())["tokenizer"]["spec"] == "bpe:400"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "out"]  # no temp or old copies


def test_a_directory_that_is_not_a_corpus_is_never_overwritten(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    assert_one_line_error(run("--out", str(out), "--force"), "not a prepared corpus")
    assert (out / "thesis.tex").read_text() == "precious"


def test_interrupted_prepare_leaves_nothing_and_keeps_the_old_corpus(tmp_path, monkeypatch):
    corpus = write_jsonl(tmp_path / "c.jsonl", [sentence(i) for i in range(10)])
    out = tmp_path / "out"
    assert run("-i", str(corpus), "--out", str(out), "--tokenizer", "bpe:300").exit_code == 0
    before = dir_snapshot(out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(data, "_tokenize_and_write", interrupted)
    res = run("-i", str(corpus), "--out", str(out), "--tokenizer", "bpe:400", "--force")
    assert res.exit_code != 0
    assert dir_snapshot(out) == before
    res = run("-i", str(corpus), "--out", str(tmp_path / "new"))
    assert res.exit_code != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "out"]


def test_prepare_and_its_cli_never_import_torch(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [sentence(i) for i in range(10)])
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom memplan.cli import app\n"
            f"r = CliRunner().invoke(app, ['prepare', '-i', {str(corpus)!r}, '--out', {str(tmp_path / 'o')!r}, "
            "'--tokenizer', 'bpe:300'])\nassert r.exit_code == 0, r.output\n"
            "from trainer.data import PreparedData\nPreparedData(" + repr(str(tmp_path / "o")) + ")\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr


# ---- the embedded default corpus ----------------------------------------------------------------------

# How fast the quick start's corpus is prepared (under a minute) is benchmarks/prepare_embedded.py's bar: a
# wall-clock figure of a shared machine, not a test's.
@pytest.fixture(scope="session")
def embedded(tmp_path_factory):
    out = tmp_path_factory.mktemp("embedded") / "corpus"
    res = run("--out", str(out))
    assert res.exit_code == 0, res.output
    return out, res


def test_embedded_default_corpus_has_both_sources_and_a_4096_bpe(embedded):
    out, res = embedded
    d = PreparedData(out)
    d.verify()
    assert d.source_names == ("pydoc", "stdlib-docstrings")
    assert d.manifest["tokenizer"]["spec"] == "bpe:4096" and d.vocab_size == 4096 and d.dtype.name == "uint16"
    by = {s.name: s for s in d.sources}
    assert by["pydoc"].documents >= 50 and by["stdlib-docstrings"].documents >= 1000
    assert d.train_tokens > 200_000 and all(s.val_tokens > 0 for s in d.sources)
    assert "stdlib-docstrings" in res.stdout


def test_embedded_corpus_decodes_to_real_python_documentation(embedded):
    out = embedded[0]
    tok = Tokenizer.from_dir(out)
    text = tok.decode(shard_tokens(out, "train")[:20000].tolist())
    assert text.startswith(EOT)
    assert "def " in text or "class " in text or "object" in text


def test_embedded_corpus_parses_the_stdlib_without_importing_it():
    files = data.stdlib_source_files()
    assert files and not any(part in data.EMBEDDED_SKIP_DIRS for f in files for part in f.parts[-3:-1])
    json_init = next(f for f in files if f.parent.name == "json" and f.name == "__init__.py")
    assert any("JSON" in d for d in data.docstrings_of_file(json_init))
    data.docstrings_of_file(next(f for f in files if f.name == "antigravity.py"))
    assert "antigravity" not in sys.modules  # parsed, not imported (importing it opens a web browser)


def test_the_tokenizing_counter_ends_at_its_total_when_the_held_out_split_cuts_a_document(tmp_path):
    """Issue 28: prepare's tokenizing counter ended at 6316/6315: the held-out part of a document the split cuts
    in two starts with its own end-of-text and was counted as one more document."""
    src = tmp_path / "one.txt"
    src.write_text(" ".join(f"word{i} and more text here." for i in range(400)))  # one document: the split cuts it
    seen = []
    result = data.prepare(data.resolve_inputs([str(src)]), tmp_path / "out",
                          data.PrepareConfig(tokenizer="bpe:300", workers=1, val_fraction=0.2),
                          progress=lambda stage, done, total: seen.append((stage, done, total)))
    assert result.manifest["sources"][0]["val_tokens"] > 0
    counts = [(done, total) for stage, done, total in seen if stage == "tokenize"]
    assert counts[-1][0] == counts[-1][1] and all(done <= total for done, total in counts), counts

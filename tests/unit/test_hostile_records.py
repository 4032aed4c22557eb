"""A long .jsonl, .parquet or hf: record (issue 29, item 5b) is read as a long .txt document is: a
``LongDocument`` of pieces of at most ``DOC_CHUNK_CHARS`` characters (cleaned, staged and tokenized piece by
piece), not one string handled whole; benchmarks/prepare_memory.py measures the peak memory it costs."""

from __future__ import annotations

import json

import pytest

from trainer import data


def long_text(n: int) -> str:
    words = ["river", "stone", "lantern", "orchard\n", "copper", "meadow"]
    out, size, i = [], 0, 0
    while size < n:
        w = words[i % len(words)] + str(i % 97)
        out.append(w)
        size += len(w) + 1
        i += 1
    return " ".join(out)


def pieces(doc) -> list[str]:
    assert isinstance(doc, data.LongDocument), type(doc)
    return list(doc)


def test_a_long_jsonl_record_is_read_in_pieces(tmp_path):
    text = long_text(5 * data.DOC_CHUNK_CHARS)
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": text}) + "\n", encoding="utf-8")
    docs = data._read_jsonl(path, "text")
    assert next(docs) == "short"
    got = pieces(next(docs))
    assert "".join(got) == text and len(got) >= 5
    assert all(len(p) <= data.DOC_CHUNK_CHARS for p in got)
    assert got == list(data.split_text(text, data.DOC_CHUNK_CHARS))  # the cuts a long .txt document gets


def test_a_long_parquet_record_is_read_in_pieces(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    text = long_text(3 * data.DOC_CHUNK_CHARS)
    path = tmp_path / "r.parquet"
    pq.write_table(pa.table({"text": ["short", text]}), path)
    docs = data._read_parquet(path, "text")
    assert next(docs) == "short"
    assert "".join(pieces(next(docs))) == text


def test_pieces_of_text_cut_where_split_text_does_without_copying_the_rest():
    text = long_text(10 * 1000)
    for limit in (1, 7, 100, 1000, 20000):
        assert list(data.pieces_of_text(text, limit)) == list(data.split_text(text, limit))

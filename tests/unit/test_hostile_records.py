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


# A long record is not parsed whole either (issue 29, item 5b): its text is decoded from the file (.jsonl) or from
# arrow's buffer (.parquet) in pieces, so what is held at once is a few pieces, whatever the record's size.

BIG = 4_000_000  # characters: a record whose whole parse would hold several copies of 4 MB
# bytes: the bound on what reading it may hold at once (2 MiB): the file's block, the stretch decoded from it and
# the pieces it is cut into, each of at most about DOC_CHUNK_CHARS characters, at up to 4 bytes a character
FEW_PIECES = 32 * data.DOC_CHUNK_CHARS


def peak_reading(docs) -> tuple[int, int]:
    """(characters read, peak bytes Python allocated while reading them) over every document of ``docs``."""
    import tracemalloc

    tracemalloc.start()
    try:
        size = 0
        for doc in docs:
            size += sum(map(len, doc)) if isinstance(doc, data.LongDocument) else len(doc)
        return size, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_long_jsonl_record_costs_a_few_pieces_of_memory_not_its_size(tmp_path):
    text = long_text(BIG) + " caf\u00e9 \U0001F600"  # newlines and non-ASCII, escaped in the file
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"id": 1, "text": text, "source": "x"}) + "\n", encoding="utf-8")
    del text
    size, peak = peak_reading(data._read_jsonl(path, "text"))
    assert size > BIG
    assert peak < FEW_PIECES, f"{peak:,} bytes held reading a record of {size:,} characters"


def test_a_long_parquet_value_costs_a_few_pieces_of_python_memory_not_its_size(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": ["short", long_text(BIG) + " caf\u00e9"]}), path)
    size, peak = peak_reading(data._read_parquet(path, "text"))  # arrow's own buffers are not Python's
    assert size > BIG
    assert peak < FEW_PIECES, f"{peak:,} bytes held reading a value of {size:,} characters"


ALPHABET = ["a", " ", "\n", '"', "\\", "/", "\t", "\x01", "\u00e9", "\u2028", "\U0001F600", "\ud83d", "\ude00", "word "]


def random_records(rng, limit: int) -> list[str]:
    """Lines of .jsonl whose text mixes every kind of escape (lone and paired surrogates, which json.dumps writes
    as \\uXXXX, control characters, quotes, backslashes), other fields before and after it, short and long."""
    lines = []
    for _ in range(rng.randint(1, 4)):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.choice([0, 3, limit, 3 * limit, 20 * limit])))
        other = {"id": rng.randint(0, 10 ** 6), "meta": {"a": [1, 2.5, None, True, "x" * rng.choice([0, 3 * limit])]}}
        record = {**other, "text": text} if rng.random() < 0.5 else {"text": text, **other}
        lines.append(json.dumps(record, ensure_ascii=rng.random() < 0.5).replace("\ud83d", "\\ud83d")
                     .replace("\ude00", "\\ude00"))  # a lone surrogate cannot be written as UTF-8
    return lines


def read_all(docs) -> list:
    return [list(d) if isinstance(d, data.LongDocument) else d for d in docs]


def test_long_jsonl_records_read_in_pieces_are_exactly_what_json_loads_gives(tmp_path):
    """Two hundred random records, read with pieces and blocks of a few characters, so that escapes, surrogate
    pairs and the cuts between pieces fall on every boundary: each text is json.loads's, cut as split_text cuts."""
    import random

    rng = random.Random(29)
    path = tmp_path / "r.jsonl"
    for _ in range(200):
        limit, block = rng.choice([8, 13, 40]), rng.choice([3, 5, 7, 16, 64])
        lines = random_records(rng, limit)
        path.write_text("\n".join(lines) + rng.choice(["", "\n", "\r\n"]), encoding="utf-8")
        expected = []
        for line in lines:
            text = json.loads(line)["text"]
            expected.append(text if len(text) <= limit else list(data.split_text(text, limit)))
        assert read_all(data._read_jsonl(path, "text", limit=limit, block=block)) == expected, (limit, block, lines)


def test_malformed_long_jsonl_records_are_refused_as_json_loads_refuses_them(tmp_path):
    """A long record damaged anywhere (a character dropped, added, or the line cut short) is refused in one line
    exactly where json.loads refuses the whole line, and read as json.loads reads it where that accepts it."""
    import random

    from memplan.errors import InputError

    rng = random.Random(5)
    path = tmp_path / "r.jsonl"
    for _ in range(300):
        limit, block = rng.choice([8, 20]), rng.choice([3, 7, 64])
        line = json.dumps({"id": 5, "text": 'ab\\"c\u00e9\U0001F600' * rng.randint(2, 6),
                           "m": [1, {"t": "x"}, None], "z": "q" * rng.choice([1, 30])})
        for _ in range(rng.randint(1, 2)):
            i = rng.randrange(len(line) + 1)
            edit = rng.random()
            line = (line[:i] + line[i + 1:] if edit < 0.4 else line[:i] if edit > 0.8
                    else line[:i] + rng.choice('{}[]",:\\ a1tnu\x01') + line[i:])
        path.write_text(line + "\n", encoding="utf-8")
        try:
            record = json.loads(line) if line.strip() else {"text": None}
            ok = isinstance(record, dict) and isinstance(record.get("text", 0), (str, type(None)))
        except ValueError:
            ok = False
        if ok:
            assert ["".join(d) if isinstance(d, data.LongDocument) else d
                    for d in data._read_jsonl(path, "text", limit=limit, block=block)] == (
                       [record["text"] or ""] if line.strip() else []), line
        else:
            with pytest.raises(InputError) as e:
                read_all(data._read_jsonl(path, "text", limit=limit, block=block))
            assert str(e.value).startswith(f"{path}:1: ") and "\n" not in str(e.value), line


def test_a_long_record_with_its_text_field_twice_is_refused_in_one_line(tmp_path):
    """json.loads keeps the second value; a long record's first has been read by then: refused, not guessed."""
    from memplan.errors import InputError

    path = tmp_path / "r.jsonl"
    path.write_text('{"text": "%s", "text": "again"}\n' % ("a " * 50), encoding="utf-8")
    with pytest.raises(InputError, match=r"r.jsonl:1: not a JSON object \(the field 'text' appears twice"):
        read_all(data._read_jsonl(path, "text", limit=20, block=8))
    path.write_text('{"text": "a", "text": "again"}\n', encoding="utf-8")  # a short one: json.loads's reading
    assert read_all(data._read_jsonl(path, "text", limit=60)) == ["again"]


def test_a_long_record_without_its_text_field_or_with_another_type_is_refused_as_a_short_one(tmp_path):
    from memplan.errors import InputError

    path = tmp_path / "r.jsonl"
    for record, message in (({"body": "x " * 50, "id": 1}, r"no 'text' field \(has: body, id\)"),
                            ({"text": list(range(40))}, r"field 'text' is list, not text"),
                            ([1] * 40, r"not a JSON object \(a long line that starts with '\['")):
        path.write_text(json.dumps(record) + "\n", encoding="utf-8")
        with pytest.raises(InputError, match=r"r.jsonl:1: " + message):
            read_all(data._read_jsonl(path, "text", limit=20, block=8))
    path.write_text(json.dumps({"text": None, "pad": "y" * 100}) + "\n" + " " * 100 + "\n", encoding="utf-8")
    assert read_all(data._read_jsonl(path, "text", limit=20, block=8)) == [""]  # null is empty; blank lines skipped


def test_long_parquet_values_read_in_pieces_are_exactly_arrows(tmp_path):
    """Values decoded a few bytes at a time (multi-byte characters split between blocks), nulls and short values
    among them, from string and large_string columns: each is arrow's value, cut as split_text cuts."""
    import random

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = random.Random(3)
    path = tmp_path / "r.parquet"
    letters = [c for c in ALPHABET if c not in ("\ud83d", "\ude00")]  # arrow holds UTF-8: no lone surrogates
    for kind in (pa.string(), pa.large_string()):
        values = ["".join(rng.choice(letters) for _ in range(rng.choice([0, 5, 30, 200]))) if rng.random() > 0.1
                  else None for _ in range(60)]
        pq.write_table(pa.table({"text": pa.array(values, type=kind)}), path)
        got = read_all(data._read_parquet(path, "text", limit=24, block=5))
        assert got == [(v or "") if len(v or "") <= 24 else list(data.split_text(v, 24)) for v in values]


# hf: datasets (issue 29, item 5b): the `datasets` library finds the split's files; .jsonl, .parquet and .txt files
# are read by the readers above, so a long record streams as it does from a local file. Local folder datasets
# (nothing can come from the Hub in tests).

def hf_folder(root, kind: str, texts: list) -> str:
    """A local folder dataset of one train file of ``kind`` holding ``texts`` (one record each)."""
    folder = root / kind
    (folder / "data").mkdir(parents=True)
    path = folder / "data" / f"train-00000-of-00001.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)),
                        encoding="utf-8")
    elif kind == "parquet":
        pa = pytest.importorskip("pyarrow")
        pytest.importorskip("pyarrow.parquet").write_table(pa.table({"text": texts, "id": list(range(len(texts)))}),
                                                           path)
    else:
        path.write_text("\n".join(texts), encoding="utf-8", newline="")
    return str(folder)


def records_of_load_dataset(name: str, field: str = "text") -> list:
    """What datasets.load_dataset(streaming=True) gives: the path hf: inputs took before."""
    datasets = pytest.importorskip("datasets")
    return read_all(data._read_hf_records(datasets, name, "train", field))


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt"])
def test_hf_folder_records_read_here_are_what_load_dataset_gives(tmp_path, kind, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    texts = ["a b", "", "caf\u00e9 \U0001F600 x", "line\u2028sep\u0085end", "z" * 300, "tab\there", "last one"]
    if kind != "txt":
        texts[2] += "\r\ny\rz"
        texts.insert(1, None)
    name = hf_folder(tmp_path, kind, texts)
    notes = []
    got = read_all(data._read_hf(name, "train", "text", on_note=notes.append))
    assert got == records_of_load_dataset(name) and not notes
    assert got == [t or "" for t in texts]
    cut = read_all(data._read_hf(name, "train", "text", limit=40, block=7))
    assert cut == [(t or "") if len(t or "") <= 40 else list(data.split_text(t, 40)) for t in texts]


def test_hf_folder_of_another_format_goes_through_load_dataset_with_a_note(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "train.csv").write_text("text,id\nhello there,1\n", encoding="utf-8")
    notes = []
    assert read_all(data._read_hf(str(tmp_path / "c"), "train", "text", on_note=notes.append)) == ["hello there"]
    assert len(notes) == 1 and "csv builder" in notes[0] and "whole" in notes[0], notes


def test_hf_folder_errors_stay_one_line(tmp_path, monkeypatch):
    from memplan.errors import InputError

    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for kind, message in (("jsonl", r"no 'body' field \(has: id, text\)"), ("parquet", r"no 'body' column"),
                          ("txt", r"no 'body' field \(has: text\)")):
        name = hf_folder(tmp_path, kind, ["one", "two"])
        with pytest.raises(InputError, match=rf"^hf:{name}: .*{message}.*--text-field$"):
            read_all(data._read_hf(name, "train", "body"))
    with pytest.raises(InputError, match=r"^hf:.*: could not load the dataset \(.*validation.*\); it needs"):
        read_all(data._read_hf(name, "validation", "text"))
    with pytest.raises(InputError, match=r"^hf:.*nowhere: could not load the dataset"):
        read_all(data._read_hf(str(tmp_path / "nowhere"), "train", "text"))


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt"])
def test_a_long_hf_record_costs_a_few_pieces_of_memory_not_its_size(tmp_path, kind, monkeypatch):
    """One record of 4 MB in a local folder dataset: read in pieces, whatever the format. The datasets library's
    resolution of the split's files is counted too (it is imported first: its modules are not the record's)."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = hf_folder(tmp_path, kind, ["short", long_text(BIG).replace("\n", " ") + " caf\u00e9"])  # one line
    datasets.load_dataset_builder(name)  # its modules imported and its caches made: not the record's cost
    size, peak = peak_reading(data._read_hf(name, "train", "text"))
    assert size > BIG
    assert peak < FEW_PIECES, f"{peak:,} bytes held reading a record of {size:,} characters"


def test_text_lines_read_in_pieces_are_the_lines_datasets_text_builder_gives(tmp_path):
    """Random text files (\\n, \\r\\n, a lone \\r, U+2028, empty and long lines, with or without a last newline)
    read with pieces and blocks of a few characters: each line is what datasets' text builder makes a record of
    (the file read with universal newlines, StringIO's readlines, the "\\n" stripped), a long one cut as split_text
    cuts."""
    import io
    import random

    rng = random.Random(11)
    path = tmp_path / "t.txt"
    letters = ["a", " ", "\n", "\r\n", "\r", "\u2028", "\u00e9", "word ", "\n\n"]
    for _ in range(200):
        limit, block = rng.choice([4, 9, 30]), rng.choice([2, 3, 7, 64])
        text = "".join(rng.choice(letters) for _ in range(rng.choice([0, 5, 40, 200])))
        path.write_text(text, encoding="utf-8", newline="")
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in io.StringIO(f.read()).readlines()]
        opened = lambda: open(path, encoding="utf-8", errors="replace")  # noqa: E731
        got = read_all(data._read_text_lines(str(path), "text", limit=limit, block=block, opened=opened))
        assert got == [line if len(line) <= limit else list(data.split_text(line, limit)) for line in lines], \
            (limit, block, text)

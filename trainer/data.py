"""Corpus preparation (text -> cleaned documents -> token shards + manifest) and the training data loader.

Preparing (``prepare``; the CLI is ``memplan prepare``)
------------------------------------------------------
1. Read every source (``resolve_inputs`` / ``embedded_sources``): .txt, .jsonl, .parquet files,
   directories of them, ``hf:NAME`` datasets, or the embedded corpus that ships with CPython. A .txt
   file that is not text (``binary_reason``) is skipped and reported.
2. Clean each document (``clean_text``), filter it (``filter_document``), and drop exact duplicates
   of documents already kept (by hash of the cleaned text, across all sources; the first one wins).
   A document longer than ``DOC_CHUNK_CHARS`` is read, cleaned (``PieceCleaner``), staged and
   tokenized in pieces cut where a pre-token starts (``cut_point``), so memory stays bounded by a
   piece whatever the document's size, and its ids are those of the whole.
3. Hold out the last ``val_fraction`` of each source (``val_split_point``): its last documents, or,
   when whole documents miss the fraction (one book, a few long files), the last ``val_fraction``
   of its text, cut at a space inside a document.
4. Train or load the tokenizer (BPE training sees the train documents only).
5. Tokenize in parallel; write each split as flat little-endian shards of ``uint16`` ids (``uint32``
   when an id can exceed 65,535), every document preceded by the end-of-text id, so a split reads
   ``EOT doc EOT doc ...``. Documents are written source by source, in reading order.
6. Write ``manifest.json`` (everything the loader needs, with sha256 of every file) and
   ``stats.json`` (per-source statistics). All of it goes into a temporary sibling directory that
   is renamed into place at the end, so an interrupted prepare leaves nothing half-written: an
   error, SIGTERM or SIGINT removes it, and what a ``kill -9`` leaves the next prepare into the same
   directory clears (``remove_stale_temp_dirs``).

Layout of a prepared directory::

    manifest.json        format, dtype, vocab_size, eot_id, tokenizer {kind, sha256, ...},
                         train/val {tokens, documents, shards: [{file, tokens, sha256}]},
                         sources: [{name, documents, tokens, train_tokens, val_offset, val_tokens, ...}]
    stats.json           per-source statistics (documents, characters, tokens, duplicates, filtered)
    tokenizer.json       the tokenizer (absent for tiktoken encodings, which are recorded by name)
    train-00000.bin ...  raw token ids, no header (np.memmap-able with the manifest's dtype)
    val-00000.bin ...

Loading (``PreparedData``, ``TrainStream``)
-------------------------------------------
``PreparedData(dir)`` checks the manifest and every shard's size on open (``verify()`` also checks
sha256). ``TrainStream`` yields seeded, resumable, rank-sliced (x, y) batches of the train split;
``PreparedData.val_batches`` yields fixed evaluation windows per source. Only these two import
torch, lazily, where batches become tensors.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import string
import sys
import sysconfig
import time
import tokenize as py_tokenize
import unicodedata
from bisect import bisect_right
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from memplan.errors import InputError
from memplan.fsutil import inside_name
from trainer.tokenizer import (EOT, Tokenizer, build_tokenizer, check_tiktoken_available,
                               file_sha256, parse_tokenizer_spec, token_dtype_name)

FORMAT_NAME = "memplan-tokens"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
STATS_FILE = "stats.json"

INPUT_EXTENSIONS = (".txt", ".jsonl", ".parquet")
DEFAULT_VAL_FRACTION = 0.05
MAX_VAL_FRACTION = 0.5  # above this, "held-out" would be most of the corpus
DEFAULT_MIN_CHARS = 32  # shorter documents are mostly one-line docstrings ("Return self.") or debris
MIN_TEXT_FRACTION = 0.5  # a document or line under half letters/digits/punctuation/space is not text
DEFAULT_SHARD_TOKENS = 1 << 27  # 134M tokens: 256 MiB per uint16 shard
DEFAULT_TOKENIZER_EMBEDDED = "bpe:4096"  # the embedded corpus is ~0.6M tokens; 4096 trains in a second
DEFAULT_TOKENIZER_INPUTS = "bpe:8192"
EMBEDDED_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo",
                                "site-packages", "dist-packages", "__pycache__"})

Progress = Callable[[str, int, "int | None"], None]  # (stage, done, total or None)


def default_workers() -> int:
    """min(4, the CPUs this process may run on)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


# =================================================================================================
# Cleaning and filtering
# =================================================================================================

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff]")  # Unicode Cc except \t \n, and the BOM
_INNER_WS = re.compile(r"[^\S\n]+")  # any whitespace run except newlines
_BLANK_RUN = re.compile(r"\n{4,}")  # 3+ blank lines (after trailing whitespace is gone)
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_ASCII_NON_TEXT = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_ASCII_PUNCT = frozenset(string.punctuation)


@dataclass(frozen=True, kw_only=True)
class CleanConfig:
    """How documents are filtered after cleaning."""

    min_chars: int = DEFAULT_MIN_CHARS  # documents shorter than this (after cleaning) are dropped
    min_text_fraction: float = MIN_TEXT_FRACTION  # for whole documents
    min_line_text_fraction: float = MIN_TEXT_FRACTION  # lines under this are removed from a document

    def __post_init__(self):
        if self.min_chars < 1:
            raise InputError(f"--min-chars: {self.min_chars} must be at least 1")
        for name in ("min_text_fraction", "min_line_text_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise InputError(f"{name}: {getattr(self, name)} must be in [0, 1]")


def clean_text(text: str) -> str:
    """Normalise one document.

    NFC normalisation; CR/CRLF become newlines; control characters other than newline and tab
    are removed (and the BOM); within each line, whitespace runs after the indentation collapse
    to one space (leading indentation is kept, so code blocks survive) and trailing whitespace
    goes; more than two blank lines in a row become two; whitespace at either end of the
    document goes (including the first line's indentation).
    """
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    lines = []
    for line in text.split("\n"):
        line = line.rstrip()
        body = line.lstrip()
        indent = line[: len(line) - len(body)]
        lines.append(indent + _INNER_WS.sub(" ", body))
    text = _BLANK_RUN.sub("\n\n\n", "\n".join(lines))
    return text.strip()


@lru_cache(maxsize=65536)
def _is_text_char(ch: str) -> bool:
    if ch in "\n\t" or ch.isspace() or ch.isalnum() or ch in _ASCII_PUNCT:
        return True
    return unicodedata.category(ch).startswith("P")


def text_fraction(text: str) -> float:
    """The fraction of characters that are letters, digits, punctuation or whitespace.

    Punctuation is Unicode's P* categories plus all ASCII punctuation (so ``=``, ``+``, ``|``
    count, as in code). What does not count: control characters, non-ASCII symbols (box drawing,
    emoji, math), the replacement character U+FFFD left by bad UTF-8, private-use code points.
    An empty string is 1.0.
    """
    if not text:
        return 1.0
    return 1.0 - non_text_count(text) / len(text)


def non_text_count(text: str) -> int:
    """How many characters of ``text`` are not text (what ``text_fraction`` counts against)."""
    if text.isascii():
        return len(_ASCII_NON_TEXT.findall(text))
    return len(_ASCII_NON_TEXT.findall(text)) + sum(1 for ch in _NON_ASCII.findall(text) if not _is_text_char(ch))


def drop_nontext_lines(text: str, min_fraction: float = MIN_TEXT_FRACTION) -> str:
    """``text`` without the lines whose ``text_fraction`` is under ``min_fraction`` (blank lines kept)."""
    if text.isascii() and not _ASCII_NON_TEXT.search(text):
        return text  # fast path: every printable ASCII character is text
    kept = [line for line in text.split("\n") if not line.strip() or text_fraction(line) >= min_fraction]
    return _BLANK_RUN.sub("\n\n\n", "\n".join(kept)).strip("\n")


def filter_document(raw: str, config: CleanConfig = CleanConfig()) -> tuple[str | None, str | None]:
    """``(cleaned_text, None)`` for a kept document, or ``(None, reason)``: reason "nontext" or "short"."""
    text = clean_text(raw)
    if text_fraction(text) < config.min_text_fraction:
        return None, "nontext"
    text = drop_nontext_lines(text, config.min_line_text_fraction)
    if len(text) < config.min_chars:
        return None, "short"
    return text, None


def document_hash(text: str) -> bytes:
    """A 128-bit hash of a cleaned document, for exact-duplicate removal."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


class Deduplicator:
    """Remembers hashes of documents kept so far; ``seen(text)`` is True for an exact repeat."""

    def __init__(self):
        self._hashes: set[bytes] = set()

    def seen(self, text: str) -> bool:
        return self.seen_digest(document_hash(text))

    def seen_digest(self, h: bytes) -> bool:
        """``seen`` for a document whose ``document_hash`` is ``h``."""
        if h in self._hashes:
            return True
        self._hashes.add(h)
        return False


# =================================================================================================
# Long documents, in pieces
# =================================================================================================

# A longer document is read, cleaned, staged and tokenized in pieces of at most this many characters. Its
# cost beyond the same text as short documents is ~220 bytes per character of a piece (the tokenizers
# library's per-sequence state while encoding; benchmarks/prepare_memory.py): ~14 MiB, whatever its size.
DOC_CHUNK_CHARS = 1 << 16


def cut_point(text: str, limit: int) -> int:
    """Where to cut ``text`` so the head holds at most ``limit`` characters (``len(text)`` when it fits).

    Just after the last newline that no space or tab follows; else just before the last run of spaces
    or tabs that follows a non-space. Both are where GPT-2's byte-level pre-tokenizer starts a new
    pre-token, and BPE merges never cross a pre-token, so the two halves encode to exactly the ids
    the whole would. A stretch of ``limit`` characters without such a place is cut at ``limit``.
    Always in [1, limit] for a text longer than ``limit`` >= 1.
    """
    if len(text) <= limit:
        return len(text)
    nl = text.rfind("\n", 0, limit)
    while nl >= 0 and text[nl + 1] in " \t":
        nl = text.rfind("\n", 0, nl)
    if nl >= 0:
        return nl + 1
    p = max(text.rfind(" ", 0, limit), text.rfind("\t", 0, limit))
    while p > 0 and text[p - 1] in " \t":
        p -= 1
    return p if p > 0 else limit


def split_text(text: str, limit: int) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``limit`` characters, cut by ``cut_point``."""
    while len(text) > limit:
        p = cut_point(text, limit)
        yield text[:p]
        text = text[p:]
    if text:
        yield text


class LongDocument:
    """A document longer than the chunk size: its raw text as an iterator of pieces of at most about
    ``DOC_CHUNK_CHARS`` characters, each cut by ``cut_point``. Iterate it once."""

    def __init__(self, pieces: Iterable[str]):
        self._pieces = iter(pieces)

    def __iter__(self) -> Iterator[str]:
        return self._pieces


def documents_of_stream(blocks: Iterable[str], limit: int = DOC_CHUNK_CHARS) -> Iterator["str | LongDocument"]:
    """The documents of a text stream (blocks of at most ``limit`` characters) separated by
    ``<|endoftext|>``: each as a str, or as a ``LongDocument`` once it exceeds ``limit`` characters
    (consume it before asking for the next document). At most about 2 × ``limit`` characters are
    held, whatever the document sizes. Blank documents are skipped."""
    stream = _pieces_of_stream(blocks, limit)
    for first in stream:
        if first is None:
            continue  # an empty document
        head, size, ended = [first], len(first), False
        while size <= limit:
            piece = next(stream, None)
            if piece is None:
                ended = True
                break
            head.append(piece)
            size += len(piece)
        if ended:
            text = "".join(head)
            if text.strip():
                yield text
            continue
        rest = _until_document_end(stream)
        yield LongDocument(_chain(head, rest))
        for _ in rest:  # the consumer stopped early: skip what is left of this document
            pass


def _pieces_of_stream(blocks: Iterable[str], limit: int) -> Iterator[str | None]:
    """Pieces of documents (each at most ``limit`` characters) and None after each document's last piece."""
    carry = ""
    keep = len(EOT) - 1  # an end-of-text marker may straddle two blocks
    for block in blocks:
        parts = (carry + block).split(EOT)
        for part in parts[:-1]:
            yield from split_text(part, limit)
            yield None
        rest = parts[-1]
        while len(rest) > limit + keep:
            p = cut_point(rest, limit)
            yield rest[:p]
            rest = rest[p:]
        carry = rest
    yield from split_text(carry, limit)
    yield None


def _until_document_end(stream: Iterator[str | None]) -> Iterator[str]:
    for piece in stream:
        if piece is None:
            return
        yield piece


def _chain(head: list[str], rest: Iterator[str]) -> Iterator[str]:
    while head:
        yield head.pop(0)
    yield from rest


class PieceCleaner:
    """``filter_document`` for a document that arrives in pieces (cut by ``cut_point``), in memory
    bounded by a piece.

    ``feed(piece)`` returns the cleaned text of that stretch: the concatenation over all pieces is
    exactly ``clean_text`` followed by ``drop_nontext_lines`` of the whole document, except that a
    line longer than a piece is judged for ``min_line_text_fraction`` one piece at a time (and a
    stretch without whitespace cut mid-word may normalise slightly differently at the cut).
    ``finish()`` gives the drop reason ("nontext" / "short") or None; ``characters`` and ``digest``
    (``document_hash`` of the cleaned text) describe what was returned.
    """

    def __init__(self, config: CleanConfig):
        self.config = config
        self.characters = 0
        self._hash = hashlib.blake2b(digest_size=16)
        self._cr = False  # the last piece ended with a carriage return
        self._in_line = False  # cleaning: the last piece ended inside a line
        self._trailing = ""  # ... and this whitespace of it is not cleaned yet
        self._cleaned = _LineJoiner(strip_start=True)  # clean_text's joining of lines
        self._cleaned_chars = 0
        self._bad_chars = 0
        self._line_state = "start"  # line dropping: at a line's start, or inside a line "kept" / "dropped"
        self._kept = _LineJoiner(strip_start=False)  # drop_nontext_lines' joining of kept lines

    def feed(self, raw: str) -> str:
        if self._cr and raw.startswith("\n"):
            raw = raw[1:]  # the second half of a CRLF split between pieces
        self._cr = raw.endswith("\r")
        raw = _CONTROL.sub("", unicodedata.normalize("NFC", raw.replace("\r\n", "\n").replace("\r", "\n")))
        cleaned = []
        parts = raw.split("\n")
        parts[0] = self._trailing + parts[0]
        self._trailing = ""
        for i, seg in enumerate(parts):
            ends = i < len(parts) - 1
            if not ends:  # the line goes on in the next piece: hold back its trailing whitespace
                body = seg.rstrip()
                seg, self._trailing = body, seg[len(body):][-4096:]
                if not seg:
                    continue
            if not self._in_line:  # a line starts: keep its indentation (clean_text)
                line = seg.rstrip() if ends else seg
                body = line.lstrip()
                text = line[: len(line) - len(body)] + _INNER_WS.sub(" ", body)
            else:
                text = _INNER_WS.sub(" ", seg)
                if ends:
                    text = text.rstrip()
            cleaned.append(self._cleaned.add(text, ends))
            self._in_line = not ends
        cleaned_text = "".join(cleaned)
        self._cleaned_chars += len(cleaned_text)
        self._bad_chars += non_text_count(cleaned_text)
        out = self._drop_lines(cleaned_text)
        self.characters += len(out)
        self._hash.update(out.encode("utf-8"))
        return out

    def _drop_lines(self, cleaned: str) -> str:
        """drop_nontext_lines on a stretch of cleaned text; a line continued from an earlier stretch
        (its newline comes late: ``_LineJoiner`` writes it before the next line) keeps its verdict."""
        if not cleaned:
            return ""
        out = []
        parts = cleaned.split("\n")
        for i, seg in enumerate(parts):
            ends = i < len(parts) - 1
            if not ends and not seg:
                continue
            state = self._line_state
            if state != "start" and not seg:  # the end of a line judged already
                if state == "kept":
                    out.append(self._kept.add("", True))
            elif not seg.strip() or text_fraction(seg) >= self.config.min_line_text_fraction:
                out.append(self._kept.add(seg, ends))
                state = "kept"
            elif state == "kept" and ends:  # the rest of a long line dropped: its newline stays
                out.append(self._kept.add("", True))
            elif state == "start":
                state = "dropped"
            self._line_state = "start" if ends else state
        return "".join(out)

    def finish(self) -> str | None:
        if self._cleaned_chars and 1.0 - self._bad_chars / self._cleaned_chars < self.config.min_text_fraction:
            return "nontext"
        if self.characters < self.config.min_chars:
            return "short"
        return None

    @property
    def digest(self) -> bytes:
        return self._hash.digest()


class _LineJoiner:
    """Joins line segments as ``clean_text`` does: at most three newlines in a row (two blank lines),
    none at either end; with ``strip_start`` the whitespace before the first character goes too."""

    def __init__(self, *, strip_start: bool):
        self.strip_start = strip_start
        self.started = False
        self.owed = 0  # newlines to write before the next character

    def add(self, text: str, ends_line: bool) -> str:
        out = ""
        if text:
            if not self.started:
                if self.strip_start:
                    text = text.lstrip()
                if text:
                    self.started, out = True, text
            else:
                out = "\n" * min(self.owed, 3) + text
                self.owed = 0
        if ends_line and self.started:
            self.owed += 1
        return out


# =================================================================================================
# Sources
# =================================================================================================

@dataclass(frozen=True, kw_only=True)
class Source:
    """One named source of documents. ``documents()`` yields raw (uncleaned) texts in a fixed order."""

    name: str
    kind: str  # "files" | "hf" | "pydoc" | "stdlib-docstrings"
    origin: str  # what the user gave (a path, hf:NAME) or where the embedded text comes from
    paths: tuple[Path, ...] = ()  # for "files": every file, in reading order
    text_field: str = "text"  # for .jsonl, .parquet and hf datasets
    hf_split: str = "train"

    def documents(self, workers: int = 1, *, on_skip: Callable[[Path, str], None] | None = None,
                  chunk_chars: int = 0, on_note: Callable[[str], None] | None = None) -> Iterator["str | LongDocument"]:
        """Raw documents; a .txt file that is not text (``binary_reason``) is skipped, and ``on_skip(path,
        reason)`` told. A file that vanishes or cannot be read is an ``InputError`` naming it. ``on_note``: told,
        one line, where an ``hf:`` dataset's records arrive whole (``_read_hf``)."""
        if self.kind == "files":
            for path in self.paths:
                try:
                    if path.suffix.lower() == ".txt":
                        reason = binary_reason(path)
                        if reason is not None:
                            if on_skip is not None:
                                on_skip(path, reason)
                            continue
                        yield from _read_txt(path, self.text_field, chunk_chars)
                    else:
                        yield from _READERS[path.suffix.lower()](path, self.text_field)
                except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as e:
                    why = "it vanished" if isinstance(e, FileNotFoundError) else (e.strerror or type(e).__name__)
                    raise InputError(f"--input {path}: cannot read it while preparing ({why}); check the file and "
                                     "run prepare again") from None
        elif self.kind == "hf":
            yield from _read_hf(self.origin, self.hf_split, self.text_field, on_note=on_note)
        elif self.kind == "pydoc":
            yield from _pydoc_topics()
        elif self.kind == "stdlib-docstrings":
            yield from _stdlib_docstrings(workers)
        else:
            raise ValueError(f"unknown source kind {self.kind!r}")


BINARY_SNIFF_BYTES = 1 << 16  # the head of a .txt file looked at to tell text from binary
MAX_INVALID_UTF8_SHARE = 0.1  # more undecodable bytes than this in the head: not UTF-8 text


def binary_reason(path: Path) -> str | None:
    """Why ``path`` is not a text file, from its first ``BINARY_SNIFF_BYTES``: NUL bytes (executables,
    images, archives, UTF-16) or more than ``MAX_INVALID_UTF8_SHARE`` of it undecodable as UTF-8.
    None for text."""
    with open(path, "rb") as f:
        head = f.read(BINARY_SNIFF_BYTES)
    if b"\0" in head:
        return f"NUL bytes in its first {len(head):,} bytes"
    text = head.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - head.decode("utf-8", errors="ignore").count("\ufffd")
    if len(head) == BINARY_SNIFF_BYTES:  # a multi-byte character cut at the end is not an error
        bad = max(0, bad - 1)
    if head and bad > MAX_INVALID_UTF8_SHARE * len(text):
        return f"{bad:,} of its first {len(head):,} bytes are not UTF-8"
    return None


def _read_txt(path: Path, text_field: str, chunk_chars: int = 0) -> Iterator["str | LongDocument"]:
    """A .txt file is one document, or several separated by ``<|endoftext|>`` (as TinyStories ships).

    Read in blocks of ``chunk_chars`` (default ``DOC_CHUNK_CHARS``); a document longer than that
    comes as a ``LongDocument`` (``documents_of_stream``), so no line or document is held whole.
    """
    limit = chunk_chars or DOC_CHUNK_CHARS
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        yield from documents_of_stream(iter(lambda: f.read(limit), ""), limit)


def pieces_of_text(text: str, limit: int) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``limit`` characters, each cut by ``cut_point``, sliced by
    position (no copy of the rest per piece: ``split_text``'s would be quadratic in a 50 MB record)."""
    start, n = 0, len(text)
    while n - start > limit:
        p = cut_point(text[start:start + limit + 1], limit)
        yield text[start:start + p]
        start += p
    if start < n:
        yield text[start:]


def as_document(text: str, limit: int = DOC_CHUNK_CHARS) -> "str | LongDocument":
    """A record's text (.jsonl, .parquet, hf:) as a document: itself, or, longer than ``limit`` characters,
    a ``LongDocument`` of its pieces, so that it is cleaned, staged and tokenized in pieces as a long .txt
    document is, instead of whole (one 50 MB record cost its size many times over)."""
    return text if len(text) <= limit else LongDocument(pieces_of_text(text, limit))


def _nonblank(texts: Iterable[str]) -> Iterator[str]:
    return (t for t in texts if t.strip())


def _read_jsonl(path: Path, text_field: str, *, limit: int = DOC_CHUNK_CHARS,
                block: int = DOC_CHUNK_CHARS, opened: Callable[[], object] | None = None
                ) -> Iterator["str | LongDocument"]:
    """One JSON object per line (lines end at ``\\n``, ``\\r\\n`` or ``\\r``); the document is its ``text_field``. Blank lines are
    skipped. A line longer than ``limit`` characters is never held whole: its text comes in pieces as a long
    .txt document's does (``trainer.json_pieces``), the file read ``block`` characters at a time. ``opened``:
    the file opened as text (a context manager), where it is not a local path (an ``hf:`` dataset's)."""
    from trainer import json_pieces

    def record_of(text: str, lineno: int) -> dict:
        try:
            record = json.loads(text)
        except ValueError as e:
            raise InputError(f"{path}:{lineno}: not a JSON object ({e.msg}); a .jsonl file holds one "
                             "JSON object per line") from None
        if not isinstance(record, dict) or text_field not in record:
            fields = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
            raise InputError(f"{path}:{lineno}: no {text_field!r} field (has: {fields}); name the text "
                             "field with --text-field")
        return record

    def value_of(record: dict, lineno: int) -> str:
        value = record[text_field]
        if value is None:
            return ""
        if not isinstance(value, str):
            raise InputError(f"{path}:{lineno}: field {text_field!r} is {type(value).__name__}, not text; "
                             "name the text field with --text-field")
        return value

    def short(line: str, lineno: int) -> "str | LongDocument":
        return as_document(value_of(record_of(line, lineno), lineno), limit)

    def long_end(skeleton: str, lineno: int) -> str:
        return value_of(record_of(skeleton, lineno), lineno)

    def error(lineno: int, msg: str) -> None:
        raise InputError(f"{path}:{lineno}: not a JSON object ({msg}); a .jsonl file holds one JSON object per "
                         "line")

    with (opened() if opened else open(path, encoding="utf-8", errors="replace")) as f:
        yield from json_pieces.jsonl_records(f, text_field=text_field, limit=limit, block=block,
                                             cut_point=cut_point, long_document=LongDocument, on_short=short,
                                             on_long=long_end, on_error=error)


def _read_parquet(path: Path, text_field: str, *, limit: int = DOC_CHUNK_CHARS,
                  block: int = DOC_CHUNK_CHARS, opened: Callable[[], object] | None = None
                  ) -> Iterator["str | LongDocument"]:
    """The ``text_field`` column of a parquet file, a value at a time; a value longer than ``limit`` characters
    comes in pieces decoded from arrow's buffer ``block`` bytes at a time (``trainer.json_pieces``), never as one
    Python string (pyarrow still holds its row group's column as it read it). ``opened``: the file opened as
    bytes (a context manager), where it is not a local path (an ``hf:`` dataset's)."""
    pq = _pyarrow_parquet(path)
    with (opened() if opened else contextlib.nullcontext(path)) as f:
        yield from _parquet_values(pq, f, path, text_field, limit, block)


def _parquet_values(pq, f, path, text_field: str, limit: int, block: int) -> Iterator["str | LongDocument"]:
    from trainer import json_pieces

    try:
        pf = pq.ParquetFile(f)
    except Exception as e:
        raise InputError(f"{path}: not a readable parquet file ({_first_line(e)})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise InputError(f"{path}: no {text_field!r} column (has: {', '.join(names)}); name the text "
                         "column with --text-field")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for value in json_pieces.parquet_values(batch.column(0), limit=limit, block=block, cut_point=cut_point,
                                                long_document=LongDocument):
            if value is not None and not isinstance(value, (str, LongDocument)):
                raise InputError(f"{path}: column {text_field!r} is not text; name the text column with --text-field")
            yield value if isinstance(value, LongDocument) else as_document(value or "", limit)


def _pyarrow_parquet(path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    return pq


_READERS = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}


def _read_hf(name: str, split: str, text_field: str, *, limit: int = DOC_CHUNK_CHARS, block: int = DOC_CHUNK_CHARS,
             on_note: Callable[[str], None] | None = None) -> Iterator["str | LongDocument"]:
    """The records of the dataset ``name``'s ``split``, their ``text_field`` each. The `datasets` library finds the
    split's files (``load_dataset_builder``: a local directory of data files or a Hub dataset); where they are
    .jsonl, .parquet or .txt files its json, parquet or text builder reads with its default options, they are
    read here (``_read_jsonl``, ``_read_parquet``, ``json_pieces.text_lines``), opened through `datasets`' own
    file opening (Hub files stream), so a record longer than ``limit`` characters comes in pieces and is never
    held whole. Any other split (.json, .csv, compressed files, builder options, a cache of arrow files) goes
    through ``datasets.load_dataset(..., streaming=True)``, whose records arrive whole; ``on_note`` is told."""
    datasets = _datasets_module(name)
    try:
        files = _hf_split_files(datasets, name, split, text_field)
    except InputError:
        raise
    except Exception as e:
        raise _hf_unloadable(name, e) from None
    if isinstance(files, str):
        if files and on_note is not None:
            on_note(f"hf:{name}: {files}; its records come whole from the datasets library, not in pieces "
                    "(a long record costs its size several times over)")
        yield from _read_hf_records(datasets, name, split, text_field)
        return
    for url, reader, opened in files:
        try:
            yield from reader(url, text_field, limit=limit, block=block, opened=opened)
        except InputError as e:
            raise InputError(f"hf:{name}: {e}") from None
        except Exception as e:
            raise _hf_unloadable(name, e) from None


def _read_text_lines(path: str, text_field: str, *, limit: int, block: int,
                     opened: Callable[[], object]) -> Iterator["str | LongDocument"]:
    """Each line of a text file, one record each, as `datasets`' text builder reads it (``json_pieces.text_lines``)."""
    from trainer import json_pieces

    with opened() as f:
        yield from json_pieces.text_lines(f, limit=limit, block=block, cut_point=cut_point,
                                          long_document=LongDocument)


# The `datasets` builders whose files memplan reads itself: builder -> (the file ending read, the reader, the
# builder's options that must be at their defaults for it to read what the builder would).
_HF_READ_HERE = {"json": (".jsonl", _read_jsonl, {"field": None, "features": None, "encoding": "utf-8"}),
                 "parquet": (".parquet", _read_parquet, {"features": None, "columns": None, "filters": None}),
                 "text": (".txt", _read_text_lines, {"features": None, "sample_by": "line", "keep_linebreaks": False,
                                                     "encoding": "utf-8"})}


def _hf_split_files(datasets, name: str, split: str, text_field: str):
    """[(file, reader, opener)] for the split's files where ``_HF_READ_HERE`` reads them all, else a str that says
    why not (the split then goes through ``datasets.load_dataset``; "": no files to say it of)."""
    builder = datasets.load_dataset_builder(name)
    kind = type(builder).__module__.rsplit(".", 1)[-1]
    data_files = getattr(builder.config, "data_files", None) or {}
    files = next((list(v) for k, v in data_files.items() if str(k) == split), None)
    if not files:
        return ""  # no such split here (load_dataset says so), or no data files: a cache of arrow files
    if kind not in _HF_READ_HERE:
        return f"split {split!r} is read by datasets' {kind} builder"
    ending, reader, defaults = _HF_READ_HERE[kind]
    changed = [k for k, v in defaults.items() if getattr(builder.config, k, v) != v]
    other = next((f for f in files if not str(f).lower().endswith(ending)), None)
    if changed or other is not None:
        return (f"split {split!r}'s file {str(other).rsplit('/', 1)[-1]!r} is not {ending}" if other is not None
                else f"its {kind} builder sets {', '.join(changed)}")
    if kind == "text" and text_field != "text":
        raise InputError(f"hf:{name}: no {text_field!r} field (has: text); name the text field with --text-field")
    from datasets.download.download_config import DownloadConfig

    config = DownloadConfig(token=builder.token, storage_options=builder.storage_options)
    binary = kind == "parquet"
    return [(str(f), reader, _hf_opener(datasets, str(f), config, binary)) for f in files]


def _hf_opener(datasets, url: str, config, binary: bool) -> Callable[[], object]:
    """A function that opens the data file ``url`` (a local path, or a Hub or http URL that streams) through
    `datasets`' own ``xopen``: as bytes, or as UTF-8 text with universal newlines (as its builders read it)."""
    import io

    from datasets.utils.file_utils import xopen

    def opened():
        f = xopen(url, "rb", download_config=config)
        return f if binary else io.TextIOWrapper(f, encoding="utf-8", errors="replace")

    return opened


def _read_hf_records(datasets, name: str, split: str, text_field: str) -> Iterator["str | LongDocument"]:
    """The split's records through ``datasets.load_dataset(..., streaming=True)``: each arrives whole."""
    try:
        ds = datasets.load_dataset(name, split=split, streaming=True)
        for i, record in enumerate(ds):
            if text_field not in record:
                raise InputError(f"hf:{name}: no {text_field!r} field (has: {', '.join(record)}); "
                                 "name the text field with --text-field")
            value = record[text_field] or ""
            yield as_document(value) if isinstance(value, str) else value
    except InputError:
        raise
    except Exception as e:
        raise _hf_unloadable(name, e) from None


def _hf_unloadable(name: str, e: BaseException) -> InputError:
    return InputError(f"hf:{name}: could not load the dataset ({type(e).__name__}: {_first_line(e)}); "
                      "it needs a network or a populated HF_DATASETS_CACHE")


def _datasets_module(name: str):
    try:
        import datasets
    except ImportError:
        raise InputError(f"--input hf:{name}: needs the `datasets` package (pip install datasets) and a "
                         "network; or give local .txt/.jsonl/.parquet files") from None
    return datasets


def _pydoc_topics() -> Iterator[str]:
    """The help topics CPython ships (``help('FORMATTING')``), one document each, by topic name."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def stdlib_source_files() -> list[Path]:
    """The standard library's .py files, in a fixed order, minus tests, IDLE, tkinter and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EMBEDDED_SKIP_DIRS and not d.startswith("."))
        files.extend(Path(directory) / n for n in sorted(names) if n.endswith(".py"))
    return files


def docstrings_of_file(path: Path) -> list[str]:
    """Module, class and function docstrings of one .py file, parsed with ast (never imported)."""
    try:
        with py_tokenize.open(path) as f:
            tree = ast.parse(f.read(), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                docs.append(doc)
    return docs


def _stdlib_docstrings(workers: int) -> Iterator[str]:
    for docs in ordered_map(docstrings_of_file, stdlib_source_files(), workers):
        yield from docs


def embedded_sources() -> list[Source]:
    """The default corpus: CPython's pydoc topics and the stdlib's docstrings; no network needed."""
    version = f"CPython {sys.version.split()[0]}"
    return [
        Source(name="pydoc", kind="pydoc", origin=f"pydoc_data.topics ({version})"),
        Source(name="stdlib-docstrings", kind="stdlib-docstrings",
               origin=f"docstrings of {sysconfig.get_paths()['stdlib']} ({version})"),
    ]


def resolve_inputs(inputs: Sequence[str], *, text_field: str = "text") -> list[Source]:
    """Sources for ``--input`` values, checked before any work starts.

    A file is one source named by its stem; a directory is one source named after it, holding
    every .txt/.jsonl/.parquet file under it (recursively, sorted by path, hidden files skipped);
    ``hf:NAME`` or ``hf:NAME:SPLIT`` is a Hugging Face dataset. Two sources with the same name
    become ``name`` and ``name-2``.
    """
    if not text_field:
        raise InputError("--text-field: must not be empty; the default is 'text'")
    sources: list[Source] = []
    names: set[str] = set()
    for raw in inputs:
        if raw.startswith("hf:"):
            ref = raw[3:]
            name, _, split = ref.partition(":")
            if not name:
                raise InputError(f"--input {raw!r}: give a dataset name, e.g. hf:roneneldan/TinyStories")
            _datasets_module(name)
            source = Source(name=_unique(name.rstrip("/").split("/")[-1], names), kind="hf", origin=name,
                            text_field=text_field, hf_split=split or "train")
        else:
            path = Path(raw).expanduser()
            if path.is_dir():
                files = tuple(sorted((p for p in path.rglob("*") if p.is_file()
                                      and p.suffix.lower() in INPUT_EXTENSIONS
                                      and not any(part.startswith(".") for part in p.relative_to(path).parts)),
                                     key=lambda p: p.relative_to(path).as_posix()))
                if not files:
                    raise InputError(f"--input {raw}: the directory holds no {', '.join(INPUT_EXTENSIONS)} files")
                stem = path.resolve().name or "input"
            elif path.is_file():
                if path.suffix.lower() not in INPUT_EXTENSIONS:
                    raise InputError(f"--input {raw}: unknown extension {path.suffix or '(none)'!r}; accepted: "
                                     f"{', '.join(INPUT_EXTENSIONS)}, a directory of them, or hf:NAME")
                files = (path,)
                stem = path.stem
            else:
                raise InputError(f"--input {raw}: no such file or directory")
            if any(f.suffix.lower() == ".parquet" for f in files):
                _pyarrow_parquet(next(f for f in files if f.suffix.lower() == ".parquet"))
            source = Source(name=_unique(stem, names), kind="files", origin=raw, paths=files,
                            text_field=text_field)
        sources.append(source)
    if not sources:
        raise InputError("--input: no inputs given")
    return sources


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{name}-{n}"
    taken.add(candidate)
    return candidate


# =================================================================================================
# Parallel map that keeps order
# =================================================================================================

def ordered_map(func, items: Iterable, workers: int, *, initializer=None, initargs=()) -> Iterator:
    """``map(func, items)`` in order, over ``workers`` forked processes when workers > 1.

    At most ``2 × workers`` items are in flight, so a long iterable is never held in memory.
    Uses the "fork" start method (the children need nothing re-imported, and the ``python -m
    memplan`` entry point must not re-run in them); where fork is missing (Windows) it runs
    in-process. ``func`` must be a module-level function. A worker that dies (killed, out of
    memory) raises ``BrokenProcessPool`` here: ``concurrent.futures`` notices a lost worker, where
    ``multiprocessing.Pool`` waits for its result forever.
    """
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    if workers <= 1 or "fork" not in mp.get_all_start_methods():
        if initializer is not None:
            initializer(*initargs)
        yield from map(func, items)
        return
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"), initializer=_pool_child_init,
                               initargs=(initializer, initargs))
    try:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(func, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _pool_child_init(initializer, initargs) -> None:
    """A forked worker: default signal handling (a parent's handler that raises must not run here), then
    the caller's initializer."""
    _default_signals()
    if initializer is not None:
        initializer(*initargs)


# =================================================================================================
# Preparing
# =================================================================================================

@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """Everything ``prepare`` needs besides the sources and the output directory."""

    tokenizer: str = DEFAULT_TOKENIZER_INPUTS  # bpe:N | a tokenizer.json path | gpt2
    val_fraction: float = DEFAULT_VAL_FRACTION  # the last this-fraction of each source's documents
    workers: int = field(default_factory=default_workers)  # processes for parsing and tokenizing
    clean: CleanConfig = CleanConfig()
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # tokens per shard file, at most
    max_docs: int | None = None  # keep at most this many documents per source (after filtering)
    chunk_chars: int = DOC_CHUNK_CHARS  # longer documents are read, cleaned, staged and tokenized in pieces

    def __post_init__(self):
        if not (isinstance(self.val_fraction, (int, float)) and 0.0 <= self.val_fraction <= MAX_VAL_FRACTION):
            raise InputError(f"--val-fraction: {self.val_fraction} is outside [0, {MAX_VAL_FRACTION}]; "
                             "use e.g. 0.05 (0 holds nothing out)")
        if self.workers < 1:
            raise InputError(f"--workers: {self.workers} must be at least 1")
        if self.shard_tokens < 1:
            raise InputError(f"--shard-tokens: {self.shard_tokens} must be at least 1")
        if self.max_docs is not None and self.max_docs < 1:
            raise InputError(f"--max-docs: {self.max_docs} must be at least 1")
        if self.chunk_chars < 1:
            raise InputError(f"chunk_chars: {self.chunk_chars} must be at least 1")


@dataclass(kw_only=True)
class SourceStats:
    """Per-source corpus statistics. ``tokens`` counts every id written, one end-of-text per document included."""

    name: str
    origin: str
    documents: int = 0  # kept
    characters: int = 0  # of kept documents, after cleaning
    tokens: int = 0
    train_documents: int = 0
    val_documents: int = 0
    train_tokens: int = 0
    val_tokens: int = 0
    train_offset: int = 0  # where this source starts in the train split, in tokens
    val_offset: int = 0  # ... and in the val split
    duplicates_dropped: int = 0  # exact repeats of a document kept earlier (in any source)
    filtered_short: int = 0  # under min_chars after cleaning
    filtered_nontext: int = 0  # mostly not text
    skipped_files: list = field(default_factory=list)  # [path, reason] of .txt files that are not text
    val_split: str = "none"  # how the held-out split was cut: "documents", "window" or "none" (val_split_point)
    val_start_document: int = 0  # the held-out split starts at this document ...
    val_start_char: int = 0  # ... at this character of it (0 for a split between documents)

    @property
    def filtered_dropped(self) -> int:
        return self.filtered_short + self.filtered_nontext

    def to_dict(self) -> dict:
        return {**asdict(self), "filtered_dropped": self.filtered_dropped}


@dataclass(frozen=True, kw_only=True)
class PrepareResult:
    """What ``prepare`` made. ``seconds`` holds wall times per stage (also in no file: they vary)."""

    out: Path
    manifest: dict
    stats: list[SourceStats]
    seconds: dict[str, float]


def val_document_count(documents: int, val_fraction: float) -> int:
    """How many of a source's last documents are held out: round(documents × fraction), at least one
    when the source has two or more documents and the fraction is positive, and never all of them."""
    if documents < 2 or val_fraction <= 0:
        return 0
    n = math.floor(documents * val_fraction + 0.5)
    return min(max(1, n), documents - 1)


VAL_SPLIT_TOLERANCE = 0.2  # a split between documents may miss the fraction by this share of it


def val_split_point(lengths: Sequence[int], val_fraction: float) -> tuple[int, int, str]:
    """Where a source's held-out split starts: ``(document k, character c of it, how)``; everything from
    character c of document k on is held out. ``lengths`` are the documents' characters, in order.

    "documents": the last ``val_document_count`` documents (c = 0), when their share of the source's
    characters is within ``VAL_SPLIT_TOLERANCE`` × fraction of the fraction.
    "window": otherwise (one document, a few, or a long last one): the last ``val_fraction`` of the
    source's characters, cut inside document k at character c = total × (1 − fraction) − start of k
    (moved to the nearest space before it when the text is read, so within a word of the fraction).
    "none": a fraction of 0 or an empty source (k = the number of documents).
    """
    n, total = len(lengths), sum(lengths)
    if val_fraction <= 0 or total == 0:
        return n, 0, "none"
    n_val = val_document_count(n, val_fraction)
    if n_val:
        share = sum(lengths[n - n_val:]) / total
        if abs(share - val_fraction) <= VAL_SPLIT_TOLERANCE * val_fraction:
            return n - n_val, 0, "documents"
    target = total - max(1, math.floor(total * val_fraction + 0.5))  # the first held-out character
    start = 0
    for k, length in enumerate(lengths):
        if start + length > target:
            c = target - start
            return (k, 0, "documents") if c == 0 else (k, c, "window")
        start += length
    return n, 0, "none"


def is_prepared(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST_FILE).is_file()


def check_out_dir(out: str | Path, force: bool) -> Path:
    """``out`` as a Path, or an InputError when writing there could lose something or cannot work (its
    nearest existing ancestor is not a writable directory)."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: is a file; give a directory")
    if out.is_dir() and any(out.iterdir()):
        if not is_prepared(out):
            raise InputError(f"--out {out}: exists and is not a prepared corpus; give a new or empty directory")
        if not force:
            raise InputError(f"--out {out}: already holds a prepared corpus; add --force to replace it")
    parent = out.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"--out {out}: {parent} is not a directory; give an --out under a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}: cannot write in {parent} (read-only or not permitted); choose another --out")
    return out


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived while preparing (its temporary directory is removed on the way out).
    ``completed``: it came while the new corpus was being put in place, which was finished first."""

    def __init__(self, signum: int, completed: bool = False):
        import signal

        self.signum, self.completed = signum, completed
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


_deferred_signals: list[int] = []
_defer_depth = 0


def _raise_interrupted(signum, frame):
    if _defer_depth:
        _deferred_signals.append(signum)  # raised when the critical section ends
        return
    raise Interrupted(signum)


class _SignalsDeferred:
    """A critical section: SIGTERM / SIGINT (under ``_InterruptsRaise``) wait until it ends, then raise
    ``Interrupted(completed=True)``. A flag rather than a signal mask, which would hold for this thread
    only (the kernel hands a signal to any thread that does not block it, and Python runs the handler
    in the main thread all the same)."""

    def __enter__(self):
        global _defer_depth
        _defer_depth += 1
        return self

    def __exit__(self, exc_type, exc, tb):
        global _defer_depth
        _defer_depth -= 1
        if not _defer_depth and _deferred_signals:
            signum = _deferred_signals[0]
            _deferred_signals.clear()
            if exc_type is None:
                raise Interrupted(signum, completed=True)
        return False


class _InterruptsRaise:
    """While active (main thread only), SIGTERM and SIGINT raise ``Interrupted``, so ``try/except`` blocks
    clean up as for any error; the old handlers come back afterwards."""

    def __enter__(self):
        import signal
        import threading

        self._saved = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._saved[sig] = signal.signal(sig, _raise_interrupted)
        return self

    def __exit__(self, *exc):
        import signal

        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


def _default_signals() -> None:
    """In a forked worker: SIGTERM ends it (the pool's terminate), SIGINT is the parent's business."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _hub_checkpoint(text: str) -> Path | None:
    """``--tokenizer ORG/NAME``: the Hub checkpoint's cached (or fetched) snapshot directory; None for what is not
    a Hub id."""
    from trainer import hf_import

    if not (hf_import.is_hub_id(text) and "/" in text):
        return None
    return hf_import.resolve_checkpoint(text, "--tokenizer")


def _checkpoint_tokenizer(directory: Path) -> Tokenizer:
    """A Hugging Face checkpoint's tokenizer as ``--from`` reads it: the end-of-text token its config names and the
    vocabulary of its (possibly padded) embedding."""
    from trainer import hf_import, hf_model

    # the shapes of any family memplan trains (its own model's or transformers' class, trainer.hf_model): the
    # tokenizer needs the vocabulary and the end-of-text id only
    _, model, cfg, _ = hf_model.checkpoint_stack(directory, "transformers", "--tokenizer")
    return hf_import.read_tokenizer(directory, cfg, model, "--tokenizer")[0]


def prepare(sources: Sequence[Source], out: str | Path, config: PrepareConfig = PrepareConfig(), *,
            force: bool = False, progress: Progress | None = None,
            notes: Callable[[str], None] | None = None) -> PrepareResult:
    """Clean, dedupe, split, tokenize and shard ``sources`` into ``out`` (see the module docstring).

    ``notes`` is told, one line each, what was done that the user should know (stale temporary
    directories removed, files skipped). SIGTERM / SIGINT raise ``Interrupted`` after the temporary
    directory is removed; an ``OSError`` (a full disk, a vanished directory) propagates likewise.
    """
    progress = progress or (lambda stage, done, total: None)
    notes = notes or (lambda line: None)
    out = check_out_dir(out, force)
    spec = parse_tokenizer_spec(config.tokenizer, hub=_hub_checkpoint)
    if spec.kind == "tiktoken":
        check_tiktoken_available(spec.encoding)
    elif spec.kind == "file":
        build_tokenizer(spec, from_checkpoint=_checkpoint_tokenizer)  # a bad tokenizer.json fails before the corpus is read
    out.parent.mkdir(parents=True, exist_ok=True)
    with _InterruptsRaise(), prepare_lock(out):
        for line in remove_stale_temp_dirs(out):
            notes(line)
        check_out_dir(out, force)  # again, under the lock: another prepare may have filled it meanwhile
        return _prepare_locked(sources, out, config, spec, progress, notes)


def stale_temp_dirs(out: Path) -> list[Path]:
    """The temporary directories beside ``out`` that a prepare into it makes (``.NAME.prepare-XXXXXXXX``,
    ``.NAME.old-XXXXXXXX``; ``memplan.fsutil.temp_dir_beside``)."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(prepare|old)-[a-z0-9_]{{8}}$")
    parent = out.parent if str(out.parent) else Path(".")
    try:
        return sorted(p for p in parent.iterdir() if pattern.match(p.name) and p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def remove_stale_temp_dirs(out: Path) -> list[str]:
    """Clear what ``stale_temp_dirs`` finds, and say what was done (one line each). Call only while holding
    ``prepare_lock(out)``: every prepare makes its temporary directories while holding that lock, and
    the OS drops a lock when its holder dies (``kill -9`` included), so while we hold it any such
    directory belongs to a dead process. An old corpus set aside (``.NAME.old-*``) while ``out`` is
    missing is the only copy left: it is put back, not removed."""
    done = []
    for path in stale_temp_dirs(out):
        if ".old-" in path.name and not out.exists() and is_prepared(path):
            os.rename(path, out)
            done.append(f"restored the corpus in {path} to {out}, set aside by an earlier prepare that was killed")
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            done.append(f"removed {path}, left by an earlier prepare into {out} that was killed")
    return done


def prepare_lock(out: Path):
    """The lock ``.NAME.lock`` beside corpus directory ``out`` (``memplan.fsutil.hold_lock``), held while a
    corpus is prepared into it; a second ``prepare`` is told which PID holds it."""
    from memplan.fsutil import hold_lock

    return hold_lock(out.parent / f".{out.name}.lock",
                     f"--out {out}: another memplan process (PID {{pid}}) is preparing a corpus into it; wait for "
                     "it to end, or choose another --out")


def _prepare_locked(sources, out: Path, config: PrepareConfig, spec, progress: Progress,
                    notes: Callable[[str], None]) -> PrepareResult:
    from memplan.fsutil import temp_dir_beside

    tmp = temp_dir_beside(out, "prepare")  # created exclusively under an unpredictable name
    seconds: dict[str, float] = {}
    try:
        staging = tmp / "staging"
        staging.mkdir()
        t0 = time.perf_counter()
        stats, lengths = _read_clean_dedupe(sources, staging, config, progress, notes)
        seconds["read"] = time.perf_counter() - t0
        for s, doc_lengths in zip(stats, lengths):
            k, c, s.val_split = val_split_point(doc_lengths, config.val_fraction)
            s.val_start_document, s.val_start_char = k, c
            s.train_documents = k + (1 if c else 0)
            s.val_documents = s.documents - k
        del lengths

        t0 = time.perf_counter()
        progress("tokenizer", 0, None)
        tokenizer = build_tokenizer(spec, _staged_texts(staging, stats, split="train"),
                                    length=sum(s.train_documents for s in stats),
                                    from_checkpoint=_checkpoint_tokenizer)
        tokenizer.save(tmp)
        progress("tokenizer", 1, 1)
        seconds["tokenizer"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        dtype = np.dtype(token_dtype_name(tokenizer.vocab_size)).newbyteorder("<")
        shards = _tokenize_and_write(staging, stats, tokenizer, dtype, tmp, config, progress)
        seconds["tokenize"] = time.perf_counter() - t0
        shutil.rmtree(staging)

        manifest = _manifest(stats, shards, tokenizer, str(spec), dtype, config)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / STATS_FILE).write_text(json.dumps(_stats_json(stats), indent=2) + "\n")
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PrepareResult(out=out, manifest=manifest, stats=stats, seconds=seconds)


def _stage_line(text: str, starts_document: bool) -> bytes:
    """One staged piece: a JSON string, marked with a leading "+" when it continues the document before."""
    return (("" if starts_document else "+") + json.dumps(text, ensure_ascii=False) + "\n").encode("utf-8")


def _read_clean_dedupe(sources, staging: Path, config: PrepareConfig, progress: Progress,
                       notes: Callable[[str], None] = lambda line: None) -> tuple[list[SourceStats], list]:
    """Stage every kept document of every source (``staging/NNN.jsonl``, pieces of at most about
    ``config.chunk_chars``); return the statistics and each source's document lengths in characters."""
    from array import array

    dedupe = Deduplicator()
    all_stats, all_lengths = [], []
    seen = 0
    limit = config.chunk_chars
    for index, source in enumerate(sources):
        stats = SourceStats(name=source.name, origin=source.origin)
        lengths = array("q")

        def skipped(path, reason, stats=stats):
            stats.skipped_files.append([str(path), reason])

        with open(staging / f"{index:03d}.jsonl", "wb") as f:
            for raw in source.documents(config.workers, on_skip=skipped, chunk_chars=limit, on_note=notes):
                seen += 1
                if seen % 1000 == 0:
                    progress("read", seen, None)
                if isinstance(raw, str) and len(raw) > limit:
                    raw = LongDocument(split_text(raw, limit))
                if isinstance(raw, str):
                    text, reason = filter_document(raw, config.clean)
                    if text is not None and dedupe.seen(text):
                        text, reason = None, "duplicate"
                    if text is not None:
                        f.write(_stage_line(text, True))
                        chars = len(text)
                else:
                    start = f.tell()
                    cleaner = PieceCleaner(config.clean)
                    first = True
                    for piece in raw:
                        out = cleaner.feed(piece)
                        if out:
                            f.write(_stage_line(out, first))
                            first = False
                    reason = cleaner.finish()
                    if reason is None and dedupe.seen_digest(cleaner.digest):
                        reason = "duplicate"
                    text, chars = (None, 0) if reason else ("", cleaner.characters)
                    if reason:
                        f.seek(start)
                        f.truncate()
                if text is None:
                    if reason == "short":
                        stats.filtered_short += 1
                    elif reason == "nontext":
                        stats.filtered_nontext += 1
                    else:
                        stats.duplicates_dropped += 1
                    continue
                lengths.append(chars)
                stats.documents += 1
                stats.characters += chars
                if config.max_docs is not None and stats.documents >= config.max_docs:
                    break
        all_stats.append(stats)
        all_lengths.append(lengths)
    progress("read", seen, seen)
    if not any(s.documents for s in all_stats):
        skipped_files = [p for s in all_stats for p, _ in s.skipped_files]
        if skipped_files and not seen:
            why = next(r for s in all_stats for _, r in s.skipped_files)
            raise InputError(f"--input {skipped_files[0]}: not a text file ({why}); "
                             f"{len(skipped_files)} file(s) skipped and no text left to prepare")
        short = sum(s.filtered_short for s in all_stats)
        nontext = sum(s.filtered_nontext for s in all_stats)
        dups = sum(s.duplicates_dropped for s in all_stats)
        from memplan.units import plural

        raise InputError(f"empty corpus after filtering: {plural(seen, 'document')} read, {short} shorter than "
                         f"--min-chars {config.clean.min_chars}, {nontext} mostly non-text, {plural(dups, 'duplicate')}; "
                         "lower --min-chars, check --text-field, or add inputs")
    return all_stats, all_lengths


def _cut_at_space(text: str, at: int) -> int:
    """A cut of ``text`` near ``at`` (0 < at < len): before the whitespace run that starts at or before it,
    when there is one after the first character; else ``at``."""
    p = max(text.rfind(" ", 0, at + 1), text.rfind("\n", 0, at + 1))
    while p > 0 and text[p - 1] in " \n":
        p -= 1
    return p if p > 0 else at


def _staged_pieces(staging: Path, index: int, s: SourceStats) -> Iterator[tuple[bool, bool, str]]:
    """``(is_val, starts_document, text)`` for the staged pieces of source ``index``, cut where its held-out
    split starts (``val_split_point``); the held-out part of a document cut in two starts a document."""
    k, c = s.val_start_document, s.val_start_char
    doc, offset = -1, 0
    with open(staging / f"{index:03d}.jsonl", encoding="utf-8") as f:
        for line in f:
            new = not line.startswith("+")
            text = json.loads(line if new else line[1:])
            if new:
                doc, offset = doc + 1, 0
            if doc == k and offset < c < offset + len(text):
                cut = _cut_at_space(text, c - offset)
                yield False, new, text[:cut]
                yield True, True, text[cut:]
            else:
                is_val = doc > k or (doc == k and offset >= c)
                yield is_val, new or (doc == k and c > 0 and offset == c), text
            offset += len(text)


TRAIN_PIECE_CHARS = 1 << 12  # what BPE training is fed at most at once (see _staged_texts)


def _staged_texts(staging: Path, stats: Sequence[SourceStats], *, split: str | None,
                  piece_chars: int = TRAIN_PIECE_CHARS) -> Iterator[str]:
    """Staged text of every source in order, split "train", "val" or None (all), in pieces of at most
    ``piece_chars`` cut by ``cut_point``. For BPE training: the tokenizers library buffers 256 texts of
    the iterator at a time, so a long document staged in ``DOC_CHUNK_CHARS`` pieces would put 256 of
    them (16 M characters) in flight; pieces cut where pre-tokens start leave the word counts as they were.
    """
    for index, s in enumerate(stats):
        for is_val, _, text in _staged_pieces(staging, index, s):
            if split is None or (split == "val") == is_val:
                yield from split_text(text, piece_chars)


def _chunks_of_staged(staging: Path, stats: Sequence[SourceStats], max_chars: int = 1 << 20,
                      max_docs: int = 2048) -> Iterator[tuple[int, bool, list[tuple[bool, str]]]]:
    """(source index, is_val, [(starts_document, text)]) chunks that never mix sources or splits."""
    for index, s in enumerate(stats):
        chunk, chars, chunk_is_val = [], 0, False
        for is_val, new, text in _staged_pieces(staging, index, s):
            if chunk and (is_val != chunk_is_val or chars >= max_chars or len(chunk) >= max_docs):
                yield index, chunk_is_val, chunk
                chunk, chars = [], 0
            chunk.append((new, text))
            chunk_is_val = is_val
            chars += len(text)
        if chunk:
            yield index, chunk_is_val, chunk


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker_tokenizer(payload) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _WORKER_TOKENIZER = Tokenizer.from_worker_payload(payload)


def _encode_chunk(job: tuple[int, bool, list[tuple[bool, str]]]) -> tuple[int, bool, np.ndarray, int]:
    """(source, is_val, uint32 ids with an end-of-text id before every document, documents started)."""
    index, is_val, pieces = job
    tok = _WORKER_TOKENIZER
    ids = tok.encode_batch([text for _, text in pieces])
    starts = sum(1 for new, _ in pieces if new)
    total = sum(len(x) for x in ids) + starts
    arr = np.empty(total, dtype=np.uint32)
    pos = 0
    for (new, _), doc in zip(pieces, ids):
        if new:
            arr[pos] = tok.eot_id
            pos += 1
        arr[pos: pos + len(doc)] = doc
        pos += len(doc)
    return index, is_val, arr, starts


def encode_documents(tokenizer: Tokenizer, chunks: Iterable[tuple[int, bool, list[str]]], workers: int
                     ) -> Iterator[tuple[int, bool, np.ndarray, int]]:
    """Encode chunks (source index, is_val, texts) in order, with ``workers`` processes.

    Each worker process runs the tokenizer single-threaded on whole chunks; results come back
    in input order. (Measured against the tokenizers batch API's own threads: see the report.)
    """
    global _WORKER_TOKENIZER
    if workers > 1:
        yield from ordered_map(_encode_chunk, chunks, workers, initializer=_init_worker_tokenizer,
                               initargs=(tokenizer.worker_payload(),))
        return
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # --workers 1 means one thread
    _WORKER_TOKENIZER = tokenizer
    try:
        yield from map(_encode_chunk, chunks)
    finally:
        _WORKER_TOKENIZER = None
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


class ShardWriter:
    """Appends token ids to ``{prefix}-00000.bin``, ``-00001`` ... of at most ``shard_tokens`` each."""

    def __init__(self, directory: Path, prefix: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.prefix, self.dtype, self.shard_tokens = Path(directory), prefix, dtype, shard_tokens
        self.shards: list[dict] = []
        self.tokens = 0
        self._file = None
        self._hash = None
        self._in_shard = 0

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        if ids.size and int(ids.max()) > np.iinfo(self.dtype).max:
            raise ValueError(f"token id {int(ids.max())} does not fit in {self.dtype}")
        ids = ids.astype(self.dtype, copy=False)
        while ids.size:
            if self._file is None:
                name = f"{self.prefix}-{len(self.shards):05d}.bin"
                self._file = open(self.directory / name, "wb")
                self._hash = hashlib.sha256()
                self._in_shard = 0
                self.shards.append({"file": name, "tokens": 0, "sha256": None})
            take = min(ids.size, self.shard_tokens - self._in_shard)
            data = ids[:take].tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._in_shard += take
            self.tokens += take
            ids = ids[take:]
            if self._in_shard == self.shard_tokens:
                self._finish_shard()

    def _finish_shard(self) -> None:
        self._file.close()
        self.shards[-1]["tokens"] = self._in_shard
        self.shards[-1]["sha256"] = self._hash.hexdigest()
        self._file = None

    def close(self) -> list[dict]:
        if self._file is not None:
            self._finish_shard()
        return self.shards


def _tokenize_and_write(staging, stats, tokenizer, dtype, directory, config, progress) -> dict:
    writers = {False: ShardWriter(directory, "train", dtype, config.shard_tokens),
               True: ShardWriter(directory, "val", dtype, config.shard_tokens)}
    # what the counter counts: the pieces that start with an end-of-text, each document's and, where the held-out
    # split cuts a document in two (val_start_char > 0), its held-out part's (_staged_pieces); counting documents
    # alone, the counter ended past its total (6316/6315)
    total_docs = sum(s.documents + (1 if s.val_start_char > 0 else 0) for s in stats)
    done = 0
    progress("tokenize", 0, total_docs)
    chunks = _chunks_of_staged(staging, stats)
    for index, is_val, ids, n_docs in encode_documents(tokenizer, chunks, config.workers):
        s = stats[index]
        writers[is_val].write(ids)
        s.tokens += ids.size
        if is_val:
            s.val_tokens += ids.size
        else:
            s.train_tokens += ids.size
        done += n_docs
        progress("tokenize", done, total_docs)
    train_at = val_at = 0  # sources are written one after another, in order
    for s in stats:
        s.train_offset, s.val_offset = train_at, val_at
        train_at, val_at = train_at + s.train_tokens, val_at + s.val_tokens
    return {"train": writers[False].close(), "val": writers[True].close()}


def _manifest(stats, shards, tokenizer: Tokenizer, spec: str, dtype: np.dtype, config: PrepareConfig) -> dict:
    def split(name):
        return {"tokens": sum(sh["tokens"] for sh in shards[name]),
                "documents": sum(getattr(s, f"{name}_documents") for s in stats),
                "shards": shards[name]}

    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "dtype": dtype.name,
        "byte_order": "little",
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "document_separator": "eot before every document",
        "tokenizer": tokenizer.manifest_entry(spec),
        "val_fraction": config.val_fraction,
        "cleaning": asdict(config.clean),
        "train": split("train"),
        "val": split("val"),
        "sources": [{"name": s.name, "origin": s.origin, "documents": s.documents, "characters": s.characters,
                     "tokens": s.tokens, "train_documents": s.train_documents, "train_offset": s.train_offset,
                     "train_tokens": s.train_tokens, "val_documents": s.val_documents, "val_offset": s.val_offset,
                     "val_tokens": s.val_tokens, "val_split": s.val_split,
                     "skipped_files": s.skipped_files} for s in stats],
    }


def _stats_json(stats: Sequence[SourceStats]) -> dict:
    keys = ("documents", "characters", "tokens", "train_tokens", "val_tokens", "duplicates_dropped",
            "filtered_dropped", "filtered_short", "filtered_nontext")
    rows = [s.to_dict() for s in stats]
    return {"sources": rows, "total": {k: sum(r[k] for r in rows) for k in keys}}


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; a corpus already there is removed only after the new one is in place.
    SIGTERM and SIGINT wait until this is done (``_SignalsDeferred``), so an interruption never leaves
    ``out`` without a corpus; a ``kill -9`` between the renames leaves the old one in ``.NAME.old-*``,
    which the next prepare into ``out`` puts back (``remove_stale_temp_dirs``)."""
    from memplan.fsutil import temp_dir_beside

    with _SignalsDeferred():
        old = None
        if out.is_dir():
            if any(out.iterdir()):
                old = temp_dir_beside(out, "old")  # a fresh empty directory, which the rename replaces
                os.rename(out, old)
            else:
                out.rmdir()
        try:
            os.rename(tmp, out)
        except BaseException:
            if old is not None:
                os.rename(old, out)  # the old corpus back where it was
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


# =================================================================================================
# Loading
# =================================================================================================

@dataclass(frozen=True, kw_only=True)
class SourceInfo:
    """One source of a prepared corpus, as the manifest records it (offsets and counts in tokens)."""

    name: str
    documents: int
    tokens: int
    train_offset: int
    train_tokens: int
    val_offset: int
    val_tokens: int


class TokenStore:
    """One split's shards as a single read-only sequence of token ids (memory-mapped)."""

    def __init__(self, directory: Path, shards: Sequence[dict], dtype: np.dtype, vocab_size: int | None = None):
        self.directory = Path(directory)
        self.shards = list(shards)
        self.dtype = dtype
        self.vocab_size = vocab_size  # when given, every read checks its ids are below it
        self._maps: list[np.ndarray | None] = [None] * len(self.shards)
        self._starts = [0]
        for sh in self.shards:
            if not inside_name(sh["file"]):
                raise InputError(f"{self.directory / MANIFEST_FILE}: lists shard {sh['file']!r}, not a file inside "
                                 "the corpus; the manifest is corrupt, re-run memplan prepare")
            path = self.directory / sh["file"]
            expected = int(sh["tokens"]) * dtype.itemsize
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise InputError(f"{path}: missing; the prepared corpus is incomplete, re-run memplan prepare") from None
            if size != expected:
                raise InputError(f"{path}: {size} bytes, but the manifest says {sh['tokens']} tokens of "
                                 f"{dtype.itemsize} bytes ({expected} bytes); the shard is truncated or corrupt, "
                                 "re-run memplan prepare")
            self._starts.append(self._starts[-1] + int(sh["tokens"]))

    def __len__(self) -> int:
        return self._starts[-1]

    def _map(self, i: int) -> np.ndarray:
        if self._maps[i] is None:
            self._maps[i] = np.memmap(self.directory / self.shards[i]["file"], dtype=self.dtype, mode="r")
        return self._maps[i]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, across shard boundaries."""
        if start < 0 or length < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {len(self)})")
        out = np.empty(length, dtype=np.int64)
        pos = 0
        i = bisect_right(self._starts, start) - 1
        while pos < length:
            local = start + pos - self._starts[i]
            take = min(length - pos, self._starts[i + 1] - self._starts[i] - local)
            piece = self._map(i)[local:local + take]
            if self.vocab_size is not None and take and int(piece.max()) >= self.vocab_size:
                self._bad_id(i, local, piece)
            out[pos:pos + take] = piece
            pos += take
            i += 1
        return out

    def _bad_id(self, i: int, local: int, piece: np.ndarray) -> None:
        at = int(np.argmax(piece >= self.vocab_size))
        raise InputError(f"{self.directory / self.shards[i]['file']}: token id {int(piece[at])} at token {local + at} "
                         f"is outside the vocabulary of {self.vocab_size} (ids 0..{self.vocab_size - 1}); the shard "
                         "is corrupt or from another corpus, re-run memplan prepare")

    def verify(self) -> None:
        for sh in self.shards:
            path = self.directory / sh["file"]
            if file_sha256(path) != sh["sha256"]:
                raise InputError(f"{path}: sha256 differs from the manifest's; the shard is corrupt, "
                                 "re-run memplan prepare")


class PreparedData:
    """A prepared corpus directory, checked on open.

    Opening reads ``manifest.json`` and checks that every shard exists with the byte size its token
    count implies (cheap); ``verify()`` also checks every file's sha256 (reads everything). Any
    problem is an ``InputError`` naming the file.

    Attributes: ``path``, ``manifest`` (the parsed dict), ``dtype``, ``vocab_size``, ``eot_id``,
    ``sources`` (tuple of ``SourceInfo``), ``train_tokens``, ``val_tokens``, ``train`` / ``val``
    (``TokenStore``), and ``tokenizer`` (loaded on first use, its hash checked).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = _read_manifest(self.path)
        m = self.manifest
        where = self.path / MANIFEST_FILE
        try:
            self.dtype = np.dtype(m["dtype"]).newbyteorder("<")
            self.vocab_size = int(m["vocab_size"])
            self.eot_id = int(m["eot_id"])
            self.sources = tuple(SourceInfo(name=s["name"], documents=int(s["documents"]), tokens=int(s["tokens"]),
                                            train_offset=int(s["train_offset"]), train_tokens=int(s["train_tokens"]),
                                            val_offset=int(s["val_offset"]), val_tokens=int(s["val_tokens"]))
                                 for s in m["sources"])
            train_shards, val_shards = m["train"]["shards"], m["val"]["shards"]
            split_tokens = {"train": int(m["train"]["tokens"]), "val": int(m["val"]["tokens"])}
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: corrupt manifest ({type(e).__name__}: {e}); re-run memplan prepare") from None
        if self.dtype.name not in ("uint16", "uint32") or \
                self.dtype.itemsize < np.dtype(token_dtype_name(self.vocab_size)).itemsize:
            raise InputError(f"{where}: dtype {m['dtype']!r} cannot hold {self.vocab_size} token ids; "
                             "re-run memplan prepare")
        self.train = TokenStore(self.path, train_shards, self.dtype, self.vocab_size)
        self.val = TokenStore(self.path, val_shards, self.dtype, self.vocab_size)
        for name, store in (("train", self.train), ("val", self.val)):
            if len(store) != split_tokens[name]:
                raise InputError(f"{where}: {name} shards hold {len(store)} tokens but the manifest says "
                                 f"{split_tokens[name]}; re-run memplan prepare")
        for s in self.sources:
            if s.train_offset + s.train_tokens > len(self.train) or s.val_offset + s.val_tokens > len(self.val):
                raise InputError(f"{where}: source {s.name!r} lies outside its split; re-run memplan prepare")
        self._tokenizer: Tokenizer | None = None

    @property
    def train_tokens(self) -> int:
        return len(self.train)

    @property
    def val_tokens(self) -> int:
        return len(self.val)

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    @property
    def tokenizer(self) -> Tokenizer:
        """The corpus's tokenizer (its sha256 checked against the manifest)."""
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_manifest_entry(self.manifest["tokenizer"], self.path)
        return self._tokenizer

    def verify(self, splits: Sequence[str] = ("train", "val")) -> None:
        """Check the sha256 of every shard of ``splits`` and of the tokenizer against the manifest (reads
        those files)."""
        for split in splits:
            getattr(self, split).verify()
        self._tokenizer = None
        _ = self.tokenizer

    def source(self, name: str) -> SourceInfo:
        for s in self.sources:
            if s.name == name:
                return s
        raise InputError(f"source {name!r} is not in {self.path} (sources: {', '.join(self.source_names)})")

    def val_windows(self, source: str | None = None, *, ctx: int) -> int:
        """How many ctx-token evaluation windows the val split of ``source`` (None: all) holds."""
        _, n = self._val_span(source)
        return max(0, (n - 1) // ctx)

    def val_batches(self, source: str | None = None, *, batch: int, ctx: int,
                    max_batches: int | None = None) -> Iterator[tuple["torch.Tensor", "torch.Tensor"]]:  # noqa: F821
        """Deterministic evaluation batches ``(x, y)`` from the val split of ``source`` (None: all sources).

        The split is cut into non-overlapping windows of ctx + 1 tokens (x = the first ctx, y = the
        last ctx, so y is x shifted by one). With ``max_batches``, ``max_batches × batch`` windows are
        taken evenly spaced across the whole split (not just its start); otherwise all of them.
        Every batch has ``batch`` rows except perhaps the last. A split with fewer than ctx + 1
        tokens yields nothing (see ``val_windows``). Same arguments, same batches, every call.
        """
        _check_positive(batch=batch, ctx=ctx)
        if max_batches is not None:
            _check_positive(max_batches=max_batches)
        offset, n = self._val_span(source)
        n_windows = max(0, (n - 1) // ctx)
        k = n_windows if max_batches is None else min(n_windows, max_batches * batch)
        if k == 0:
            return
        chosen = (np.arange(k, dtype=np.int64) * n_windows) // k  # evenly spaced, distinct
        for b in range(0, k, batch):
            starts = offset + chosen[b:b + batch] * ctx
            yield _to_xy(np.stack([self.val.read(int(s), ctx + 1) for s in starts]))

    def _val_span(self, source: str | None) -> tuple[int, int]:
        if source is None:
            return 0, len(self.val)
        s = self.source(source)
        return s.val_offset, s.val_tokens

    def __repr__(self) -> str:
        return (f"PreparedData({str(self.path)!r}, train_tokens={self.train_tokens}, val_tokens={self.val_tokens}, "
                f"vocab_size={self.vocab_size}, sources={list(self.source_names)})")


def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST_FILE
    if not directory.is_dir():
        raise InputError(f"{directory}: no such directory; prepare one with `memplan prepare --out {directory}`")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{directory}: no {MANIFEST_FILE}; not a prepared corpus (make one with "
                         f"`memplan prepare --out {directory}`)") from None
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise InputError(f"{path}: not valid JSON ({e}); the manifest is truncated or corrupt, "
                         "re-run memplan prepare") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise InputError(f"{path}: not a memplan token manifest; re-run memplan prepare")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise InputError(f"{path}: format version {manifest.get('format_version')!r}, this memplan reads "
                         f"{FORMAT_VERSION}; re-run memplan prepare")
    return manifest


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise InputError(f"{name}: {v!r} must be a positive integer")


def _to_xy(windows: np.ndarray):
    """(rows, ctx + 1) int64 -> x = windows[:, :-1], y = windows[:, 1:] as contiguous torch int64."""
    import torch

    return (torch.from_numpy(np.ascontiguousarray(windows[:, :-1])),
            torch.from_numpy(np.ascontiguousarray(windows[:, 1:])))


class TrainStream:
    """An endless, deterministic, resumable stream of training batches ``(x, y)``.

    Windows. Epoch e cuts the train split into non-overlapping windows of ctx tokens starting at
    ``offset_e + i × ctx`` (each read with one token more, so y = x shifted by one; the extra
    token is the next window's first). ``offset_0 = 0``; later epochs draw ``offset_e`` in
    [0, ctx) from the seed, so window boundaries move between epochs. The epoch visits its windows
    in a seeded permutation (``numpy.random.default_rng([seed, e])``).

    Batches and ranks. The global batch is ``batch × world_size`` consecutive windows of the
    permutation, starting at ``position``; rank r takes the r-th block of ``batch`` of them::

        global batch at position p:  perm[p : p + batch*world_size]
        rank r:                      perm[p + r*batch : p + (r+1)*batch]

    so concatenating the ranks' x along dim 0, in rank order, gives exactly the batch a
    single-process stream with ``batch × world_size`` and the same seed yields. An epoch ends when
    fewer than a global batch of windows are left; those are skipped (a different few each epoch).

    Resuming. ``state_dict()`` is a small JSON-able dict (epoch, position, seed, plus ctx and the
    train token count to catch a mismatch); ``load_state_dict()`` continues with exactly the
    batches that would have followed. The state counts windows, not batches, so it also resumes
    under a different world size with the same global batch.

    Yields int64 tensors of shape (batch, ctx) on the CPU; pin or move them in the loop.
    """

    STATE_VERSION = 1

    def __init__(self, data: PreparedData, batch: int, ctx: int, seed: int = 0, rank: int = 0, world_size: int = 1):
        _check_positive(batch=batch, ctx=ctx, world_size=world_size)
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise InputError(f"seed: {seed!r} must be a non-negative integer")
        if not 0 <= rank < world_size:
            raise InputError(f"rank: {rank} must be in [0, world_size={world_size})")
        self.data, self.batch, self.ctx, self.seed = data, int(batch), int(ctx), int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.global_batch = self.batch * self.world_size
        self.n_tokens = data.train_tokens
        fewest_windows = (self.n_tokens - self.ctx) // self.ctx  # with the largest offset, ctx - 1
        if fewest_windows < self.global_batch:
            need = (self.global_batch + 1) * self.ctx
            raise InputError(f"the train split holds {self.n_tokens} tokens, too few for a global batch of "
                             f"{self.global_batch} × ctx {self.ctx} (needs at least {need}); use a smaller "
                             "--ctx or --batch, or more data")
        self.epoch = 0
        self.position = 0  # windows of the current epoch's permutation already served (all ranks)
        self._plan_epoch: int | None = None
        self._plan: tuple[int, np.ndarray] | None = None

    def epoch_plan(self, epoch: int) -> tuple[int, np.ndarray]:
        """(offset, permutation of window indices) of ``epoch``; window i starts at offset + i × ctx."""
        if self._plan_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            offset = 0 if epoch == 0 else int(rng.integers(0, self.ctx))
            n_windows = (self.n_tokens - 1 - offset) // self.ctx
            self._plan = (offset, rng.permutation(n_windows))
            self._plan_epoch = epoch
        return self._plan

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in the current epoch (the count can differ by one between epochs)."""
        return len(self.epoch_plan(self.epoch)[1]) // self.global_batch

    @property
    def tokens_per_batch(self) -> int:
        """Tokens of x in one global batch (all ranks)."""
        return self.global_batch * self.ctx

    def __iter__(self) -> "TrainStream":
        return self

    def __next__(self):
        offset, perm = self.epoch_plan(self.epoch)
        if self.position + self.global_batch > len(perm):
            self.epoch, self.position = self.epoch + 1, 0
            offset, perm = self.epoch_plan(self.epoch)
        first = self.position + self.rank * self.batch
        starts = offset + perm[first:first + self.batch] * self.ctx
        self.position += self.global_batch
        windows = np.stack([self.data.train.read(int(s), self.ctx + 1) for s in starts])
        return _to_xy(windows)

    def state_dict(self) -> dict:
        return {"version": self.STATE_VERSION, "seed": self.seed, "epoch": self.epoch, "position": self.position,
                "ctx": self.ctx, "train_tokens": self.n_tokens}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; its seed replaces the one given at construction."""
        try:
            version, seed, epoch, position = state["version"], state["seed"], state["epoch"], state["position"]
            ctx, n_tokens = state["ctx"], state["train_tokens"]
        except (KeyError, TypeError):
            raise InputError(f"data stream state {state!r} lacks version/seed/epoch/position/ctx/train_tokens") from None
        if version != self.STATE_VERSION:
            raise InputError(f"data stream state version {version!r}; this memplan reads {self.STATE_VERSION}")
        if ctx != self.ctx:
            raise InputError(f"data stream state is for ctx {ctx}, this run uses ctx {self.ctx}")
        if n_tokens != self.n_tokens:
            raise InputError(f"data stream state is for a train split of {n_tokens} tokens, this corpus has "
                             f"{self.n_tokens}; resume on the same prepared data")
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(position, int) and position >= 0):
            raise InputError(f"data stream state: bad epoch {epoch!r} or position {position!r}")
        self.seed, self.epoch, self.position = int(seed), epoch, position
        self._plan_epoch = None

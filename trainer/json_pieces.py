"""Records of .jsonl, .parquet and line-per-record .txt files read in pieces: a record longer than a piece is
never held whole.

``jsonl_records`` reads a .jsonl file in blocks (opened with universal newlines, as before: ``\\r\\n`` and a lone
``\\r`` arrive as ``\\n``) and splits it into lines on ``\\n``. A line of at most ``limit`` characters is parsed by ``json.loads``
as before. A longer one is scanned by a small incremental parser of its top-level object: the text field's
string is decoded a block at a time (each block by ``json.loads`` of a stretch of the raw string that never
ends inside an escape or between the two halves of a ``\\uD83D\\uDE00`` surrogate pair, so the text is exactly
what ``json.loads`` of the whole line gives) and comes out in pieces of at most ``limit`` characters, cut
where ``trainer.data.split_text`` cuts; every other field is kept in a skeleton of the record (the text's
value replaced by ``""``, and any other string longer than ``limit`` by ``""``) that ``json.loads`` checks at the
end of the line, so a malformed long record is refused as a short one is. A text field that appears twice
at the top level of a long record is refused (its first value would already have been read). ijson cannot
do this: it gives a string only whole (ICRAR/ijson#162).

``text_lines`` gives the lines of a text file as the ``datasets`` library's text builder makes them records
(``hf:`` datasets of .txt files), a long line in pieces.

``parquet_values`` gives a string column's values, a long one as pieces decoded from arrow's buffer a
block of bytes at a time, instead of one Python string per value (``to_pylist``/``as_py``).

Memory: a few blocks and pieces (``limit`` and ``block`` characters), whatever the record's size; pyarrow
still holds the row group's column as it read it (benchmarks/prepare_memory.py measures both).
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Callable, Iterable, Iterator

# The raw content of a JSON string up to its closing quote or the first backslash that does not start a
# whole escape here (an incomplete one at the end of a block, or an invalid one): plain characters and
# complete escapes. Control characters are matched too: json.loads refuses them when the stretch is decoded.
_STRING_RUN = re.compile(r'[^"\\]*(?:\\(?:u[0-9a-fA-F]{4}|[^u])[^"\\]*)*')
_HIGH_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}\Z")
_WHITESPACE = " \t\r"  # JSON's whitespace within one line
_SCALAR_END = re.compile(r'[,}\]\s"\[{:]')


class RecordError(ValueError):
    """A long record that is not what a .jsonl line must be: ``msg`` says why, in json's words where it is
    json's finding."""

    def __init__(self, msg: str):
        super().__init__(msg)
        self.msg = msg


def pieces(segments: Iterable[str], limit: int, cut_point: Callable[[str, int], int]) -> Iterator[str]:
    """The text that ``segments`` make when joined, in pieces of at most ``limit`` characters cut by
    ``cut_point``: exactly the pieces ``split_text`` gives of the whole (``cut_point`` looks at no more than
    ``limit + 1`` characters, and a piece is cut only once more than ``limit`` are held)."""
    held = ""
    for segment in segments:
        held += segment
        while len(held) > limit:
            p = cut_point(held, limit)
            yield held[:p]
            held = held[p:]
    if held:
        yield held


def document(text_pieces: Iterator[str], limit: int, long_document: Callable[[Iterable[str]], object]):
    """The text of ``text_pieces`` (pieces of at most ``limit`` characters) as a str when it is at most
    ``limit`` characters long, else as ``long_document(pieces)`` (read one piece at a time)."""
    head, size = [], 0
    for piece in text_pieces:
        head.append(piece)
        size += len(piece)
        if size > limit:
            return long_document(_chain(head, text_pieces))
    return "".join(head)


def _chain(head: list[str], rest: Iterator[str]) -> Iterator[str]:
    while head:
        yield head.pop(0)
    yield from rest


# =================================================================================================
# .jsonl
# =================================================================================================

class _Reader:
    """Characters of a text file a block at a time: ``buf[pos:]`` is what is read and not yet taken."""

    def __init__(self, f, block: int):
        self.f = f
        self.block = block
        self.buf = ""
        self.pos = 0
        self.eof = False

    def more(self) -> bool:
        """Read another block (dropping what is taken); False at the end of the file."""
        if self.eof:
            return False
        data = self.f.read(self.block)
        self.buf = self.buf[self.pos:] + data
        self.pos = 0
        if not data:
            self.eof = True
        return bool(data)

    def peek(self) -> str:
        """The next character ('' at the end of the file), not taken."""
        if self.pos >= len(self.buf) and not self.more():
            return ""
        return self.buf[self.pos]

    def skip_whitespace(self) -> None:
        while True:
            c = self.peek()
            if c == "" or c not in _WHITESPACE:
                return
            self.pos += 1


def jsonl_records(f, *, text_field: str, limit: int, block: int, cut_point, long_document, on_short, on_long,
                  on_error) -> Iterator[object]:
    """What each non-blank line of the open text file ``f`` holds. A line of at most ``limit`` characters:
    ``on_short(line, lineno)``'s result. A longer one: its text field (``document``: a str, or a
    ``long_document`` of pieces, to be read before the next record is asked for); after it the rest of the
    line is read and ``on_long(skeleton, lineno)`` checks the record (the skeleton is the record with the text
    field's string replaced by ``""``) and returns the text field's value where it was not a string (None:
    ``""``). A long line that is not a JSON object calls ``on_error(lineno, msg)``, which raises."""
    r = _Reader(f, block)
    lineno = 0
    while True:
        lineno += 1
        nl = r.buf.find("\n", r.pos)
        while nl < 0 and len(r.buf) - r.pos <= limit and r.more():
            nl = r.buf.find("\n", r.pos)
        if nl >= 0 and nl - r.pos <= limit:
            line, r.pos = r.buf[r.pos:nl], nl + 1
        elif nl < 0 and len(r.buf) - r.pos <= limit:  # the last line, with no newline after it
            if r.pos >= len(r.buf):
                return
            line, r.pos = r.buf[r.pos:], len(r.buf)
        else:
            line = None
        if line is not None:
            if line.strip():
                yield on_short(line, lineno)
            continue
        parser = _LongRecord(r, text_field, limit, cut_point)
        try:
            if parser.blank():
                continue
            found = parser.until_text()
            value = None
            if found is not None:
                found = _guarded(found, lineno, on_error)
                value = document(found, limit, long_document)
                if not isinstance(value, str):  # the caller reads the pieces before asking for the next record
                    yield value
                    for _ in found:  # whatever the caller left unread
                        pass
            parser.rest()
        except RecordError as e:
            on_error(lineno, e.msg)
            return
        checked = on_long(parser.skeleton(), lineno)
        if found is None:
            yield checked
        elif isinstance(value, str):
            yield value


def _guarded(text_pieces: Iterator[str], lineno: int, on_error) -> Iterator[str]:
    """The pieces, with a malformed string found while they are read reported as ``on_error`` reports it."""
    try:
        yield from text_pieces
    except RecordError as e:
        on_error(lineno, e.msg)


class _LongRecord:
    """The incremental parse of one long line: its top-level object's fields, the text field's string
    decoded in pieces, everything else kept in a skeleton for ``json.loads`` to check."""

    def __init__(self, reader: _Reader, text_field: str, limit: int, cut_point):
        self.r = reader
        self.text_field = text_field
        self.limit = limit
        self.cut_point = cut_point
        self.parts: list[str] = []  # the skeleton
        self.in_text = False  # stopped at the text field's string (until_text), to go on after it (rest)

    def skeleton(self) -> str:
        return "".join(self.parts)

    def _expect(self, chars: str, what: str, record: bool = True) -> str:
        self.r.skip_whitespace()
        c = self.r.peek()
        if c == "" or c not in chars:
            raise RecordError(f"Expecting {what}" + ("; the line ended" if c in ("", "\n") else ""))
        self.r.pos += 1
        if record:
            self.parts.append(c)
        return c

    def blank(self) -> bool:
        """True, with the line taken, when it is only whitespace."""
        r = self.r
        r.skip_whitespace()
        c = r.peek()
        if c in ("\n", ""):
            r.pos += 1 if c else 0
            return True
        return False

    def until_text(self) -> Iterator[str] | None:
        """Parse up to the text field's string: its pieces (read them to the end before ``rest``), or None
        when the object ended without one."""
        r = self.r
        r.skip_whitespace()
        c = r.peek()
        if c != "{":
            raise RecordError(f"a long line that starts with {c!r}, not with {{")
        r.pos += 1
        self.parts.append("{")
        r.skip_whitespace()
        if r.peek() == "}":
            r.pos += 1
            self.parts.append("}")
            return None
        return self._fields()

    def _fields(self) -> Iterator[str] | None:
        """Fields up to the object's end (None) or the text field's string (its pieces)."""
        r = self.r
        while True:
            self._expect('"', "property name enclosed in double quotes", record=False)  # _string records it
            key = self._string()
            self._expect(":", "':' delimiter")
            r.skip_whitespace()
            if key == self.text_field and self.in_text:  # json.loads would keep the second; the first is read
                raise RecordError(f"the field {self.text_field!r} appears twice in one long record")
            if key == self.text_field and r.peek() == '"':
                r.pos += 1
                self.parts.append('""')
                self.in_text = True
                return pieces(self._decoded(), self.limit, self.cut_point)
            self._value()
            if self._expect(",}", "',' delimiter") == "}":
                return None

    def rest(self) -> None:
        """The rest of the line after the text field's string (or after the object's end)."""
        r = self.r
        if self.in_text and self._expect(",}", "',' delimiter") == ",":
            self._fields()
        r.skip_whitespace()
        c = r.peek()
        if c not in ("\n", ""):
            raise RecordError("Extra data")
        r.pos += 1 if c else 0

    def _string(self) -> str | None:
        """The rest of a string whose opening quote is taken, decoded when at most ``limit`` characters (else
        None); the skeleton gets it (as ``""`` when longer)."""
        held: list[str] = []
        size = 0
        for stretch in self._decoded():
            size += len(stretch)
            if size <= self.limit:
                held.append(stretch)
            else:
                held = []
        text = "".join(held) if size <= self.limit else None
        self.parts.append(json.dumps(text or ""))
        return text

    def _decoded(self) -> Iterator[str]:
        """The rest of a string whose opening quote is taken, decoded in stretches: each stretch of raw text that
        ends neither inside an escape nor after the first half of an escaped surrogate pair, through
        ``json.loads`` (which also refuses control characters and invalid escapes, in its own words)."""
        r = self.r
        while True:
            m = _STRING_RUN.match(r.buf, r.pos)
            end = m.end()
            if end < len(r.buf) and r.buf[end] == '"':
                stretch = r.buf[r.pos:end]
                r.pos = end + 1
                if stretch:
                    yield _decode(stretch)
                return
            if end < len(r.buf) and (len(r.buf) - end >= 6 or r.eof):  # a backslash that starts no escape
                _decode(r.buf[end:end + 6])
                raise RecordError("Invalid \\escape")
            cut = end
            tail = _HIGH_SURROGATE_ESCAPE.search(r.buf, max(r.pos, end - 6), end)
            if tail is not None and _escaped_here(r.buf, tail.start(), r.pos):
                cut = tail.start()  # its low half may follow: decoded with it
            if cut > r.pos:
                stretch = r.buf[r.pos:cut]
                r.pos = cut
                yield _decode(stretch)
            if not r.more():
                raise RecordError("Unterminated string; the line ended")

    def _value(self) -> None:
        """Take one JSON value into the skeleton (a string longer than ``limit`` as ``""``); ``json.loads`` of the
        skeleton checks its grammar."""
        r = self.r
        depth = 0
        while True:
            r.skip_whitespace()
            c = r.peek()
            if c in ("", "\n"):
                raise RecordError("Expecting value; the line ended")
            r.pos += 1
            if c == '"':
                self._string()
            elif c in "{[":
                self.parts.append(c)
                depth += 1
                continue
            elif c in "}]":
                if depth == 0:
                    raise RecordError("Expecting value")
                self.parts.append(c)
                depth -= 1
            elif c in ",:":
                if depth == 0:
                    raise RecordError("Expecting value")
                self.parts.append(c)
                continue
            else:
                r.pos -= 1
                self._scalar()
            if depth == 0:
                return

    def _scalar(self) -> None:
        r = self.r
        token: list[str] = []
        size = 0
        while True:
            m = _SCALAR_END.search(r.buf, r.pos)
            end = m.start() if m else len(r.buf)
            token.append(r.buf[r.pos:end])
            size += end - r.pos
            r.pos = end
            if size > 400:
                raise RecordError("Expecting value: a number or word of more than 400 characters")
            if m is not None or not r.more():
                break
        self.parts.append("".join(token) + " ")  # the space keeps two words apart, as the line had them


def _escaped_here(buf: str, at: int, start: int) -> bool:
    """Whether the backslash at ``buf[at]`` starts an escape (an even number of backslashes before it,
    counted back to ``start``)."""
    n = 0
    i = at - 1
    while i >= start and buf[i] == "\\":
        n += 1
        i -= 1
    return n % 2 == 0


def _decode(raw: str) -> str:
    try:
        return json.loads('"' + raw + '"')
    except ValueError as e:
        raise RecordError(getattr(e, "msg", str(e))) from None


# =================================================================================================
# lines of text (the `datasets` library's text builder: one record per line)
# =================================================================================================

def text_lines(f, *, limit: int, block: int, cut_point, long_document) -> Iterator[object]:
    """Each line of the open text file ``f`` without its ``\\n`` (a line that is empty too, and the last one
    where no newline ends it), as the ``datasets`` text builder gives them (``sample_by="line"``: the file read
    with universal newlines, split on ``\\n`` alone): a str of at most ``limit`` characters, or, longer, a
    ``long_document`` of pieces read ``block`` characters at a time (read it before asking for the next line)."""
    r = _Reader(f, block)
    while True:
        nl = r.buf.find("\n", r.pos)
        while nl < 0 and len(r.buf) - r.pos <= limit and r.more():
            nl = r.buf.find("\n", r.pos)
        if nl >= 0 and nl - r.pos <= limit:
            line, r.pos = r.buf[r.pos:nl], nl + 1
            yield line
        elif nl < 0 and len(r.buf) - r.pos <= limit:  # the end of the file
            if r.pos < len(r.buf):
                yield r.buf[r.pos:]
            return
        else:
            rest = _rest_of_line(r)
            yield document(pieces(rest, limit, cut_point), limit, long_document)
            for _ in rest:  # whatever the caller left unread
                pass


def _rest_of_line(r: _Reader) -> Iterator[str]:
    """The characters of ``r`` up to the next ``\\n`` (taken, not given) or the end of the file, a stretch at a time."""
    while True:
        nl = r.buf.find("\n", r.pos)
        if nl >= 0:
            stretch, r.pos = r.buf[r.pos:nl], nl + 1
            if stretch:
                yield stretch
            return
        stretch, r.pos = r.buf[r.pos:], len(r.buf)
        if stretch:
            yield stretch
        if not r.more():
            return


# =================================================================================================
# .parquet
# =================================================================================================

def parquet_values(array, *, limit: int, block: int, cut_point, long_document) -> Iterator[object]:
    """Each value of an arrow string array: None for a null, a str of at most ``limit`` characters, or a
    ``long_document`` of pieces decoded from arrow's data buffer ``block`` bytes at a time (never one Python
    string of the whole value). Arrays of other types give their values as Python objects."""
    import numpy as np
    import pyarrow as pa

    if pa.types.is_string_view(array.type) if hasattr(pa.types, "is_string_view") else False:
        array = array.cast(pa.large_string())
    if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
        yield from array.to_pylist()
        return
    n = len(array)
    buffers = array.buffers()
    dtype = np.int64 if pa.types.is_large_string(array.type) else np.int32
    offsets = np.frombuffer(buffers[1], dtype=dtype)[array.offset:array.offset + n + 1]
    lengths = np.diff(offsets)
    if n == 0 or int(lengths.max()) <= limit:  # every value short (a character is at least a byte)
        yield from array.to_pylist()
        return
    data = memoryview(buffers[2]) if buffers[2] is not None else memoryview(b"")
    valid = array.is_valid().to_numpy(zero_copy_only=False) if array.null_count else None
    for i in range(n):
        if valid is not None and not valid[i]:
            yield None
            continue
        start, end = int(offsets[i]), int(offsets[i + 1])
        if end - start <= limit:
            yield bytes(data[start:end]).decode("utf-8", errors="replace")
            continue
        yield document(pieces(_utf8_blocks(data, start, end, block), limit, cut_point), limit, long_document)


def _utf8_blocks(data: memoryview, start: int, end: int, block: int) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for at in range(start, end, block):
        text = decoder.decode(data[at:min(at + block, end)])
        if text:
            yield text
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail

"""Tokenizers for prepared corpora: train a byte-level BPE, load a tokenizer.json, or use tiktoken's gpt2.

Three kinds, chosen by ``--tokenizer``:

- ``bpe:N``  trains a byte-level BPE of N tokens (``tokenizers`` package) with one special token,
  ``<|endoftext|>``, which becomes the end-of-text id (it is id 0). Saved as ``tokenizer.json``.
- ``PATH``   loads any Hugging Face ``tokenizer.json``. Its end-of-text token is the first of
  ``EOT_CANDIDATES`` it has; a tokenizer with none of them gets ``<|endoftext|>`` added as a special
  token (the copy saved with the corpus has it). Saved as ``tokenizer.json``.
- ``gpt2``   tiktoken's ``gpt2`` encoding (50,257 tokens, eot 50256). tiktoken downloads its files
  once into ``TIKTOKEN_CACHE_DIR``; offline with no cached copy this is a one-line ``InputError``.
  Nothing is saved but the encoding's name; the hash is of its token table.

Text that merely *contains* the string ``<|endoftext|>`` is encoded as ordinary text, never as the
special id, so a document cannot forge a document boundary.

``Tokenizer`` is the one wrapper the rest of the code uses (``encode``, ``encode_batch``,
``decode``, ``eot_id``, ``vocab_size``, ``kind``); ``Tokenizer.from_dir(prepared_dir)`` gives back
the tokenizer a corpus was prepared with, checking its hash, so ``generate`` decodes what
``train`` saw. This module never imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from memplan.errors import InputError
from memplan.fsutil import inside_name

EOT = "<|endoftext|>"
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")  # first match wins
SPECIAL_TOKENS = (EOT,)
BYTE_ALPHABET = 256  # a byte-level BPE starts from one token per byte
MIN_BPE_VOCAB = BYTE_ALPHABET + len(SPECIAL_TOKENS)
MAX_BPE_VOCAB = 2**20  # far beyond any useful size; catches a typo such as bpe:40960000
TOKENIZER_FILE = "tokenizer.json"
TIKTOKEN_ENCODINGS = ("gpt2",)

_BPE_RE = re.compile(r"^bpe:(.*)$", re.IGNORECASE)
_ACCEPTED = ("bpe:N (train a byte-level BPE of N tokens, e.g. bpe:8192), a tokenizer.json path, a Hugging Face "
             "checkpoint directory or Hub id (its own tokenizer, as `--from` reads it), or gpt2")


# ---- what --tokenizer asks for ------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """A parsed ``--tokenizer`` value."""

    kind: str  # "bpe" (train one), "file" (a tokenizer.json), "tiktoken" (a named encoding)
    vocab_size: int | None = None  # for "bpe": the vocabulary to train
    path: Path | None = None  # for "file"
    encoding: str | None = None  # for "tiktoken"
    # for "file" from a Hugging Face checkpoint directory: read as ``--from`` reads it (trainer.hf_import), with
    # the end-of-text token its config names and the vocabulary of its (possibly padded) embedding
    checkpoint: Path | None = None

    def __str__(self) -> str:
        if self.kind == "bpe":
            return f"bpe:{self.vocab_size}"
        if self.kind == "file":
            return str(self.path)
        return str(self.encoding)


def parse_tokenizer_spec(text: str, hub: Callable[[str], Path | None] | None = None) -> TokenizerSpec:
    """``bpe:8192`` / ``gpt2`` / a path to a tokenizer.json (or a checkpoint directory holding one), or, where
    ``hub`` resolves ``text`` to a checkpoint directory (a Hub id: ``trainer.data`` passes
    ``trainer.hf_import``'s resolver), that checkpoint's; else an ``InputError`` naming the choices."""
    text = str(text).strip()
    m = _BPE_RE.match(text)
    if m:
        raw = m.group(1).strip()
        if not raw.isdigit():
            raise InputError(f"--tokenizer: {text!r}: the vocabulary after bpe: must be an integer, e.g. bpe:8192")
        n = int(raw)
        if n < MIN_BPE_VOCAB:
            raise InputError(f"--tokenizer: {text!r}: a byte-level BPE needs at least {MIN_BPE_VOCAB} tokens "
                             f"({BYTE_ALPHABET} bytes + {len(SPECIAL_TOKENS)} special); use e.g. bpe:4096 or bpe:8192")
        if n > MAX_BPE_VOCAB:
            raise InputError(f"--tokenizer: {text!r}: at most {MAX_BPE_VOCAB} tokens; use e.g. bpe:8192 or bpe:32768")
        return TokenizerSpec(kind="bpe", vocab_size=n)
    if text.lower() in TIKTOKEN_ENCODINGS:
        return TokenizerSpec(kind="tiktoken", encoding=text.lower())
    path = Path(text).expanduser()
    if path.is_dir() and (path / TOKENIZER_FILE).is_file():
        path = path / TOKENIZER_FILE
    if path.is_file():
        if path.name == TOKENIZER_FILE and (path.parent / "config.json").is_file():  # a checkpoint's own
            return TokenizerSpec(kind="file", path=path, checkpoint=path.parent)
        return TokenizerSpec(kind="file", path=path)
    directory = hub(text) if hub is not None and not path.exists() else None
    if directory is not None:  # a Hub id: its cached (or fetched) snapshot
        return TokenizerSpec(kind="file", path=directory / TOKENIZER_FILE, checkpoint=directory)
    raise InputError(f"--tokenizer: {text!r} is not a file; use {_ACCEPTED}")


# ---- the wrapper ---------------------------------------------------------------------------------

class Tokenizer:
    """encode / decode / eot_id / vocab_size over a ``tokenizers.Tokenizer`` or a tiktoken ``Encoding``.

    Build one with ``train_bpe``, ``Tokenizer.from_file``, ``Tokenizer.from_tiktoken`` or
    ``Tokenizer.from_dir``. ``kind`` is "bpe" (trained here), "file" (loaded tokenizer.json) or
    "tiktoken". ``vocab_size`` is the size an embedding table needs: one more than the largest id.
    """

    def __init__(self, backend, *, kind: str, eot_id: int, vocab_size: int, eot_token: str = EOT,
                 name: str | None = None):
        self._backend = backend
        self.kind = kind
        self.eot_id = int(eot_id)
        self.eot_token = eot_token
        self.vocab_size = int(vocab_size)
        self.name = name  # tiktoken encoding name, else None

    # -- constructors --
    @classmethod
    def from_hf(cls, hf_tokenizer, *, kind: str) -> "Tokenizer":
        """Wrap a ``tokenizers.Tokenizer``; adds ``<|endoftext|>`` if it has no end-of-text token."""
        vocab = hf_tokenizer.get_vocab(with_added_tokens=True)
        eot_token = next((t for t in EOT_CANDIDATES if t in vocab), None)
        if eot_token is None:
            from tokenizers import AddedToken

            hf_tokenizer.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
            vocab = hf_tokenizer.get_vocab(with_added_tokens=True)
            eot_token = EOT
        hf_tokenizer.encode_special_tokens = True  # "<|endoftext|>" inside a document is plain text
        return cls(hf_tokenizer, kind=kind, eot_id=vocab[eot_token], eot_token=eot_token,
                   vocab_size=max(vocab.values()) + 1)

    def as_recorded(self, record: dict, where: str) -> "Tokenizer":
        """This tokenizer with the end-of-text token and vocabulary size its record (a checkpoint's or a
        manifest's ``tokenizer`` entry) names, where that differs from what ``from_hf`` guesses: an
        imported checkpoint ends text with its config's ``eos_token_id`` (Qwen's ``<|im_end|>``, say) and
        may pad its embedding past the tokenizer's last id. A record naming a token the file lacks, or an
        id it does not have, is an InputError."""
        token, eot_id = record.get("eot_token"), record.get("eot_id")
        vocab_size = max(int(record.get("vocab_size") or 0), self.vocab_size)
        if token is None or eot_id is None or (token, int(eot_id)) == (self.eot_token, self.eot_id):
            return self if vocab_size == self.vocab_size else Tokenizer(
                self._backend, kind=self.kind, eot_id=self.eot_id, eot_token=self.eot_token, vocab_size=vocab_size,
                name=self.name)
        if self.kind == "tiktoken" or self._backend.token_to_id(str(token)) != int(eot_id):
            raise InputError(f"{where}: the recorded end-of-text token {token!r:.40} (id {eot_id!r:.20}) is not in "
                             "its tokenizer; the checkpoint and its tokenizer.json disagree")
        return Tokenizer(self._backend, kind=self.kind, eot_id=int(eot_id), eot_token=str(token),
                         vocab_size=vocab_size, name=self.name)

    @classmethod
    def from_file(cls, path: str | Path, *, kind: str = "file") -> "Tokenizer":
        """Load a Hugging Face ``tokenizer.json``."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception with a long message
            raise InputError(f"{path}: not a readable tokenizer.json ({_first_line(e)})") from None
        return cls.from_hf(hf, kind=kind)

    @classmethod
    def from_tiktoken(cls, encoding) -> "Tokenizer":
        """Wrap a tiktoken ``Encoding`` (a name such as "gpt2", or the object itself)."""
        if isinstance(encoding, str):
            encoding = _tiktoken_encoding(encoding)
        eot_id = encoding.eot_token
        return cls(encoding, kind="tiktoken", eot_id=eot_id, eot_token=EOT, vocab_size=encoding.n_vocab,
                   name=encoding.name)

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        """The tokenizer a corpus in ``directory`` was prepared with (reads its manifest.json)."""
        directory = Path(directory)
        manifest_path = directory / "manifest.json"
        try:
            manifest = json.loads(manifest_path.read_text())
            entry = manifest["tokenizer"]
        except FileNotFoundError:
            raise InputError(f"{directory}: no manifest.json; prepare a corpus there with "
                             f"`memplan prepare --out {directory}`") from None
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{manifest_path}: corrupt manifest ({_first_line(e)}); re-run memplan prepare") from None
        return cls.from_manifest_entry(entry, directory)

    @classmethod
    def from_manifest_entry(cls, entry: dict, directory: Path) -> "Tokenizer":
        """Load from a manifest's ``tokenizer`` entry and check its sha256 against the manifest."""
        kind = entry.get("kind")
        needed = "encoding" if kind == "tiktoken" else "file"
        if kind in ("tiktoken", "bpe", "file") and not isinstance(entry.get(needed), str):
            raise InputError(f"{Path(directory) / 'manifest.json'}: the tokenizer entry lacks {needed!r}; "
                             "re-run memplan prepare")
        if kind == "tiktoken":
            tok = cls.from_tiktoken(entry["encoding"])
            where = f"tiktoken encoding {entry['encoding']!r}"
        elif kind in ("bpe", "file"):
            if not inside_name(entry["file"]):
                raise InputError(f"{Path(directory) / 'manifest.json'}: lists tokenizer {entry['file']!r}, not a file "
                                 "inside the corpus; the manifest is corrupt, re-run memplan prepare")
            path = Path(directory) / entry["file"]
            if not path.is_file():
                raise InputError(f"{path}: missing; the prepared corpus is incomplete, re-run memplan prepare")
            if file_sha256(path) != entry.get("sha256"):
                raise InputError(f"{path}: sha256 differs from the manifest's; the tokenizer changed since "
                                 "the corpus was prepared, re-run memplan prepare")
            tok = cls.from_file(path, kind=kind)
            where = str(path)
            if kind == "file":  # a checkpoint's own end-of-text and padded vocabulary, as prepare recorded them
                tok = tok.as_recorded(entry, where)
        else:
            raise InputError(f"{Path(directory) / 'manifest.json'}: unknown tokenizer kind {kind!r}")
        if kind == "tiktoken" and tok.sha256() != entry.get("sha256"):
            raise InputError(f"{where}: sha256 differs from the manifest's; the tokenizer changed since "
                             "the corpus was prepared, re-run memplan prepare")
        if tok.eot_id != entry.get("eot_id", tok.eot_id) or tok.vocab_size != entry.get("vocab_size", tok.vocab_size):
            raise InputError(f"{where}: eot id or vocabulary size differs from the manifest's; re-run memplan prepare")
        return tok

    # -- use --
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no end-of-text token is added."""
        if self.kind == "tiktoken":
            return self._backend.encode_ordinary(text)
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` for many texts (the backend may use threads; see TOKENIZERS_PARALLELISM)."""
        if self.kind == "tiktoken":
            return self._backend.encode_ordinary_batch(list(texts), num_threads=1)
        backend = self._backend
        fast = getattr(backend, "encode_batch_fast", None)  # tokenizers >= 0.20: skips offsets
        encodings = (fast or backend.encode_batch)(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int], *, skip_eot: bool = False) -> str:
        """Text of ``ids``; end-of-text tokens appear as ``<|endoftext|>`` unless ``skip_eot``."""
        ids = [int(i) for i in ids]
        if skip_eot:
            ids = [i for i in ids if i != self.eot_id]
        if self.kind == "tiktoken":
            return self._backend.decode(ids)
        return self._backend.decode(ids, skip_special_tokens=False)

    # -- persistence --
    def to_json_str(self) -> str:
        """The tokenizer.json text (not for tiktoken)."""
        if self.kind == "tiktoken":
            raise ValueError("a tiktoken encoding has no tokenizer.json; record its name instead")
        return self._backend.to_str()

    def save(self, directory: str | Path) -> Path | None:
        """Write ``tokenizer.json`` into ``directory``; tiktoken writes nothing (returns None)."""
        if self.kind == "tiktoken":
            return None
        path = Path(directory) / TOKENIZER_FILE
        path.write_text(self.to_json_str(), encoding="utf-8")
        return path

    def sha256(self) -> str:
        """sha256 of the saved tokenizer.json bytes, or for tiktoken of its token table."""
        if self.kind == "tiktoken":
            h = hashlib.sha256(self.name.encode() + b"\0")
            for i in range(self._backend.n_vocab):
                try:
                    b = self._backend.decode_single_token_bytes(i)
                except KeyError:
                    b = b""
                h.update(len(b).to_bytes(4, "little") + b)
            return h.hexdigest()
        return hashlib.sha256(self.to_json_str().encode("utf-8")).hexdigest()

    def manifest_entry(self, spec: str) -> dict:
        """What manifest.json records about this tokenizer."""
        entry = {"kind": self.kind, "spec": spec, "vocab_size": self.vocab_size, "eot_id": self.eot_id,
                 "eot_token": self.eot_token, "sha256": self.sha256()}
        if self.kind == "tiktoken":
            entry["encoding"] = self.name
        else:
            entry["file"] = TOKENIZER_FILE
        return entry

    def worker_payload(self) -> tuple[str, str, dict]:
        """A picklable (kind, data, record) from which ``from_worker_payload`` rebuilds this tokenizer, with
        its end-of-text token and vocabulary size (an imported checkpoint's need not be what ``from_hf`` guesses)."""
        record = {"eot_token": self.eot_token, "eot_id": self.eot_id, "vocab_size": self.vocab_size}
        if self.kind == "tiktoken":
            return ("tiktoken", self.name, record)
        return (self.kind, self.to_json_str(), record)

    @classmethod
    def from_worker_payload(cls, payload: tuple[str, str, dict]) -> "Tokenizer":
        kind, data, record = payload
        if kind == "tiktoken":
            return cls.from_tiktoken(data)
        from tokenizers import Tokenizer as HFTokenizer

        return cls.from_hf(HFTokenizer.from_str(data), kind=kind).as_recorded(record, "the tokenizer")

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


# ---- building one ------------------------------------------------------------------------------

def train_bpe(texts: Iterable[str], vocab_size: int, *, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE with ``<|endoftext|>`` as id 0 on ``texts`` (deterministic for the same texts).

    The pre-tokenizer is GPT-2's byte-level split without an added prefix space, so
    ``decode(encode(text)) == text`` for every string.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise InputError(f"bpe:{vocab_size}: a byte-level BPE needs at least {MIN_BPE_VOCAB} tokens")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(texts, trainer, length=length)
    return Tokenizer.from_hf(hf, kind="bpe")


def build_tokenizer(spec: TokenizerSpec, train_texts: Iterable[str] | None = None,
                    length: int | None = None,
                    from_checkpoint: Callable[[Path], Tokenizer] | None = None) -> Tokenizer:
    """The tokenizer ``spec`` asks for; "bpe" trains on ``train_texts``; a checkpoint's is read by
    ``from_checkpoint`` (``trainer.data`` passes ``trainer.hf_import``'s reader, as ``--from`` reads it)."""
    if spec.kind == "bpe":
        if train_texts is None:
            raise ValueError("training a BPE needs texts")
        return train_bpe(train_texts, spec.vocab_size, length=length)
    if spec.kind == "file" and spec.checkpoint is not None:
        if from_checkpoint is None:
            raise ValueError("a checkpoint's tokenizer is read by from_checkpoint")
        return from_checkpoint(spec.checkpoint)
    if spec.kind == "file":
        return Tokenizer.from_file(spec.path)
    return Tokenizer.from_tiktoken(spec.encoding)


def check_tiktoken_available(name: str) -> None:
    """Fail early (before reading any corpus) when tiktoken's encoding cannot be loaded."""
    _tiktoken_encoding(name)


def _tiktoken_encoding(name: str):
    try:
        import tiktoken
    except ImportError:
        raise InputError(f"--tokenizer {name}: needs the tiktoken package (pip install tiktoken), "
                         "or use bpe:N to train a tokenizer here") from None
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # no network: requests' ConnectionError; a bad cache: ValueError
        cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or \
            "<tmp>/data-gym-cache"
        raise InputError(
            f"--tokenizer {name}: tiktoken could not load the {name!r} encoding offline "
            f"({type(e).__name__}); run `python -c \"import tiktoken; tiktoken.get_encoding('{name}')\"` once "
            f"with a network and copy its cache into TIKTOKEN_CACHE_DIR (now {cache}), or use --tokenizer bpe:N"
        ) from None


def token_dtype_name(vocab_size: int) -> str:
    """"uint16" when every id (0 .. vocab_size-1) fits in 16 bits, else "uint32"."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size - 1 <= 0xFFFF:
        return "uint16"
    if vocab_size - 1 <= 0xFFFFFFFF:
        return "uint32"
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 ids")


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    """sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__

"""Peak memory of `memplan prepare` for one huge document with no newline against the same text as many
documents (issue 14, item 17), and as one .jsonl or .parquet record or one record of an hf: dataset (a local
folder holding the .jsonl file) (issue 29, item 5b).

Writes SIZE megabytes of generated prose (words and numbers, single spaces, no newline) as one .txt
document, and the same text cut into documents of ~1,400 characters separated by <|endoftext|>;
prepares each in a child process (`memplan prepare --workers 1 --tokenizer bpe:4096`), one at a time,
and reports each child's peak resident memory: VmHWM from /proc/PID/status read just before it exits
(where /proc is missing, `resource.getrusage(RUSAGE_CHILDREN).ru_maxrss` of a fresh intermediate
process). Prepare reads, cleans, stages and tokenizes a document longer than
``trainer.data.DOC_CHUNK_CHARS`` in pieces of that size, so the two peaks should differ by at most a
few pieces' worth, whatever SIZE; read whole, the one document took ~140 bytes per character. The same
text as one .jsonl record and as one .parquet value is prepared too: a record is read in pieces
(``trainer.json_pieces``), so it should cost no more than the .txt document.

``--read-only`` measures the reading alone, in a child process per format: the growth of its peak resident
memory (VmHWM, reset through /proc/self/clear_refs once the modules are imported) while it reads every piece
of the one document through ``trainer.data``'s reader, and for .parquet pyarrow's own allocations (its memory
pool's peak), which the reading cannot avoid: the row group's column as arrow read it. The hf: record is read
twice: through ``trainer.data._read_hf`` (in pieces) and through ``datasets.load_dataset(streaming=True)``
(``_read_hf_records``: whole, as every hf: record was read before).

    python benchmarks/prepare_memory.py [--size-mb 50] [--keep DIR] [--read-only]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["river", "stone", "lantern", "orchard", "copper", "meadow", "harbour", "violet", "thunder", "pebble",
         "the", "a", "of", "and", "walked", "slowly", "across", "under", "bright", "quiet"]

# Run in the child: prepare, then print VmHWM (KiB) of this very process (exec resets it, fork does not
# matter here: the child is a fresh interpreter started by a small parent).
_CHILD = """
import resource, sys
from memplan.cli import app
try:
    app(sys.argv[1:])
except SystemExit as e:
    code = e.code
else:
    code = 0
try:
    hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
except OSError:
    hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"VMHWM_KIB {hwm}", file=sys.stderr)
sys.exit(code)
"""


def prose(n_chars: int, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(WORDS) + (str(rng.randint(0, 999)) if rng.random() < 0.15 else "")
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


# Run in the child: read every piece of every document of one file, then print the growth of the peak RSS (KiB)
# over what the process held before reading, and pyarrow's pool's peak (bytes; 0 when pyarrow was not used).
_READ_CHILD = """
import sys
from pathlib import Path
from trainer import data
import pyarrow, pyarrow.parquet

def status(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":"))

path = Path(sys.argv[1])
if path.is_dir():  # an hf: folder dataset: read here (in pieces), or, with "whole", through datasets.load_dataset
    import datasets
    datasets.load_dataset_builder(str(path))  # its modules imported: not the reading's cost
    if sys.argv[2:] == ["whole"]:
        reader = lambda p, field: data._read_hf_records(datasets, str(p), "train", field)
    else:
        reader = lambda p, field: data._read_hf(str(p), "train", field)
else:
    reader = {".txt": data._read_txt, ".jsonl": data._read_jsonl, ".parquet": data._read_parquet}[path.suffix]
base = status("VmRSS")
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
except OSError:
    pass
chars = 0
for doc in reader(path, "text"):
    chars += sum(map(len, doc)) if isinstance(doc, data.LongDocument) else len(doc)
print(f"READ {chars} {status('VmHWM') - base} {pyarrow.default_memory_pool().max_memory()}")
"""


def peak_of_reading(src: Path, *extra: str) -> tuple[int, int, int]:
    """(characters read, growth of the peak RSS in KiB, pyarrow's pool's peak in bytes) of reading ``src``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _READ_CHILD, str(src), *extra], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"reading {src} failed ({done.returncode}): {done.stderr[-2000:]}")
    _, chars, kib, arrow = next(line for line in done.stdout.splitlines() if line.startswith("READ ")).split()
    return int(chars), int(kib), int(arrow)


def peak_of_prepare(src: Path, out: Path) -> tuple[int, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    source = f"hf:{src}" if src.is_dir() else str(src)
    done = subprocess.run([sys.executable, "-c", _CHILD, "prepare", "--input", source, "--out", str(out),
                           "--workers", "1", "--tokenizer", "bpe:4096", "--force"],
                          env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"prepare failed ({done.returncode}): {done.stderr[-2000:]}")
    kib = next(int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("VMHWM_KIB"))
    return kib, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=50.0, help="megabytes of text (default 50)")
    parser.add_argument("--keep", help="write the inputs and corpora here (default: a temporary directory)")
    parser.add_argument("--read-only", action="store_true",
                        help="measure reading the one document as .txt, .jsonl and .parquet, not preparing it")
    args = parser.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="prepare-memory-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        text = prose(int(args.size_mb * 1e6))
        one = root / "one.txt"
        one.write_text(text, encoding="utf-8")
        words = text.split(" ")
        many = root / "many.txt"
        docs = [" ".join(words[i:i + 200]) for i in range(0, len(words), 200)]
        many.write_text("<|endoftext|>".join(docs), encoding="utf-8")
        record = root / "one.jsonl"  # the same text as one .jsonl record (issue 29): read in pieces too
        import json

        record.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
        table = root / "one.parquet"  # and as one .parquet value
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": [text]}), table)
        folder = root / "hf-one"  # and as the one record of an hf: dataset, a local folder of one .jsonl file
        (folder / "data").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(record, folder / "data" / "train.jsonl")
        del text, words
        from trainer.data import DOC_CHUNK_CHARS

        if args.read_only:
            print(f"reading one document of {os.path.getsize(one):,} characters, pieces of {DOC_CHUNK_CHARS:,}: "
                  "growth of the peak RSS while reading (pyarrow's own pool's peak apart)")
            for name, src, *extra in (("one .txt document", one), ("one .jsonl record", record),
                                      ("one .parquet value", table), ("one hf: record", folder),
                                      ("hf: via load_dataset", folder, "whole")):
                chars, kib, arrow = peak_of_reading(src, *extra)
                beyond = f"; pyarrow's pool {arrow / 2**20:.1f} MiB, beyond it {kib / 1024 - arrow / 2**20:+.1f} MiB" \
                    if arrow else ""
                print(f"  {name:>18}: {chars:,} characters, peak RSS +{kib / 1024:.1f} MiB{beyond}")
            return
        print(f"{len(docs):,} documents of ~{os.path.getsize(many) // len(docs):,} characters vs one of "
              f"{os.path.getsize(one):,} with no newline; pieces of {DOC_CHUNK_CHARS:,} characters")
        rows = []
        for name, src in (("one document", one), (f"{len(docs):,} documents", many), ("one .jsonl record", record),
                          ("one .parquet value", table), ("one hf: record", folder)):
            kib, seconds = peak_of_prepare(src, root / f"out-{src.stem}-{src.suffix[1:]}")
            rows.append((name, kib, seconds))
            print(f"  {name:>18}: peak RSS {kib / 1024:8.1f} MiB  ({seconds:.1f} s)")
        diff = rows[0][1] - rows[1][1]
        per_char = diff * 1024 / DOC_CHUNK_CHARS
        print(f"difference: {diff / 1024:+.1f} MiB ({per_char:+.0f} bytes per character of a piece)")
        for name, kib, _ in rows[2:]:
            print(f"{name} against the many documents: {(kib - rows[1][1]) / 1024:+.1f} MiB "
                  f"({(kib - rows[1][1]) * 1024 / (args.size_mb * 1e6):+.1f} bytes per character of the record)")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

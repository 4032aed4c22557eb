"""``memplan prepare``: text corpus -> cleaned, deduplicated, tokenized shards + manifest.

The work is ``trainer.data.prepare``; this module parses options, shows progress and prints the
per-source statistics table. It imports no torch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from memplan.cli.app import app
from memplan.units import plural

InputsOpt = Annotated[Optional[list[str]], typer.Option(
    "--input", "-i", metavar="PATH", help="A .txt, .jsonl or .parquet file, a directory of them (recursive), or hf:NAME; "
                          "repeat for several sources. Default: the embedded corpus (CPython's pydoc topics "
                          "and standard-library docstrings).", show_default=False)]
# Numbers are taken as text and parsed here, so a bad one is the usual one-line InputError.
OutOpt = Annotated[Optional[str], typer.Option("--out", "-o", metavar="PATH", help="Directory to write the prepared corpus into "
                                               "(required).", show_default=False)]
TokenizerOpt = Annotated[Optional[str], typer.Option(
    "--tokenizer", metavar="SPEC", help="bpe:N (train a byte-level BPE of N tokens), a tokenizer.json path, or gpt2 (tiktoken). "
                        "Default: bpe:4096 for the embedded corpus, bpe:8192 for --input.", show_default=False)]
ValFractionOpt = Annotated[str, typer.Option(
    "--val-fraction", metavar="F", help="Hold out the last this-fraction of each source's documents, in [0, 0.5].")]
WorkersOpt = Annotated[Optional[str], typer.Option(
    "--workers", metavar="N", help="Processes for parsing and tokenizing. Default: min(4, CPUs).", show_default=False)]
TextFieldOpt = Annotated[str, typer.Option("--text-field", metavar="FIELD", help="The text field of .jsonl / .parquet / hf records.")]
MinCharsOpt = Annotated[str, typer.Option("--min-chars", metavar="N", help="Drop documents shorter than this after cleaning.")]
ShardTokensOpt = Annotated[str, typer.Option("--shard-tokens", metavar="N", help="Tokens per shard file, at most (e.g. 100m).")]
MaxDocsOpt = Annotated[Optional[str], typer.Option(
    "--max-docs", metavar="N", help="Keep at most this many documents per source.", show_default=False)]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace a prepared corpus already in --out.")]


@app.command("prepare")
def prepare_command(
    out: OutOpt = None,
    inputs: InputsOpt = None,
    tokenizer: TokenizerOpt = None,
    val_fraction: ValFractionOpt = "0.05",
    workers: WorkersOpt = None,
    text_field: TextFieldOpt = "text",
    min_chars: MinCharsOpt = "32",
    shard_tokens: ShardTokensOpt = "128m",
    max_docs: MaxDocsOpt = None,
    force: ForceOpt = False,
) -> None:
    """Clean, deduplicate and tokenize a corpus into token shards for `memplan train`."""
    from rich.console import Console

    from memplan.errors import InputError
    from memplan.units import parse_count
    from trainer import data

    started = time.perf_counter()
    console = Console(stderr=True)
    if not out:
        raise InputError("--out: required; name the directory to write the prepared corpus into, e.g. --out data/pydoc")
    config = data.PrepareConfig(
        tokenizer=tokenizer or (data.DEFAULT_TOKENIZER_INPUTS if inputs else data.DEFAULT_TOKENIZER_EMBEDDED),
        val_fraction=_fraction(val_fraction, "--val-fraction"),
        workers=data.default_workers() if workers is None else parse_count(workers, "--workers"),
        clean=data.CleanConfig(min_chars=parse_count(min_chars, "--min-chars")),
        shard_tokens=parse_count(shard_tokens, "--shard-tokens"),
        max_docs=None if max_docs is None else parse_count(max_docs, "--max-docs"),
    )
    out = Path(out)
    data.check_out_dir(out, force)
    sources = data.resolve_inputs(inputs, text_field=text_field) if inputs else data.embedded_sources()
    notes: list[str] = []
    try:
        with _ProgressBars(console) as bars:
            result = data.prepare(sources, out, config, force=force, progress=bars.update, notes=notes.append)
    except data.Interrupted as e:
        done = (f"the new corpus was already complete and is in {out}" if e.completed else
                f"removed its temporary files, nothing written to {out}")
        _exit_one_line(f"prepare {e}; {done}", 128 + e.signum)
    except OSError as e:  # the environment failed (a full disk, a directory gone): not bad input
        where = e.filename or out
        _exit_one_line(f"{where}: {e.strerror or e} (errno {e.errno}) while preparing into {out}; removed its "
                       "temporary files, nothing written", 1)
    finally:  # on stdout: a failure's stderr is its one line
        for line in notes:
            Console(highlight=False).print(f"[yellow]note:[/] {line}", soft_wrap=True)
    _print_summary(result, config, time.perf_counter() - started)


def _exit_one_line(message: str, code: int) -> None:
    import sys

    print("memplan: error: " + " ".join(message.split()), file=sys.stderr)
    raise SystemExit(code)


def _fraction(text: str, what: str) -> float:
    from memplan.errors import InputError

    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{what}: {text!r} is not a number; use a fraction such as 0.05") from None
    if value != value:  # NaN
        raise InputError(f"{what}: {text!r} is not a number; use a fraction such as 0.05")
    return value


class _ProgressBars:
    """rich progress for the stages ``prepare`` reports: read, tokenizer, tokenize."""

    _LABELS = {"read": "reading and cleaning", "tokenizer": "building the tokenizer", "tokenize": "tokenizing"}

    def __init__(self, console):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                   TimeElapsedColumn)

        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True)
        self._tasks: dict[str, int] = {}

    def __enter__(self):
        self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self._progress.__exit__(*exc)

    def update(self, stage: str, done: int, total: int | None) -> None:
        if stage not in self._tasks:
            for other in self._tasks.values():  # a new stage means the earlier ones finished
                t = self._progress.tasks[other]
                self._progress.update(other, total=t.completed if t.total is None else t.total,
                                      completed=t.completed if t.total is None else t.total)
            self._tasks[stage] = self._progress.add_task(self._LABELS.get(stage, stage), total=total)
        self._progress.update(self._tasks[stage], completed=done, total=total)


def _print_summary(result, config, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    from memplan.cli.fit import fits
    from memplan.units import format_count
    from trainer.data import VAL_SPLIT_TOLERANCE

    m = result.manifest
    headers = ("source", "docs", "chars", "tokens", "val", "dups", "filtered")
    rows = [[s.name, s.documents, s.characters, s.tokens, s.val_tokens, s.duplicates_dropped, s.filtered_dropped]
            for s in result.stats]
    rows.append(["total", *(sum(r[i] for r in rows) for i in range(1, len(headers)))])
    cells = [[r[0], *(f"{v:,}" for v in r[1:])] for r in rows]
    caption = ("docs and chars: kept documents and their characters; tokens: all, one end-of-text per document "
               "included; val: tokens held out; dups and filtered: documents dropped (stats.json has the details)")

    def table_of(columns, title, caption):
        table = Table(title=title, caption=caption, caption_justify="left", title_justify="left")
        for i in columns:  # never squeeze a number: columns are as wide as their widest cell
            table.add_column(headers[i], justify="left" if i == 0 else "right", no_wrap=True,
                             min_width=max(len(c[i]) for c in cells))
        for c in cells:
            table.add_row(*(c[i] for i in columns), style="bold" if c is cells[-1] else None)
        return table

    out = Console(highlight=False)
    width = sum(max(len(h), max(len(c[i]) for c in cells)) + 3 for i, h in enumerate(headers)) + 1
    if out.width < width and not out.is_terminal:
        out = Console(width=width, highlight=False)  # piped: print the whole table rather than cut numbers
    title = f"Prepared corpus in {result.out}"
    table = table_of(range(len(headers)), title, caption)
    if fits(out, table):
        out.print(table)
    else:  # a narrow terminal: the kept and the dropped in two tables, each number whole
        out.print(table_of((0, 1, 2, 3, 4), title, None))
        out.print(table_of((0, 5, 6), None, caption))
    tok, t = m["tokenizer"], result.seconds
    n_shards = len(m["train"]["shards"]) + len(m["val"]["shards"])
    tokens = rows[-1][3]
    rate = f" ({format_count(tokens / t['tokenize'])} tokens/s)" if t.get("tokenize") else ""
    out.print(f"tokenizer {tok['spec']}: vocab {m['vocab_size']:,}, eot id {m['eot_id']}, sha256 {tok['sha256'][:12]}; "
              f"{n_shards} {m['dtype']} shard(s)")
    out.print(f"{seconds:.1f} s in all: read and clean {t.get('read', 0):.1f} s, tokenizer {t.get('tokenizer', 0):.1f} s, "
              f"tokenize and write {t.get('tokenize', 0):.1f} s{rate} with {config.workers} worker(s)")
    for s in result.stats:
        if s.val_split == "window":
            share = s.val_tokens / s.tokens if s.tokens else 0.0
            out.print(f"[yellow]note:[/] source {s.name!r}: {plural(s.documents, 'document')}; whole documents cannot hold "
                      f"out {config.val_fraction:.0%} (within ±{VAL_SPLIT_TOLERANCE:.0%} of it), so held out the "
                      f"last {s.val_tokens:,} of its "
                      f"{s.tokens:,} tokens ({share:.1%}) by cutting document {s.val_start_document + 1} at a space "
                      "(manifest: val_split \"window\")")
        elif s.documents and not s.val_documents and config.val_fraction > 0:
            out.print(f"[yellow]note:[/] source {s.name!r} has {plural(s.documents, 'document')}: nothing held out for it")
        if s.skipped_files:
            out.print(f"[yellow]warning:[/] source {s.name!r}: skipped {len(s.skipped_files)} file(s) that are not "
                      f"text: " + "; ".join(f"{p} ({why})" for p, why in s.skipped_files),
                      soft_wrap=True)  # whole lines: a path folded at the terminal's width cannot be copied

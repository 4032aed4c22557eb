"""Fitting what the commands print into the terminal's width (80 columns is the width to read well at)."""

from __future__ import annotations


def natural_width(console, renderable) -> int:
    """The columns ``renderable`` takes unwrapped (a table with every cell on one line)."""
    from rich.measure import Measurement

    return Measurement.get(console, console.options.update_width(10_000), renderable).maximum


def fits(console, renderable) -> bool:
    """Whether ``renderable`` prints within ``console``'s width without wrapping a cell."""
    return natural_width(console, renderable) <= console.width


def _one_paragraph_per_line(text: str) -> str:
    """A docstring with each paragraph's lines joined (rich help keeps single newlines, which break the
    help text in mid-sentence at any width but the source's); lists and indented blocks stay as written."""
    import inspect

    out = []
    for para in inspect.cleandoc(text).split("\n\n"):
        lines = para.split("\n")
        if para.startswith("\b") or any(l[:1] in (" ", "-", "*", "•") or l[:2].rstrip(".").isdigit() for l in lines):
            out.append(para)
        else:
            out.append(" ".join(l.strip() for l in lines))
    return "\n\n".join(out)


def tidy_help(app) -> None:
    """Give every command of ``app`` its docstring's first paragraph on one line as the help line of
    `memplan --help`, and its docstring with joined paragraphs as its own --help text (explicit help= kept)."""
    for info in app.registered_commands:
        doc = info.callback.__doc__ if info.callback is not None else None
        if not doc or info.help is not None:
            continue
        info.help = _one_paragraph_per_line(doc)
        if info.short_help is None:
            info.short_help = info.help.split("\n\n")[0]


def print_fields(console, rows) -> None:
    """``Label  text`` lines (the Model / Setup / Device header of a command) with each text's continuation
    lines indented under its first, not under the labels, when the terminal is too narrow for one line."""
    from rich.table import Table

    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for label, text in rows:
        grid.add_row(label, text)
    console.print(grid)


def print_described(console, build) -> None:
    """A table whose last column describes each row: ``build(True)`` with that column where every row fits on
    one line, else ``build(False)`` without it and the descriptions under it as ``name  description`` lines.

    ``build(with_descriptions)`` returns ``(table, [(name, description), ...])``."""
    from rich.table import Table

    table, described = build(True)
    if fits(console, table):
        console.print(table)
        return
    table, described = build(False)
    console.print(table)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(style="dim")
    for name, text in described:
        if text:
            grid.add_row(name, text)
    console.print(grid)


def print_hanging(console, label: str, text: str) -> None:
    """``label`` then ``text``, the text's continuation lines indented under its first (``  memory: ...``
    lines of a summary) rather than at the left edge, when the terminal is too narrow for one line."""
    from rich.table import Table

    grid = Table.grid()
    grid.add_column(no_wrap=True)
    grid.add_column()
    grid.add_row(label, text)
    console.print(grid)


LABEL_MAX_CHARS = 40  # a longer head before the first ": " is not a label: the line hangs under its indent


def print_labelled(console, text: str, indent: str = "") -> None:
    """A long line that carries its own label (``analytic estimate: ...``, ``rates: ...``; rich markup allowed):
    at ``indent``, wrapped at the console's width with its continuation lines under what follows the label's
    ": " (``print_hanging``'s layout), rather than at the left edge or past the width."""
    from rich.table import Table
    from rich.text import Text

    whole = Text.from_markup(text)
    at = whole.plain.find(": ")
    label, rest = whole.divide([at + 2]) if 0 <= at < LABEL_MAX_CHARS else (Text(""), whole)
    grid = Table.grid()
    grid.add_column(no_wrap=True)
    grid.add_column()
    grid.add_row(Text(indent) + label, rest)
    console.print(grid)


def print_fitted(console, table, borderless: bool = False) -> bool:
    """Print ``table``; where its rows would wrap at this width (or ``borderless``), without its vertical
    borders (the columns then need one space between them, not three), which leaves a table's text as it
    is. Returns whether it went borderless (to print the tables that follow it alike)."""
    borderless = borderless or not fits(console, table)
    if borderless:
        from rich import box

        table.box, table.show_edge, table.pad_edge = box.SIMPLE_HEAD, False, False
        table.padding = (0, 1)
        table.collapse_padding = True
    console.print(table)
    return borderless

"""What the commands print, at 80 columns: the live training line's step count and ETA, the tables of the
commands that need no torch run, and the help line of every command in `memplan --help`."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

import pytest
from rich.console import Console

from memplan.cli.train import _ProgressView, fit_live_line, progress_count

GiB = 2**30


# ---- the live training line ---------------------------------------------------------------------------

def _train_line(step: int, total: int, eta: float):
    from trainer.records import TrainLine

    return TrainLine(step=step, total_steps=total, loss=8.3068, tokens_per_second=12345.0, mfu=0.125,
                     memory_bytes=int(1.23 * GiB), eta_seconds=eta, lr=1e-3, grad_norm=1.0, tokens=step * 1000,
                     step_seconds=0.1, time=step * 0.1, memory_step=step, micro_batch=1, grad_accum=1,
                     skipped=False)


def _render_view(updates, *, max_minutes, width: int = 80) -> list[str]:
    """The live view's line after each update (a fake trainer: the view reads its config, clock, schedule
    and prediction), rendered at ``width`` columns."""
    trainer = SimpleNamespace(config=SimpleNamespace(max_minutes=max_minutes), elapsed_seconds=0.0,
                              schedule=SimpleNamespace(fixed=True), predicted=SimpleNamespace(peak_reserved=int(1.1 * GiB)))
    console = Console(file=io.StringIO(), force_terminal=True, width=width, color_system=None)
    view = _ProgressView(console, trainer)
    shown = []
    with view:
        for step, total, fixed, elapsed, eta in updates:
            trainer.schedule.fixed, trainer.elapsed_seconds = fixed, elapsed
            view.update(_train_line(step, total, eta))
            out = io.StringIO()
            Console(file=out, width=width, color_system=None).print(view.progress.get_renderable())
            shown.append(out.getvalue().rstrip("\n"))
    return shown


def test_a_time_limited_run_counts_steps_against_its_clock_never_past_an_estimated_total():
    # the quick start's sequence: the probe steps estimated 161 steps, the run passed them, then the decay
    # fixed the total at 264
    shown = _render_view([(161, 161, False, 80.0, 100.0), (178, 161, False, 90.0, 90.0),
                          (194, 161, False, 100.0, 80.0), (210, 264, True, 150.0, 30.0)], max_minutes=3.0)
    for text in shown:
        assert "\n" not in text and len(text) <= 80, text
        for n, m in re.findall(r"step ([\d,]+)/([\d,]+)", text):
            assert int(n.replace(",", "")) <= int(m.replace(",", "")), text
    assert "step 178 1:30/3:00" in shown[1] and "/161" not in shown[1] and "ETA 1:30" in shown[1]
    assert "step 210/264 2:30/3:00" in shown[3] and "ETA 0:30" in shown[3]


def test_a_step_limited_run_shows_n_of_m_and_keeps_the_count_at_any_width():
    for width in (200, 120, 100, 80, 60, 40, 30):
        text = _render_view([(1234, 5000, True, 60.0, 180.0)], max_minutes=None, width=width)[0]
        assert "\n" not in text and len(text) <= width, (width, text)
        assert "step 1,234/5,000" in text, (width, text)
        if width >= 40:
            assert "ETA 3:00" in text, (width, text)
    wide = _render_view([(1234, 5000, True, 60.0, 180.0)], max_minutes=None, width=200)[0]
    assert "loss 8.3068 | 12.3K tok/s | MFU 12.5% | mem 1.23 GiB (pred 1.10 GiB) | ETA 3:00" in wide


def test_the_eta_counts_down_in_one_unit():
    """Issue 28: the ETA read "2.1 min", then "108.0 s" (format_seconds changes unit at 120 s); it is a clock."""
    shown = _render_view([(10, 100, True, 10.0, 126.0), (20, 100, True, 20.0, 108.0), (99, 100, True, 90.0, 0.4)],
                         max_minutes=None)
    assert ["ETA 2:06" in shown[0], "ETA 1:48" in shown[1], "ETA 0:00" in shown[2]] == [True] * 3, shown


@pytest.mark.parametrize("predicted,shown", [(1831.0, "30:31"), (4.2, "4.2 s"), (0.21, "210 ms")])
def test_the_live_line_runs_during_a_long_step(monkeypatch, predicted, shown):
    """Issue 28: a plan for a faster device takes half an hour a step here, and nothing moved before the
    first step ended. The view counts the time of the step under way against its prediction, on a terminal
    (redrawn) and on a pipe (a line every PIPE_STEP_TICK_SECONDS), both in the step time's one form
    (``_step_clock``: a 210 ms step read "predicted 0:00 a step")."""
    import time

    import memplan.cli.train as train_cli

    monkeypatch.setattr(train_cli, "STEP_TICK_SECONDS", 0.02)
    monkeypatch.setattr(train_cli, "PIPE_STEP_TICK_SECONDS", 0.05)
    trainer = SimpleNamespace(config=SimpleNamespace(max_minutes=None), elapsed_seconds=0.0, step=0,
                              schedule=SimpleNamespace(fixed=True),
                              predicted=SimpleNamespace(peak_reserved=GiB, step_seconds=predicted))
    for terminal in (True, False):
        out = io.StringIO()
        view = _ProgressView(Console(file=out, force_terminal=terminal, width=80, color_system=None), trainer)
        with view:
            time.sleep(0.3)  # the first step, still under way
            rendered = io.StringIO()
            Console(file=rendered, width=80, color_system=None).print(view.progress.get_renderable())
        text = rendered.getvalue() if terminal else out.getvalue()
        assert re.search(rf"step 1 running for \d+ ms \(predicted {shown} a step\)", text), (terminal, text)


def test_a_step_time_reads_in_one_form_at_any_length():
    """Issue 28 item 6: times in the header and the live line switched units ("2.1 min", then "108.0 s"). A step
    time is milliseconds or seconds under a minute and the ETA's clock from a minute on."""
    from memplan.cli.train import _step_clock

    assert [_step_clock(s) for s in (0.0, 0.21, 0.9994, 1.0, 4.2, 59.94, 60.0, 108.0, 126.0, 1831.0, 7384.0)] == [
        "0 ms", "210 ms", "999 ms", "1.0 s", "4.2 s", "59.9 s", "1:00", "1:48", "2:06", "30:31", "2:03:04"]


def test_the_plan_header_gives_the_step_time_as_the_eta_gives_time():
    """Issue 28: the header read "30.5 min a step" beside "ETA: 30:31 ..."; both are now the clock."""
    from memplan.cli.train import _print_plan
    from memplan.model import from_size
    from memplan.setup import TrainSetup

    setup = TrainSetup(ctx=256, micro_batch=4, precision="fp32")
    trainer = SimpleNamespace(
        run_dir="runs/x", plan=SimpleNamespace(model=from_size("1m"), setup=setup), step=0, tokens=0,
        data=SimpleNamespace(path="data/x", train_tokens=1_000_000, source_names=["a"]),
        device=SimpleNamespace(type="cpu"), profile=SimpleNamespace(name="cpu", family="cpu"), base_hf=None,
        predicted=SimpleNamespace(peak_reserved=GiB, peak_allocated=GiB // 2, tokens_per_second=72.0,
                                  step_seconds=1831.0, mfu=0.01),
        config=SimpleNamespace(max_steps=10, max_tokens=None, max_minutes=None), replaced_limits=None)
    out = io.StringIO()
    _print_plan(trainer, Console(file=out, width=200, color_system=None))
    text = " ".join(out.getvalue().split())
    assert "30:31 a step" in text and "ETA: 5:05:10 for 10 steps" in text, text


def test_the_plan_header_gives_the_step_time_and_the_eta_before_the_first_step():
    """Issue 28: the header said 72 tokens/s but neither the step time (1,831 s) nor how long the run takes."""
    from memplan.cli.train import predicted_eta_text

    def fake(max_steps=None, max_tokens=None, max_minutes=None, step_seconds=1831.0):
        return SimpleNamespace(config=SimpleNamespace(max_steps=max_steps, max_tokens=max_tokens,
                                                      max_minutes=max_minutes),
                               plan=SimpleNamespace(setup=SimpleNamespace(tokens_per_step=131072)), step=0, tokens=0,
                               predicted=SimpleNamespace(step_seconds=step_seconds),
                               data=SimpleNamespace(train_tokens=1_000_000))

    assert predicted_eta_text(fake(max_steps=10)) == "5:05:10 for 10 steps (--max-steps 10) at the predicted step time"
    assert predicted_eta_text(fake()) == "3:33:37 for 7 steps (one epoch) at the predicted step time"
    assert predicted_eta_text(fake(max_minutes=3.0)) == ("3:00 (--max-minutes 3); one step is predicted to take "
                                                        "30:31, longer than the time limit")
    assert predicted_eta_text(fake(max_minutes=3.0, step_seconds=0.5)) == (
        "3:00 (--max-minutes 3): about 360 steps at the predicted step time")


def _lines_at_80(print_it) -> list[str]:
    out = io.StringIO()
    print_it(Console(file=out, width=80, color_system=None, highlight=False))
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    assert len(lines) > 1 and all(len(line) <= 80 for line in lines), lines
    return lines


def test_long_lines_wrap_at_80_columns_indented_under_their_label():
    """Issue 28: the train header's rates line, the quick start's "Model for a 3-minute run" (about 300
    characters) and trace's comparison lines ran past 80 columns or wrapped to the left edge."""
    from memplan.cli.fit import print_labelled
    from memplan.cli.train import RichUI
    from memplan.model import from_size
    from memplan.planning import quickstart_model_line

    model = quickstart_model_line(from_size("22m").replace(vocab=4096), 4436.0, 2.5e10, True, 3.0)
    lines = _lines_at_80(lambda c: RichUI(c).say(model, soft_wrap=True))
    assert lines[0].startswith("Model for a 3-minute run: llama")
    assert all(line.startswith(" " * len("Model for a 3-minute run: ")) for line in lines[1:]), lines
    rates = ("[dim]rates: this machine's calibration of 2026-12-02, 1 thread, spread 22%, 32% of a core free; now "
             "40%-97% of a core free over 5 probes, too unsteady to predict wall time: times predicted are CPU "
             "time[/]")
    lines = _lines_at_80(lambda c: print_labelled(c, rates, indent="  "))
    assert lines[0].startswith("  rates: this machine's")
    assert all(line.startswith(" " * len("  rates: ")) for line in lines[1:]), lines
    trace = ("memplan's own model of this shape: 12.60 GiB (-32.76% against the transformers trace); fits in "
             "3.60 GiB on gtx-1650")
    lines = _lines_at_80(lambda c: print_labelled(c, trace))
    assert all(line.startswith(" " * len("memplan's own model of this shape: ")) for line in lines[1:]), lines


def test_the_live_line_drops_the_lowest_priority_fields_first():
    fields = {"loss": "loss 8.3068", "tokens/s": "12.3K tok/s", "mfu": "MFU 12.5%", "memory": "mem 1.23 GiB",
              "eta": "ETA 31.6 s"}
    count = progress_count(210, 264, True)
    seen = []
    for width in range(200, 20, -1):
        status, bar = fit_live_line(width, count, fields, "(pred 1.10 GiB)")
        assert 1 + 1 + len(count) + (1 + bar if bar else 0) + (1 + len(status) if status else 0) < width
        seen.append(tuple(f for f in ("pred", "MFU", "mem", "tok/s", "loss", "ETA") if f in status))
    order = []  # the fields in the order they disappear as the terminal narrows
    for before, after in zip(seen, seen[1:]):
        order += [f for f in before if f not in after]
    assert order == ["pred", "MFU", "mem", "tok/s", "loss", "ETA"]


def test_progress_count_never_shows_a_total_the_run_has_passed():
    assert progress_count(178, 161, True) == "step 178"
    assert progress_count(178, 161, False) == "step 178"
    assert progress_count(150, 161, False) == "step 150"  # an estimate is not shown as a total
    assert progress_count(150, 161, True) == "step 150/161"
    assert progress_count(12, None, False, 7300.0, 7400.0) == "step 12 2:01:40/2:03:20"


def test_a_time_limited_run_before_its_decay_has_the_time_left_as_its_eta():
    pytest.importorskip("torch")
    from trainer.loop import Trainer
    from trainer.schedule import Schedule

    def eta(step: int, *, fixed: bool, elapsed: float, max_minutes=3.0, max_steps=None) -> float:
        schedule = Schedule(peak_lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=161, kind="wsd",
                            decay_start=150 if fixed else None)
        fake = SimpleNamespace(config=SimpleNamespace(max_steps=max_steps, max_tokens=None, max_minutes=max_minutes),
                               schedule=schedule, step=step, tokens=step * 1000, elapsed_seconds=elapsed,
                               setup=SimpleNamespace(tokens_per_step=1000), _recent=[0.5, 0.5, 0.5])
        return Trainer._eta(fake)

    # past the probe steps' estimate of 161 steps, with 90 s of the 180 left: 90 s, not 0
    assert eta(178, fixed=False, elapsed=90.0) == pytest.approx(90.0, abs=1e-9)
    # below the estimate too: the run goes on until its time is up
    assert eta(100, fixed=False, elapsed=30.0) == pytest.approx(150.0, abs=1e-9)
    # once the decay has fixed the total: the steps left at the recent step time, capped by the time left
    assert eta(156, fixed=True, elapsed=170.0) == pytest.approx(2.5)
    assert eta(100, fixed=True, elapsed=170.0) == pytest.approx(10.0, abs=1e-9)


# ---- the commands at 80 columns ------------------------------------------------------------------------

WIDTH = 80
CUT = re.compile(r"\S…")  # rich's mark of a cell cut short (an intended "…" follows a space: "1, 2, … 256")
TIME = r"[\d.,]+ (?:s|ms|µs)"
BYTES = r"[\d.,]+ (?:B|KiB|MiB|GiB|TiB)"


def _at_80(memplan_cli, *args: str) -> list[str]:
    """The lines `memplan ARGS` prints with COLUMNS=80 (through a pipe, as a terminal of 80 columns would get
    them), checked to fit: none longer than 80 characters, none with a cell cut short."""
    result = memplan_cli(*args, env={"COLUMNS": str(WIDTH)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines
    for line in lines:
        assert len(line) <= WIDTH, f"{len(line)} columns: {line!r}"
        assert not CUT.search(line), f"a cell cut short: {line!r}"
    return lines


def _line_with(lines: list[str], pattern: str) -> str:
    found = [l for l in lines if re.search(pattern, l)]
    assert found, f"no line matches {pattern!r}:\n" + "\n".join(lines)
    return found[0]


@pytest.mark.parametrize("args", [
    ("--params", "1b", "--ctx", "8k", "--device", "strix-halo"),
    ("--params", "7b", "--ctx", "4k", "--device", "h100-sxm", "--world-size", "8", "--sharding", "fsdp", "--tokens", "1b"),
])
def test_estimate_fits_80_columns_with_each_row_on_one_line(memplan_cli, args):
    lines = _at_80(memplan_cli, "estimate", *args)
    for term in ("weights", "optimizer", "activations", "runtime", "peak reserved"):  # the memory table
        _line_with(lines, rf"^│ {term} +│ +{BYTES} │")
    for term in ("forward", "backward", "attention", "loss", "optimizer"):  # the step-time table
        row = _line_with(lines, rf"^│ {term} +│ +{TIME} │")
        assert re.search(r"│ +\d+% │ (compute|mem)", row), row
    assert re.search(rf"│ step +│ +{TIME} │ +100% │", "\n".join(lines))
    # what the narrow table leaves out is under it, one line per term
    assert _line_with(lines, r"^backward +their gradients")
    assert _line_with(lines, r"^mem +memory bandwidth")


def test_estimate_inference_fits_80_columns(memplan_cli):
    lines = _at_80(memplan_cli, "estimate", "--mode", "inference", "--params", "1b", "--ctx", "8k", "--device", "rtx-4090")
    for term in ("weights", "kv cache", "activations", "logits", "runtime", "peak reserved"):
        _line_with(lines, rf"^│ {term} +│ +{BYTES} │")


def test_profiles_fit_80_columns_with_each_device_on_one_line(memplan_cli):
    from memplan.hardware import profile_names

    lines = _at_80(memplan_cli, "profiles")
    for name in profile_names():
        row = _line_with(lines, rf"^│ {re.escape(name)} +│")
        assert re.search(r"│ +[\d.]+ / [\d.]+ │ +[\d,]+ │ +(fp32|tf32|bf16|fp16) [\d,.]+ │$", row), row
        _line_with(lines, rf"^{re.escape(name)} +\S")  # its title, under the table
    assert _line_with(lines, r"^files: .*NAME\.toml$")


def test_profiles_keep_the_wide_table_where_it_fits(memplan_cli):
    result = memplan_cli("profiles", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    assert re.search(r"│ strix-halo +│ AMD Ryzen AI Max\+ 395 / Radeon 8060S \(Strix Halo, 128 GB\) +│ rocm +│",
                     result.stdout), result.stdout


@pytest.mark.parametrize("args", [
    ("--params", "22m", "--ctx", "512", "--device", "rtx-4090"),
    ("--params", "350m", "--ctx", "1k", "--device", "h100-sxm", "--world-size", "8"),
])
def test_autotune_fits_80_columns_with_each_configuration_on_one_line(memplan_cli, args):
    lines = _at_80(memplan_cli, "autotune", *args)
    ranked = [l for l in lines if re.match(r"^(→|\d) +\d+×\d+ ", l)]
    assert len(ranked) == 8, "\n".join(lines)  # --top 8 rows, each on one line with its numbers
    for row in ranked:
        assert re.search(r" [\d.]+(?: GiB)? +[\d,]+ +(plan|[+-][\d.]+%)$", row), row
    rejected = [l for l in lines if re.match(r"^ *\d+×\d+ ", l)]
    assert rejected and all(re.search(r"\+[\d.]+(?: GiB)? +[\d,]+$", l) for l in rejected), "\n".join(rejected)


def test_sweep_fits_80_columns_splitting_a_wide_grid(memplan_cli):
    batches = (1, 2, 4, 8, 16, 32, 64, 128)
    lines = _at_80(memplan_cli, "sweep", "--params", "124m", "--ctx", "1k,2k", "--batch", ",".join(map(str, batches)),
                   "--checkpointing", "none,full", "--device", "rtx-4090", "--tokens", "1b")
    text = "\n".join(lines)
    for b in batches:  # every column header whole, once per variant
        assert len(re.findall(rf"┃ batch {b} ┃", text)) == 2, text
    # each context's first line holds a memory figure for every micro-batch of that part of the grid
    for line in lines:
        if re.match(r"^│ +[12]k │", line):
            cells = line.strip("│").split("│")[1:]
            assert all(re.search(r"\d", c) for c in cells), line


def test_every_command_has_its_help_line_at_80_columns(memplan_cli):
    from memplan.cli import app

    lines = _at_80(memplan_cli, "--help")
    names = [info.name for info in app.registered_commands]
    assert "profiles" in names and len(names) >= 13
    for name in names:
        row = _line_with(lines, rf"^│ {name} ")
        assert re.search(rf"^│ {name} +\w.*│$", row), f"{name} has no help line: {row!r}"


def _lines_at_80(print_fn, *args) -> list[str]:
    out = io.StringIO()
    print_fn(Console(file=out, width=WIDTH, color_system=None), *args)
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    for line in lines:
        assert len(line) <= WIDTH and not CUT.search(line), line
    return lines


def test_validate_tables_fit_80_columns_with_every_bundled_config_on_one_line():
    from memplan.cli.validate import print_inference_tables, print_validation_table
    from memplan.validate import InferenceRow, ValidationRow, load_inference_matrix, load_matrix, matrix_names

    # every bundled config's name, with the longest peak moments the memory walk names (memplan/memory.py)
    names = sorted({c.name for m in matrix_names() for c in load_matrix(m)})
    moments = ["backward: last block's all-gather (prefetch)", "backward: recomputing the last block", "backward: loss",
               "optimizer step"]
    rows = [ValidationRow(name=n, spec=None, setup=None, predicted_allocated=123_456_789 * (i + 1),
                          measured_allocated=120_000_000 * (i + 1), trace_allocated=None if i % 3 else 121_000_000 * (i + 1),
                          peak_moment=moments[i % len(moments)]) for i, n in enumerate(names)]
    lines = _lines_at_80(print_validation_table, rows, "cpu, each rank of 2 gloo processes")
    for r in rows:
        row = _line_with(lines, rf"^{re.escape(r.name)} +{BYTES} +{BYTES} +[+-][\d.]+% +(-|[+-][\d.]+%) +[a-d]$")
        assert row
    for key, moment in zip("abcd", moments):  # the legend under the table
        _line_with(lines, rf"^{key}: +{re.escape(moment)}")

    inference = [InferenceRow(name=c.name, spec=None, setup=None, predicted_prefill=123_456_789,
                              measured_prefill=120_000_000, predicted_decode=23_456_789, measured_decode=23_000_000,
                              decode_step_seconds=0.0123, roofline_step_seconds=0.00456,
                              predicted_step_seconds=0.00789)
                 for c in load_inference_matrix("default")]
    lines = _lines_at_80(print_inference_tables, inference, "cpu")
    for r in inference:
        _line_with(lines, rf"^{re.escape(r.name)} +{BYTES} +[+-][\d.]+% +{BYTES} +[+-][\d.]+%$")
        _line_with(lines, rf"^{re.escape(r.name)} +{TIME} +{TIME} +[\d.]+ +{TIME}$")


@pytest.mark.parametrize("command, extra", [("trace", "memplan[stacks]"), ("trace", "memplan[torchtune]"),
                                            ("validate", "memplan[stacks]"), ("train", "memplan[logging]")])
def test_help_names_the_extras_with_their_brackets(command, extra, monkeypatch):
    """rich reads "[stacks]" as markup and drops it: the help must escape it, or it tells people to
    `pip install 'memplan'`."""
    from typer.testing import CliRunner

    from memplan.cli import app

    monkeypatch.setenv("COLUMNS", "400")
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0
    assert extra in " ".join(result.output.replace("│", " ").split())


def test_help_names_what_each_option_takes_not_its_python_type():
    """Issue 28: `--help` showed every option as <str>, even counts (numbers are taken as text to parse 8k, 2b and
    512MiB). Each option declares what it takes (N, SIZE, PATH, PRECISION, ...)."""
    from typer.main import get_command

    from memplan.cli import app

    shown = {}

    def walk(command, path):
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
            return
        ctx = command.context_class(command)
        for p in command.params:
            if p.param_type_name == "option" and not getattr(p, "is_flag", False):
                shown[(" ".join(path), p.opts[0])] = p.make_metavar(ctx=ctx)

    walk(get_command(app), [])
    assert shown and not {k: v for k, v in shown.items() if v.startswith("<")}
    assert shown[("train", "--max-steps")] == "N" and shown[("estimate", "--ctx")] == "N"
    assert shown[("autotune", "--budget")] == "SIZE" and shown[("estimate", "--precision")] == "PRECISION"


def test_counts_and_possessives_read_as_english(tmp_path):
    """Issue 28: "transformers's", "1 documents"."""
    from typer.testing import CliRunner

    from memplan.cli import app
    from memplan.units import plural, possessive

    assert (plural(1, "document"), plural(2, "document"), plural(0, "duplicate")) == (
        "1 document", "2 documents", "0 duplicates")
    assert (possessive("transformers"), possessive("memplan")) == ("transformers'", "memplan's")
    out = CliRunner().invoke(app, ["estimate", "--model", "smollm2-135m", "--stack", "transformers", "--ctx", "256",
                                   "--device", "rtx-4090"])
    assert out.exit_code == 0, out.output
    assert "transformers' step" in out.stdout and "transformers's" not in out.stdout
    (tmp_path / "one.txt").write_text("too short")
    out = CliRunner().invoke(app, ["prepare", "--input", str(tmp_path / "one.txt"), "--out", str(tmp_path / "p")])
    assert out.exit_code == 2 and "1 document read" in out.stderr, out.output


def test_a_count_of_flops_takes_its_si_prefix_and_a_space():
    """estimate's time line printed "826.63BFLOP per step": a billion parameters' B on a count of operations."""
    from memplan.units import format_flop
    assert format_flop(826.63e9) == "826.63 GFLOP"
    assert format_flop(56.14e12) == "56.14 TFLOP"
    assert format_flop(3.2e15) == "3.20 PFLOP"
    assert format_flop(512) == "512 FLOP"


def test_estimates_time_line_gives_the_flops_of_a_step_in_si_units():
    from typer.testing import CliRunner

    from memplan.cli import app
    out = CliRunner().invoke(app, ["estimate", "--params", "1.1b", "--ctx", "2k", "--batch", "4",
                                   "--device", "rtx-4090"], env={"COLUMNS": "200"}).output
    assert " TFLOP per step" in out and "BFLOP" not in out

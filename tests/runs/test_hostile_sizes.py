"""Work that grows without bound from one flag (issue 29, items 4 and 5c): a trace takes at most two
micro-batches whatever --grad-accum says (the rest's token ids added back exactly); a deep trace is predicted and
refused above a bound in one line; generate refuses going past the context window unless --sliding-window asks,
and says its progress and rate on a long generation; finetune refuses a --ctx no row of which can fit before
cutting the data into rows of that length. Each command runs under an alarm, so a command that would run
unbounded fails the test instead of hanging it."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runs_helper import one_line_error, tiny_corpus, tiny_run, tiny_spec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()


@contextlib.contextmanager
def within(seconds: float):
    """Fail (TimeoutError) if the block runs longer than ``seconds``."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: unbounded")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def cli(*args, seconds: float = 120):
    with within(seconds):
        return runner.invoke(app, list(args), catch_exceptions=False)


# ---- trace ---------------------------------------------------------------------------------------------

def test_a_trace_of_many_micro_batches_equals_the_full_trace(monkeypatch):
    """Two micro-batches traced, the other two's ids added back: the peak and split of tracing all four."""
    from memplan.setup import TrainSetup
    from trainer import measure

    spec, setup = tiny_spec("llama", 300, layers=1), TrainSetup(ctx=16, micro_batch=3, grad_accum=4, precision="fp32")
    capped = measure.trace_step(spec, setup, "cpu")
    monkeypatch.setattr(measure, "TRACED_ACCUMULATION", 100)
    full = measure.trace_step(spec, setup, "cpu")
    assert capped.peak_allocated == full.peak_allocated
    assert capped.breakdown == full.breakdown


def test_trace_with_a_million_micro_batches_answers():
    result = cli("trace", "--arch", "llama", "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "300", "--ctx",
                 "256", "--grad-accum", "1000000", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["setup"]["grad_accum"] == 1000000
    ids = 1000000 * 2 * 256 * 8  # every micro-batch's token ids and targets, int64, live through the step
    assert data["memory"]["peak_allocated"] > ids
    assert abs(data["trace"]["analytic_error"]) < 0.05  # the analytic walk counts them the same


@pytest.mark.slow
def test_trace_of_thousands_of_layers_is_refused_with_its_predicted_time():
    # 5,000 layers: about 20 min of tracing on this project's CPU, far past the 3-minute bound on any machine
    # (1,000 layers are about 4 min here when the machine is quiet, close enough to the bound to go either way)
    result = cli("trace", "--params", "22m", "--ctx", "256", "--layers", "5000", seconds=150)
    line = one_line_error(result, "--layers 5000", "predicted to take", "memplan estimate", "MEMPLAN_TRACE_SECONDS")
    assert " min" in line or " h" in line


def test_the_trace_time_bound_can_be_raised(monkeypatch):
    from memplan.errors import InputError
    from memplan.setup import TrainSetup
    from trainer import measure

    spec, setup = tiny_spec("llama", 300, layers=60), TrainSetup(ctx=64, micro_batch=1, precision="fp32")
    clock, calls = [0.0], []

    class FakeTime:  # measure's clock, advanced by the stand-in tracer: 0.05 s fixed, 0.01 s a layer
        @staticmethod
        def perf_counter():
            return clock[0]

    def tracer(s, st):
        calls.append(s.layers)
        clock[0] += 0.05 + 0.01 * s.layers

    monkeypatch.setattr(measure, "time", FakeTime)
    monkeypatch.setenv(measure.TRACE_SECONDS_ENV, "0.6")
    with pytest.raises(InputError, match=r"--layers 60: the trace is predicted to take 650 ms"):
        measure.check_trace_time(spec, setup, tracer)
    assert calls == list(measure.PROBE_LAYERS)  # two shallow probes, not the deep trace
    monkeypatch.setenv(measure.TRACE_SECONDS_ENV, "5")
    measure.check_trace_time(spec, setup, tracer)
    monkeypatch.setenv(measure.TRACE_SECONDS_ENV, "nan")
    with pytest.raises(InputError, match="MEMPLAN_TRACE_SECONDS"):
        measure.check_trace_time(spec, setup, tracer)


# ---- generate ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    return tiny_run(root / "run", tiny_corpus(root), steps=2, ctx=32)


def test_generate_beyond_the_context_is_refused_without_sliding_window(run):
    result = cli("generate", "--run", str(run), "--prompt", "Once", "--max-new-tokens", "1000000000", seconds=60)
    one_line_error(result, "--max-new-tokens 1,000,000,000", "context window of 32 tokens", "--sliding-window")


def test_generate_with_sliding_window_goes_past_the_context_and_says_its_progress(run, monkeypatch):
    from memplan.cli import generate

    monkeypatch.setattr(generate, "PROGRESS_SECONDS", 0.0)
    result = cli("generate", "--run", str(run), "--prompt", "Once", "--max-new-tokens", "70", "--greedy",
                 "--sliding-window", seconds=60)
    assert result.exit_code == 0, result.output
    assert "generating: 70 of 70 tokens" in result.stderr and "tokens/s" in result.stderr
    assert "was full" in result.stderr  # the window of 32 shifted


# ---- finetune --ctx --------------------------------------------------------------------------------------

def test_finetune_ctx_no_row_of_which_fits_is_refused_before_rows_are_made(run, tmp_path):
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Q {i}?", "response": f"A {i}."}) + "\n" for i in range(8)))
    out = tmp_path / "out"
    result = cli("finetune", "--run", str(run), "--data", str(sft), "--ctx", "1000000000", "--batch", "1",
                 "--max-steps", "1", "--out", str(out), seconds=60)
    one_line_error(result, "--ctx 1,000,000,000", "one row", "use a shorter --ctx")
    assert not out.exists()

"""`memplan sweep`: the what-if grid, its JSON, its terminal table and its HTML page.

Every cell must be exactly what `memplan estimate` says for that setup; these tests compare them
cell by cell rather than trusting the grid's shortcut (see memplan/sweep.py).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import InputError
from memplan.estimate import estimate
from memplan.hardware import load_profile
from memplan.model import resolve
from memplan.setup import TrainSetup
from memplan.sweep import AXES, MAX_CELLS, SweepAxes, pareto_front, parse_counts, sweep

ROOT = Path(__file__).resolve().parents[2]
ESTIMATE_KEYS = {"setup", "memory", "fits", "max_micro_batch", "time"}


def run(*args: str):
    return CliRunner().invoke(app, ["sweep", *args])


def run_json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output + result.stderr
    return json.loads(result.stdout)


def small_grid(**changes) -> SweepAxes:
    axes = dict(ctx=(1024, 4096), micro_batch=(1, 8), attention=("eager", "sdpa"), checkpointing=("none", "full"),
                precision=("bf16-mixed",))
    return SweepAxes(**{**axes, **changes})


# ---- the grid is the estimate of each cell -------------------------------------------------

def test_every_cell_equals_estimate_of_its_setup():
    spec, dev = resolve(params="124m"), load_profile("rtx-4090")
    base = TrainSetup(grad_accum=4, optimizer="sgd")
    sw = sweep(spec, base, dev, small_grid(), tokens=10**9)
    assert len(sw.cells) == 2 * 2 * 2 * 2 * 1
    for cell in sw.cells:
        assert cell == estimate(spec, cell.setup, dev, 10**9)
        assert cell.setup.grad_accum == 4 and cell.setup.optimizer == "sgd"  # fixed fields reach every cell


def test_cells_are_ordered_attention_checkpointing_precision_context_batch():
    spec, dev = resolve(params="22m"), load_profile("cpu")
    axes = small_grid(precision=("bf16-mixed", "fp32"))
    sw = sweep(spec, TrainSetup(), dev, axes)
    got = [(c.setup.attention, c.setup.checkpointing, c.setup.precision, c.setup.ctx, c.setup.micro_batch)
           for c in sw.cells]
    want = [(a, k, p, t, b) for a in axes.attention for k in axes.checkpointing for p in axes.precision
            for t in axes.ctx for b in axes.micro_batch]
    assert got == want


def test_json_cells_match_memplan_estimate_json():
    grid = run_json("--params", "124m", "--device", "rtx-4090", "--ctx", "1k,8k", "--batch", "1,4",
                    "--attention", "eager,sdpa", "--tokens", "1b")
    for cell in grid["cells"][::3]:
        s = cell["setup"]
        one = CliRunner().invoke(app, ["estimate", "--params", "124m", "--device", "rtx-4090", "--ctx", str(s["ctx"]),
                                       "--batch", str(s["micro_batch"]), "--attention", s["attention"],
                                       "--tokens", "1b", "--json"])
        assert one.exit_code == 0, one.output
        expected = json.loads(one.stdout)
        terms = expected["memory"].pop("runtime_terms")  # estimate's only (docs/json.md): runtime by term
        assert sum(terms.values()) == expected["memory"]["runtime"]
        assert {k: cell[k] for k in ESTIMATE_KEYS} == {k: expected[k] for k in ESTIMATE_KEYS}
        assert grid["model"] == expected["model"] and grid["device"] == expected["device"]


def test_json_keys():
    grid = run_json("--params", "22m", "--device", "gtx-1650", "--ctx", "512,2k", "--batch", "1,2",
                    "--checkpointing", "none,selective", "--precision", "fp32,bf16-mixed")
    assert set(grid) == {"model", "device", "axes", "tokens", "cells", "fitting", "best"}
    assert grid["axes"] == {"ctx": [512, 2048], "micro_batch": [1, 2], "attention": ["sdpa"],
                            "checkpointing": ["none", "selective"], "precision": ["fp32", "bf16-mixed"]}
    assert set(grid["axes"]) == set(AXES)
    assert grid["tokens"] is None
    assert len(grid["cells"]) == 16
    for cell in grid["cells"]:
        assert set(cell) == ESTIMATE_KEYS | {"pareto"}
        assert set(cell["memory"]) == {"weights", "gradients", "optimizer", "activations", "logits", "temporaries",
                                       "runtime", "peak_allocated", "peak_reserved", "peak_phase"}
        assert {"flops_per_step", "step_seconds", "tokens_per_second", "mfu", "epoch_seconds"} <= set(cell["time"])
        assert cell["time"]["epoch_seconds"] is None
    assert grid["fitting"] == sum(c["fits"] for c in grid["cells"])


def test_tokens_give_every_cell_its_epoch_time():
    grid = run_json("--params", "22m", "--device", "cpu", "--ctx", "1k,2k", "--tokens", "10m")
    assert grid["tokens"] == 10_000_000
    for cell in grid["cells"]:
        t = cell["time"]
        assert t["epoch_seconds"] == pytest.approx(10_000_000 / t["tokens_per_second"], rel=0.02)


# ---- does it fit ---------------------------------------------------------------------------

def test_does_not_fit_cells_are_marked_in_json_and_table():
    args = ("--params", "124m", "--device", "gtx-1650", "--ctx", "1k,2k,4k,8k", "--batch", "1,2,8")
    grid = run_json(*args)
    usable = grid["device"]["usable_bytes"]
    fits = [c["fits"] for c in grid["cells"]]
    assert fits == [c["memory"]["peak_reserved"] <= usable for c in grid["cells"]]
    assert any(fits) and not all(fits), "the example should have both kinds of cell"

    table = run(*args)
    assert table.exit_code == 0, table.output
    marked = sorted(float(m) for m in re.findall(r"✗ (\d+(?:\.\d+)?)", table.stdout))
    too_big = sorted(c["memory"]["peak_reserved"] / 2**30 for c in grid["cells"] if not c["fits"])
    assert len(marked) == len(too_big)
    assert marked == pytest.approx(too_big, rel=0.01)  # printed in GiB, three figures
    assert "GiB" in table.stdout and "does not fit in 3.81 GiB usable on gtx-1650" in " ".join(table.stdout.split())


def test_the_fastest_cell_that_fits_is_named():
    grid = run_json("--params", "124m", "--device", "rtx-4090", "--ctx", "1k,4k", "--batch", "1,4,16")
    fitting = [i for i, c in enumerate(grid["cells"]) if c["fits"]]
    assert grid["best"] == max(fitting, key=lambda i: grid["cells"][i]["time"]["tokens_per_second"])
    best = grid["cells"][grid["best"]]["setup"]
    out = " ".join(run("--params", "124m", "--device", "rtx-4090", "--ctx", "1k,4k", "--batch", "1,4,16").stdout.split())
    assert f"Fastest that fits: ctx {best['ctx'] // 1024}k, batch {best['micro_batch']}," in out


def test_nothing_fits_is_an_answer_not_an_error():
    result = run("--params", "1b", "--device", "gtx-1650", "--ctx", "4k,8k", "--batch", "4")
    assert result.exit_code == 0, result.output
    assert "Nothing in this grid fits" in result.stdout
    grid = run_json("--params", "1b", "--device", "gtx-1650", "--ctx", "4k,8k", "--batch", "4")
    assert grid["best"] is None and grid["fitting"] == 0
    assert not any(c["pareto"] for c in grid["cells"])


# ---- the Pareto front ----------------------------------------------------------------------

def test_pareto_front_of_a_hand_made_example():
    #           memory, tokens/s
    points = [(10.0, 100.0),  # 0: front (least memory)
              (12.0, 90.0),   # 1: beaten by 0 (more memory, slower)
              (15.0, 150.0),  # 2: front
              (15.0, 140.0),  # 3: beaten by 2 (same memory, slower)
              (20.0, 150.0),  # 4: beaten by 2 (more memory, same speed)
              (25.0, 200.0),  # 5: front
              (25.0, 200.0),  # 6: equal to 5, so on the front too
              (30.0, 190.0)]  # 7: beaten by 5
    assert pareto_front(points) == [0, 2, 5, 6]
    assert pareto_front([]) == []
    assert pareto_front([(1.0, 1.0)]) == [0]


def _dominated(p, q) -> bool:
    """q beats p: no more memory, no less speed, and better in one."""
    return q[0] <= p[0] and q[1] >= p[1] and (q[0] < p[0] or q[1] > p[1])


def test_pareto_front_agrees_with_the_definition_on_random_points():
    rng = random.Random(9)
    for _ in range(50):
        points = [(float(rng.randint(1, 12)), float(rng.randint(1, 12))) for _ in range(rng.randint(1, 40))]
        brute = [i for i, p in enumerate(points) if not any(_dominated(p, q) for q in points)]
        assert sorted(pareto_front(points)) == brute


def test_grid_front_is_the_undominated_cells_that_fit():
    grid = run_json("--params", "124m", "--device", "rtx-4090", "--ctx", "1k,2k,4k,8k", "--batch", "1,4,16",
                    "--checkpointing", "none,full")
    pts = [(c["memory"]["peak_reserved"], c["time"]["tokens_per_second"]) for c in grid["cells"]]
    fitting = [i for i, c in enumerate(grid["cells"]) if c["fits"]]
    expected = {i for i in fitting if not any(_dominated(pts[i], pts[j]) for j in fitting)}
    assert {i for i, c in enumerate(grid["cells"]) if c["pareto"]} == expected
    assert len(expected) >= 2


# ---- list parsing and bad input ------------------------------------------------------------

def test_lists_parse_with_units_sorted_and_without_repeats():
    grid = run_json("--params", "22m", "--device", "cpu", "--ctx", "4k, 1k,1024,1.5k", "--batch", "8,2,8",
                    "--attention", "SDPA,eager")
    assert grid["axes"]["ctx"] == [1024, 1536, 4096]  # k is 1024 for contexts
    assert grid["axes"]["micro_batch"] == [2, 8]
    assert grid["axes"]["attention"] == ["sdpa", "eager"]  # choices keep the order given
    assert parse_counts("2k,1k", "--ctx", binary=True) == (1024, 2048)


@pytest.mark.parametrize("args, fragment", [
    (("--ctx", "1k,3q"), "--ctx: '3q' is not a count"),
    (("--ctx", "1k,,2k"), "--ctx: empty item in '1k,,2k'"),
    (("--ctx", ","), "--ctx: give a comma-separated list"),
    (("--ctx", "1k", "--batch", "1,0"), "--batch: '0' must be at least 1"),
    (("--ctx", "1k", "--batch", "2,1.5"), "--batch: '1.5' is not a whole number"),
    (("--ctx", "1k", "--attention", "sdpa,flash"), "--attention: unknown 'flash'"),
    (("--ctx", "1k", "--checkpointing", "none,partial"), "--checkpointing: unknown 'partial'"),
    (("--ctx", "1k", "--precision", "bf16-mixed,fp8"), "--precision: unknown 'fp8'"),
    (("--ctx", "1k", "--tokens", "lots"), "--tokens: 'lots' is not a count"),
    (("--ctx", "1k", "--device", "rtx-9090"), "rtx-9090"),
    (("--batch", "1"), "--ctx"),
])
def test_bad_input_is_one_line_and_exit_2(args, fragment):
    result = run("--params", "22m", *(a for a in args))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert result.stdout == ""


def test_bad_list_item_names_the_accepted_values():
    msg = run("--params", "22m", "--ctx", "1k", "--attention", "flash").stderr
    assert "accepted: eager, sdpa" in msg
    msg = run("--params", "22m", "--ctx", "2k,8x").stderr
    assert "'8x'" in msg and "8192 or 8k" in msg and "comma-separated list such as 1k,2k,4k" in msg


def test_a_huge_grid_is_refused():
    with pytest.raises(InputError, match=f"at most {MAX_CELLS}"):
        SweepAxes(ctx=tuple(range(1, 65)), micro_batch=tuple(range(1, 65)), attention=("sdpa",),
                  checkpointing=("none", "full"), precision=("bf16-mixed",))


def test_bad_input_from_a_real_process_has_no_traceback():
    env_path = str(ROOT)
    result = subprocess.run([sys.executable, "-m", "memplan", "sweep", "--params", "22m", "--ctx", "1k,abc"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120,
                            env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert result.stderr.startswith("memplan: error: --ctx: 'abc' is not a count")


# ---- the HTML page -------------------------------------------------------------------------

def _page(tmp_path: Path, *extra: str) -> str:
    out = tmp_path / "sweep.html"
    result = run("--params", "124m", "--device", "rtx-4090", "--ctx", "1k,2k", "--batch", "1,4",
                 "--checkpointing", "none,full", "--html", str(out), *extra)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.stdout
    return out.read_text(encoding="utf-8")


def test_html_is_self_contained(tmp_path):
    from plotly.offline import get_plotlyjs

    page = _page(tmp_path)
    assert get_plotlyjs()[:2000] in page  # plotly.js itself is inlined
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.I)
    assert not re.search(r"<link[^>]*href\s*=\s*[\"']https?:", page, re.I)
    assert not re.search(r"<img[^>]*src\s*=\s*[\"']https?:", page, re.I)


def test_html_is_titled_with_model_device_and_date(tmp_path):
    import datetime

    page = _page(tmp_path)
    today = datetime.date.today().isoformat()
    title = re.search(r"<title>(.*?)</title>", page).group(1)
    assert "124m" in title and "rtx-4090" in title and today in title
    h1 = re.search(r"<h1>(.*?)</h1>", page).group(1)
    assert "124m" in h1 and "rtx-4090" in h1
    assert "GiB" in page and "tokens/s" in page


def test_epoch_figure_only_with_tokens(tmp_path):
    without = _page(tmp_path)
    assert without.count('<div class="plot">') == 3
    assert "Time for one epoch" not in without
    with_tokens = _page(tmp_path, "--tokens", "2b")
    assert with_tokens.count('<div class="plot">') == 4
    assert "Time for one epoch of 2.00B tokens" in with_tokens


def test_figures_draw_every_cell_with_the_usable_line():
    from memplan.reports.sweep import breakdown_figure, memory_figure, speed_figure

    spec, dev = resolve(params="124m"), load_profile("gtx-1650")
    sw = sweep(spec, TrainSetup(), dev, small_grid())
    usable_gib = dev.usable_bytes / 2**30
    mem = memory_figure(sw)
    drawn = sorted((t.x[i], t.y[i]) for t in mem.data if t.mode == "lines+markers" for i in range(len(t.x)))
    assert len(drawn) == len(sw.cells)
    assert any(s.type == "line" and s.y0 == pytest.approx(usable_gib) for s in mem.layout.shapes)
    assert any(s.type == "rect" and s.y0 == pytest.approx(usable_gib) for s in mem.layout.shapes)
    bars = breakdown_figure(sw)
    terms = {t.name for t in bars.data if t.type == "bar"}
    assert terms == {"weights", "gradients", "optimizer", "activations", "logits", "temporaries", "runtime"}
    speed = speed_figure(sw)
    front = [t for t in speed.data if t.name == "Pareto front"]
    assert len(front) == 1 and len(front[0].x) == len(sw.pareto)


def test_json_and_html_together_keep_stdout_json(tmp_path):
    out = tmp_path / "s.html"
    result = run("--params", "22m", "--device", "cpu", "--ctx", "1k", "--html", str(out), "--json")
    assert result.exit_code == 0
    json.loads(result.stdout)
    assert out.exists() and f"wrote {out}" in result.stderr


def test_html_into_a_directory_is_refused_and_an_existing_page_is_replaced_whole(tmp_path):
    result = run("--params", "22m", "--ctx", "1k", "--html", str(tmp_path))
    assert result.exit_code == 2 and "is a directory" in result.stderr
    out = tmp_path / "s.html"
    out.write_text("old page")
    assert run("--params", "22m", "--device", "cpu", "--ctx", "1k", "--html", str(out)).exit_code == 0
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert not list(tmp_path.glob("*.tmp"))


def test_an_html_path_that_cannot_be_written_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = run("--params", "22m", "--device", "cpu", "--ctx", "1k", "--html", str(blocker / "sweep.html"))
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "--html: cannot write" in result.stderr
    assert blocker.read_text() == "not a directory"

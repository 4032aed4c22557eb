"""Every kind of HTML report, opened in a real headless Chromium: no console errors, every plot drawn,
nothing fetched from outside the file, and screenshots that are not blank.

Chromium is driven by Playwright (its Python package; the browser is the installed Chromium, not one
Playwright downloads). `.ci/run` installs Debian's ``chromium`` where it is missing, so CI never skips;
elsewhere these tests skip, saying so, when no Chromium is installed.

To add a report: write a builder ``(tmp_path) -> Path`` that makes the page from data made in the
test, and add one line to ``REPORTS``.

``MEMPLAN_SCREENSHOTS=docs python -m pytest tests/runs/test_browser.py`` also saves a whole-page screenshot
of each report marked ``docs=True`` as ``docs/NAME.png`` (the README's pictures).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

pytestmark = pytest.mark.browser

VIEWPORT = (1366, 768)  # a common laptop screen
CHROMIUM_FLAGS = ("--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                  "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
                  "--no-default-browser-check")
START_SECONDS = 60  # chromium's start on a loaded 2-core machine
RENDER_SECONDS = 60  # loading ~4.7 MB of inlined plotly.js and drawing every figure
DOCS_SCALE = 0.75  # the README's screenshots: the whole page, 1366 px wide scaled to 1025


# ---- report builders: one line each in REPORTS ---------------------------------------------

def sweep_report(tmp_path: Path) -> Path:
    """The full page: four variants, facets per micro-batch, context buttons, the epoch figure."""
    from typer.testing import CliRunner

    from memplan.cli import app

    out = tmp_path / "sweep.html"
    result = CliRunner().invoke(app, ["sweep", "--params", "124m", "--device", "rtx-4090", "--ctx", "1k,2k,4k,8k",
                                      "--batch", "1,4,16", "--checkpointing", "none,full",
                                      "--attention", "eager,sdpa", "--tokens", "2b", "--html", str(out)])
    assert result.exit_code == 0, result.output
    return out


def sweep_report_one_setup(tmp_path: Path) -> Path:
    """One variant (no facets, no slider) on a small device where most cells do not fit."""
    from typer.testing import CliRunner

    from memplan.cli import app

    out = tmp_path / "sweep-small.html"
    result = CliRunner().invoke(app, ["sweep", "--params", "350m", "--device", "gtx-1650", "--ctx", "2k",
                                      "--batch", "1,2,4", "--html", str(out)])
    assert result.exit_code == 0, result.output
    return out


def report_module_page(tmp_path: Path) -> Path:
    """A page made directly with memplan/reports/page.py, with the kinds of figure other reports draw."""
    import plotly.graph_objects as go

    from memplan.reports.page import Page, style_figure, write_page

    steps = list(range(0, 200, 10))
    loss = [10.0 * 0.98 ** s + 2.0 for s in steps]
    line = style_figure(go.Figure(go.Scatter(x=steps, y=loss, mode="lines+markers", name="loss")),
                        title="Loss against step")
    line.update_xaxes(title_text="step")
    line.update_yaxes(title_text="loss (nats/token)")
    bars = style_figure(go.Figure([go.Bar(x=["a", "b", "c"], y=[1.5, 2.5, 0.7], name="predicted"),
                                   go.Bar(x=["a", "b", "c"], y=[1.4, 2.7, 0.8], name="measured")]),
                        title="Predicted and measured memory")
    bars.update_yaxes(title_text="GiB")
    heat = style_figure(go.Figure(go.Heatmap(z=[[0.01, -0.02], [0.03, 0.00]], x=["1k", "2k"], y=["b1", "b2"],
                                             colorscale="RdBu", zmid=0)), title="Relative error")
    page = Page(title="Report module", model="llama 22.9M", device="cpu (24 GiB)",
                summary={"what": "the shared page of memplan/reports/page.py", "figures": "3"},
                figures=[line, bars, heat], notes=["A note under the figures."])
    return write_page(page, tmp_path / "report.html")


def validate_report(tmp_path: Path) -> Path:
    """`memplan validate`'s page, from rows made here: the real predictions of a small matrix, with
    "measured" figures set a few percent off them (no torch, no measuring)."""
    from memplan.reports.validate import validation_page
    from memplan.estimate import memory_on
    from memplan.hardware import load_profile
    from memplan.reports.page import write_page
    from memplan.validate import ValidationRow, load_matrix, summarize

    cpu = load_profile("cpu")
    rows = []
    for i, config in enumerate(load_matrix("default")[:8]):
        mem = memory_on(config.spec, config.setup, cpu)
        off = 1 + 0.01 * ((i % 5) - 2)  # -2 % .. +2 %
        terms = {"weights": mem.weights, "gradients": mem.gradients, "optimizer": mem.optimizer,
                 "forward_saved": mem.activations}
        rows.append(ValidationRow(name=config.name, spec=config.spec, setup=config.setup,
                                  predicted_allocated=mem.peak_allocated, measured_allocated=int(mem.peak_allocated / off),
                                  trace_allocated=int(mem.peak_allocated / off * 1.001), predicted_terms=terms,
                                  measured_terms={k: int(v / off) for k, v in terms.items()}))
    return write_page(validation_page("cpu", rows, summarize(rows)), tmp_path / "validate.html")


def validate_inference_report(tmp_path: Path) -> Path:
    """`memplan validate --mode inference`'s page, from rows made here: the real predictions of the
    inference matrix, "measured" peaks a few percent off them (no torch, no generating)."""
    from memplan.reports.validate import inference_page
    from memplan.inference import inference_memory
    from memplan.reports.page import write_page
    from memplan.validate import InferenceRow, load_inference_matrix

    rows = []
    for i, config in enumerate(load_inference_matrix("default")):
        mem = inference_memory(config.spec, config.setup)
        off = 1 + 0.01 * ((i % 5) - 2)
        rows.append(InferenceRow(name=config.name, spec=config.spec, setup=config.setup,
                                 predicted_prefill=mem.prefill_peak_allocated,
                                 measured_prefill=int(mem.prefill_peak_allocated / off),
                                 predicted_decode=mem.decode_peak_allocated,
                                 measured_decode=int(mem.decode_peak_allocated * off)))
    return write_page(inference_page("cpu", rows), tmp_path / "validate-inference.html")


def train_report(tmp_path: Path) -> Path:
    """`memplan train`'s run report: a tiny Llama trained 8 steps on a corpus made here (an OOM-free,
    resumed-free run: loss, eval per source, memory with its predicted line, throughput, lr)."""

    from memplan.hardware import load_profile
    from memplan.model import ModelSpec
    from memplan.plan import Plan
    from memplan.setup import TrainSetup
    from trainer import data
    from trainer.loop import TrainConfig, Trainer

    corpus = tmp_path / "notes.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Note {i}: the {w} sat by the window and counted {i * 7} "
                                                   f"birds before the {w} fell asleep."}) + "\n"
                              for i in range(200) for w in ("cat", "dog")[i % 2:i % 2 + 1]))
    prepared = data.prepare(data.resolve_inputs([str(corpus)]), tmp_path / "prepared",
                            data.PrepareConfig(tokenizer="bpe:300", workers=1, val_fraction=0.1)).out
    prepared = data.PreparedData(prepared)
    spec = ModelSpec(arch="llama", layers=2, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=prepared.vocab_size,
                     tied=True)
    plan = Plan(model=spec, setup=TrainSetup(ctx=32, micro_batch=4, precision="fp32"), device="cpu")
    run = tmp_path / "run"
    Trainer.start(run, plan, prepared, TrainConfig(max_steps=8, eval_every=4, sample_tokens=8),
                  load_profile("cpu")).run()
    return run / "report.html"


def step_time_report(tmp_path: Path) -> Path:
    """benchmarks/step_time.py's page (the calibrate report): a 2-second calibration of this machine,
    then the six configs of the 300k model (six table rows: the sixth was once hidden) measured for
    three steps each against their predictions."""
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    profile, out = tmp_path / "cal.toml", tmp_path / "step_time.html"
    r = subprocess.run([sys.executable, "-m", "memplan", "calibrate", "--seconds", "2", "--threads", "1",
                        "--out", str(profile)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "step_time.py"), "--device", str(profile),
                        "--threads", "1", "--only", "300k ", "--steps", "3", "--passes", "1",
                        "--warmup", "1", "--html", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return out


@dataclass(frozen=True)
class Report:
    name: str
    build: Callable[[Path], Path]  # writes the page under the test's tmp_path, returns its path
    docs: bool = False  # MEMPLAN_SCREENSHOTS=DIR saves its screenshot as DIR/NAME.png (the README's pictures)


REPORTS = [  # one line per kind of report
    Report("sweep", sweep_report, docs=True),
    Report("sweep-one-setup", sweep_report_one_setup),
    Report("validate", validate_report),  # made-up measurements: no README picture from it
    Report("validate-inference", validate_inference_report),
    Report("report-module", report_module_page),
    Report("train", train_report),
    Report("step-time", step_time_report),
]


# ---- the browser: Playwright driving the installed Chromium ---------------------------------

def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _opened(browser, path: Path, width: int):
    """A new page of ``width`` × VIEWPORT's height (device scale 1) with ``path`` loaded and every plotly plot
    laid out; its console errors, uncaught exceptions and requests are gathered from before the load on."""
    context = browser.new_context(viewport={"width": width, "height": VIEWPORT[1]}, device_scale_factor=1)
    page = context.new_page()
    seen = {"errors": [], "requests": []}
    page.on("console", lambda m: seen["errors"].append(m.text) if m.type in ("error", "assert") else None)
    page.on("pageerror", lambda e: seen["errors"].append(str(e)))
    page.on("request", lambda r: seen["requests"].append(r.url))
    page.goto(path.resolve().as_uri(), wait_until="load", timeout=RENDER_SECONDS * 1000)
    page.wait_for_function(SETTLED_JS, timeout=RENDER_SECONDS * 1000)
    page.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    return context, page, seen


def _whole_page_png(page, width: int, scale: float = 1.0) -> bytes:
    """The whole page, ``width`` px wide, at ``scale`` (Chromium's own screenshot through Playwright's CDP session:
    Playwright's screenshots take no scale other than the device's)."""
    height = page.evaluate("document.documentElement.scrollHeight")
    cdp = page.context.new_cdp_session(page)
    shot = cdp.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                               "clip": {"x": 0, "y": 0, "width": width, "height": height,
                                                        "scale": scale}})
    return base64.b64decode(shot["data"])


# ---- what a check of one page finds --------------------------------------------------------

PLOT_STATUS_JS = """
(() => {
  const meets = (a, b) => a.right > b.left && a.left < b.right && a.bottom > b.top && a.top < b.bottom;
  return Array.from(document.querySelectorAll('div.plot')).map((box, i) => {
    const gd = box.querySelector('.js-plotly-plot');
    const svg = gd ? gd.querySelector('svg.main-svg') : null;
    const r = box.getBoundingClientRect();
    // The plot areas (one per subplot), and the data marks drawn inside one: markers, bars, lines,
    // heatmap images, pie slices, table cells. A mark drawn wholly outside its axes' ranges does not count.
    const areas = gd ? Array.from(gd.querySelectorAll('.draglayer .nsewdrag')).map(e => e.getBoundingClientRect()) : [];
    const marks = gd ? Array.from(gd.querySelectorAll(
      'g.trace .point, g.trace path.js-line, g.trace path.js-fill, g.hm image, g.imagelayer image, ' +
      '.pielayer path.surface, g.table .column-cell')) : [];
    const inView = marks.filter(m => { const b = m.getBoundingClientRect();
      return (b.width > 0 || b.height > 0) && (areas.length === 0 || areas.some(a => meets(b, a))); });
    return {
      index: i, plotly: !!gd, svg: !!svg,
      traces: gd && gd._fullData ? gd._fullData.filter(t => t.visible === true).length : 0,
      marks: marks.length, marks_in_view: inView.length,
      x: r.left + window.scrollX, y: r.top + window.scrollY, width: r.width, height: r.height,
    };
  });
})()
"""

SETTLED_JS = """
(() => document.readyState === 'complete' &&
  Array.from(document.querySelectorAll('.js-plotly-plot')).every(gd => gd._fullLayout && !gd._transitioning))()
"""  # every plot that plotly has started is laid out (a page that never starts one settles at once)


LAYOUT_WIDTH = 1200  # a narrower window than VIEWPORT: where legends and labels start to fall off
LAYOUT_JS = """
(() => {
  const found = [];
  const box = e => e.getBoundingClientRect();
  const visible = b => b.width > 0 && b.height > 0;
  const outside = (b, c) => Math.max(c.left - b.left, b.right - c.right, c.top - b.top, b.bottom - c.bottom);
  const label = e => (e.textContent || '').trim().slice(0, 40);
  if (document.documentElement.scrollWidth > window.innerWidth + 1)
    found.push(`the page is ${document.documentElement.scrollWidth} px wide in a ${window.innerWidth} px window`);
  document.querySelectorAll('.js-plotly-plot').forEach((gd, i) => {
    const svg = gd.querySelector('svg.main-svg');
    if (!svg) return;
    const canvas = box(svg);
    if (canvas.right > window.innerWidth + 1)
      found.push(`plot ${i}: its canvas ends at ${Math.round(canvas.right)} px, past the ${window.innerWidth} px window`);
    // what must lie inside the canvas: the legend's box, annotations (subplot titles, line labels), the
    // title, axis titles, tick labels and text drawn beside data points
    const kinds = [['legend', 'g.legend rect.bg'], ['annotation', 'g.annotation'], ['title', 'text.gtitle'],
                   ['axis title', 'text[class$="title"]:not(.gtitle):not(.legendtitletext)'],
                   ['tick label', 'g.xtick text, g.ytick text'], ['point label', 'g.textpoint text']];
    for (const [kind, selector] of kinds) {
      gd.querySelectorAll(selector).forEach(e => {
        const b = box(e);
        if (!visible(b)) return;
        const off = outside(b, canvas);
        if (off > 1) found.push(`plot ${i}: ${kind} "${label(e)}" lies ${Math.round(off)} px outside its canvas`);
      });
    }
    // a label drawn inside a clipped layer (a trace with cliponaxis) shows only where it lies in a plot area
    const areas = Array.from(gd.querySelectorAll('.draglayer .nsewdrag')).map(box);
    gd.querySelectorAll('g.textpoint text').forEach(e => {
      const b = box(e);
      if (!visible(b) || !e.closest('[clip-path]') || !areas.length) return;
      const off = Math.min(...areas.map(a => outside(b, a)));
      if (off > 1) found.push(`plot ${i}: point label "${label(e)}" is cut ${Math.round(off)} px by its plot area`);
    });
    // a legend entry for every shown trace whose name has one (one context's traces at a time, say)
    const declared = new Set((gd.data || []).filter(t => t.name && t.showlegend !== false).map(t => t.name));
    const shown = new Set((gd._fullData || []).filter(t => t.visible === true && declared.has(t.name)).map(t => t.name));
    const entries = new Set(Array.from(gd.querySelectorAll('g.legend text.legendtext')).map(e => e.textContent));
    if (shown.size >= 2)
      shown.forEach(name => { if (!entries.has(name)) found.push(`plot ${i}: no legend entry for "${name}"`); });
    // every row of a table trace visible inside the table, none scrolled or clipped out of sight
    const tables = (gd._fullData || []).filter(t => t.type === 'table');
    gd.querySelectorAll('g.table').forEach((t, k) => {
      const trace = tables[k];
      if (!trace) return;
      const area = box(t.querySelector('.scroll-background') || t);
      const first = t.querySelector('.y-column');
      const rows = trace.cells.values.length ? trace.cells.values[0].length : 0;
      const header = trace.header.values.length ? 1 : 0;
      const seen = first ? Array.from(first.querySelectorAll('.column-cell'))
        .filter(c => { const b = box(c); return visible(b) && outside(b, area) <= 1 && outside(b, canvas) <= 1; }).length : 0;
      if (seen < rows + header)
        found.push(`plot ${i}: table shows ${Math.max(0, seen - header)} of its ${rows} rows`);
    });
  });
  return found;
})()
"""


def layout_problems(browser, path: Path, shot: Path | None = None) -> list[str]:
    """Open ``path`` in a ``LAYOUT_WIDTH`` px window and list, in words, every legend, annotation, title,
    axis or point label drawn outside its plot's canvas, every table row out of sight, and a page
    wider than the window. With ``shot``, the whole page's screenshot at that width is saved there."""
    context, page, _ = _opened(browser, path, LAYOUT_WIDTH)
    try:
        found = page.evaluate(LAYOUT_JS)
        if shot is not None:
            shot.write_bytes(_whole_page_png(page, LAYOUT_WIDTH))
    finally:
        context.close()
    return found


@dataclass
class PageCheck:
    console_errors: list[str] = field(default_factory=list)
    outside_requests: list[str] = field(default_factory=list)  # URLs neither file: nor data: nor blob:
    plots: list[dict] = field(default_factory=list)
    plot_pixels: list[dict] = field(default_factory=list)  # per plot: distinct colours, share off the background
    viewport_pixels: dict = field(default_factory=dict)
    page_png: bytes = b""  # the whole page, when asked for


def pixel_stats(png: bytes) -> dict:
    """How far an image is from blank: distinct colours and the share of pixels off the commonest colour."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    colors = img.getcolors(maxcolors=1 << 24)
    total = img.width * img.height
    common = max(count for count, _ in colors)
    return {"width": img.width, "height": img.height, "colors": len(colors), "off_background": 1 - common / total}


def check_page(browser, path: Path, page_scale: float | None = None) -> PageCheck:
    """Open ``path`` at a laptop's viewport, wait for plotly, and gather what ``problems`` judges.
    With ``page_scale``, also a screenshot of the whole page at that scale."""
    context, page, seen = _opened(browser, path, VIEWPORT[0])
    try:
        check = PageCheck(plots=page.evaluate(PLOT_STATUS_JS))
        check.viewport_pixels = pixel_stats(page.screenshot(type="png"))
        for plot in check.plots:
            if plot["width"] > 0 and plot["height"] > 0:
                clip = {k: plot[k] for k in ("x", "y", "width", "height")}  # page coordinates
                check.plot_pixels.append(pixel_stats(page.screenshot(type="png", clip=clip, full_page=True)))
            else:
                check.plot_pixels.append({"width": 0, "height": 0, "colors": 0, "off_background": 0.0})
        if page_scale:
            check.page_png = _whole_page_png(page, VIEWPORT[0], page_scale)
    finally:
        context.close()
    check.console_errors = list(seen["errors"])
    check.outside_requests = [u for u in seen["requests"] if not u.startswith(("file:", "data:", "blob:", "about:"))]
    return check


def problems(check: PageCheck) -> list[str]:
    """What is wrong with a checked page, in words; empty when nothing is."""
    found = [f"console error: {e}" for e in check.console_errors]
    found += [f"fetched from outside the file: {u}" for u in check.outside_requests]
    if not check.plots:
        found.append("no div.plot on the page")
    for plot, px in zip(check.plots, check.plot_pixels):
        where = f"plot {plot['index']}"
        if not (plot["plotly"] and plot["svg"]):
            found.append(f"{where}: no rendered plotly plot (.js-plotly-plot with svg.main-svg)")
        elif plot["traces"] == 0 or plot["marks"] == 0:
            found.append(f"{where}: no trace drawn")
        elif plot["marks_in_view"] == 0:
            found.append(f"{where}: all {plot['marks']} data marks lie outside the axes' ranges")
        if plot["height"] < 200 or plot["width"] < 300:
            found.append(f"{where}: only {plot['width']:.0f}×{plot['height']:.0f} px")
        if px["colors"] < 8 or px["off_background"] < 0.01:
            found.append(f"{where}: screenshot is blank ({px['colors']} colours, "
                         f"{px['off_background']:.1%} off the background)")
    vp = check.viewport_pixels
    if vp and (vp["colors"] < 8 or vp["off_background"] < 0.01):
        found.append(f"the first screen is blank ({vp['colors']} colours)")
    return found


# ---- tests ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    executable = chromium_path()
    if executable is None:
        if os.environ.get("CI"):  # .ci/run installs it: a CI without it is broken, not excused
            pytest.fail("Chromium is missing on CI; .ci/run should have installed Debian's chromium")
        pytest.skip("Chromium is not installed (`apt-get install -y chromium`; .ci/run installs it)")
    pytest.importorskip("playwright", reason="playwright is not installed (pip install -e '.[test]')")
    from playwright.sync_api import sync_playwright

    driver = sync_playwright().start()
    try:
        b = driver.chromium.launch(executable_path=executable, args=list(CHROMIUM_FLAGS),
                                   timeout=START_SECONDS * 1000)
    except Exception:
        driver.stop()
        raise
    yield b
    b.close()
    driver.stop()


@pytest.mark.parametrize("report", REPORTS, ids=[r.name for r in REPORTS])
def test_report_renders_in_a_real_browser(report, browser, tmp_path):
    name = report.name
    path = report.build(tmp_path)
    html = path.read_text(encoding="utf-8")
    assert "<script src=" not in html.replace(" ", "").lower(), "the page loads a script from elsewhere"
    shots = os.environ.get("MEMPLAN_SCREENSHOTS")
    if shots:
        Path(shots).mkdir(parents=True, exist_ok=True)
    check = check_page(browser, path, page_scale=DOCS_SCALE if shots and report.docs else None)
    assert problems(check) == [], f"{name}: {problems(check)}"
    assert len(check.plots) == html.count('<div class="plot">')
    # at 1200 px: every legend, annotation and label inside its canvas, every table row in sight
    narrow = Path(shots) / f"{name}-{LAYOUT_WIDTH}.png" if shots else tmp_path / f"{name}-{LAYOUT_WIDTH}.png"
    assert layout_problems(browser, path, shot=narrow) == [], name
    assert pixel_stats(narrow.read_bytes())["width"] == LAYOUT_WIDTH
    if shots and report.docs:
        (Path(shots) / f"{name}.png").write_bytes(check.page_png)


def test_the_check_finds_what_is_wrong_with_a_broken_page(browser, tmp_path):
    """The checks above can fail: a page with a script error, an empty plot container, a plot with no
    data, a plot whose data lie outside its axes and a request to the outside gets each one reported."""
    from plotly.offline import get_plotlyjs

    page = tmp_path / "broken.html"
    page.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<script>{get_plotlyjs()}</script></head><body>"
        "<div class='plot' style='height:300px;width:600px'></div>"  # nothing drawn in it
        "<div class='plot' style='height:300px;width:600px'><div id='p' style='height:300px'></div></div>"
        "<div class='plot' style='height:300px;width:600px'><div id='q' style='height:300px'></div></div>"
        "<script>Plotly.newPlot('p', [], {xaxis: {visible: false}, yaxis: {visible: false}});"
        "Plotly.newPlot('q', [{x: [1, 2], y: [10, 11], mode: 'lines+markers'}], {yaxis: {range: [0, 4]}});"
        "console.error('deliberate failure'); fetch('http://192.0.2.1/x.js').catch(() => {});"
        "</script></body></html>", encoding="utf-8")
    found = problems(check_page(browser, page))
    assert any("deliberate failure" in p for p in found), found
    assert any(p.startswith("plot 0: no rendered plotly plot") for p in found), found
    assert any(p.startswith("plot 1: no trace drawn") for p in found), found
    assert any(p.startswith("plot 2: all 3 data marks lie outside") for p in found), found
    assert any("192.0.2.1" in p for p in found), found


def test_the_layout_check_finds_what_falls_off_a_canvas(browser, tmp_path):
    """The 1200 px checks can fail: a legend pushed off the canvas, an annotation past its edge, point
    labels cut by the plot area, traces whose legend entries are on hidden twins, and a table too short
    for its rows are each reported."""
    import plotly.graph_objects as go

    from memplan.reports.page import Page, style_figure, write_page

    legend = style_figure(go.Figure([go.Bar(x=[1, 2], y=[1, 2], name=f"a long series name {k}") for k in range(3)]),
                          title="legend off the canvas")
    legend.update_layout(legend=dict(xref="container", x=1.02))  # past the canvas's right edge
    legend.add_annotation(xref="paper", yref="paper", x=-0.3, y=0.5, text="far left", showarrow=False)
    labels = style_figure(go.Figure(go.Scatter(x=[0.01, 0.5], y=[1, 2], mode="markers+text", text=["cut", "fine"],
                                               textposition="top left")), title="labels")
    labels.update_xaxes(range=[0, 1])
    hidden = style_figure(go.Figure([go.Bar(x=[1], y=[1], name=n, showlegend=False) for n in ("u", "v")]
                                    + [go.Bar(x=[1], y=[1], name=n, visible=False) for n in ("u", "v")]),
                          title="entries only on hidden traces")
    table = style_figure(go.Figure(go.Table(header=dict(values=["a"]), cells=dict(values=[list(range(8))]))),
                         title="a short table", height=200)
    path = write_page(Page(title="broken", model="m", device="d", figures=[legend, labels, hidden, table]),
                      tmp_path / "broken-layout.html")
    found = layout_problems(browser, path)
    assert any(p.startswith("plot 0: legend") for p in found), found
    assert any(p.startswith('plot 0: annotation "far left"') for p in found), found
    assert any(p.startswith('plot 1: point label "cut"') for p in found), found
    assert not any('"fine"' in p for p in found), found
    assert any(p.startswith('plot 2: no legend entry for "u"') for p in found), found
    assert any(p.startswith("plot 3: table shows") and "of its 8 rows" in p for p in found), found

"""The `gpudiag investigate --html` report in a real browser: Debian's Chromium, headless, offline.

Each simulator scenario's run is turned into a report and opened from a file:// URL by
``chromium --headless`` with no network. The page must load without a JavaScript error
(the report shows such errors in its own ``#report-errors`` box, which the dumped DOM
carries), draw the causal chain, and give each finding a section whose charts are drawn
with their data; a screenshot of each is written for a person to look at.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from store_support import write_window

from gpudiag import investigate as I
from gpudiag import repro as R
from gpudiag.reference_engine import scenarios
from gpudiag.report_html import charts_for

T0 = 1_700_000_000.0
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Headless Chromium runs timers on a virtual clock: this much of it lets plotly finish drawing.
VIRTUAL_TIME_MS = 10_000
WINDOW = (1000, 2600)
# Scenario -> the finding kinds its report must draw (each has declared evidence charts).
SCENARIO_KINDS = {
    "kv-eviction-storm": ("memory_fragmentation", "kv_eviction_storm"),
    "cpu-starved": ("cpu_starved_gpu", "latency_regression"),
    "degenerate-grid": ("degenerate_kernel_launch", "latency_regression"),
    "tensor-leak": ("memory_leak", "oom_forecast"),
    "cotenant": ("gpu_cotenant", "kv_eviction_storm"),
    "queue-avalanche": ("queue_avalanche",),
    "lru-multiturn": ("prefix_cache_thrash",),
}


def _chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} not found: install Debian's chromium "
                    "(scripts/system-deps.d/40-chromium.sh; CI runs it)")
    # --no-sandbox: the tests run as root, where Chromium's sandbox refuses to start. No proxy and
    # no network service: the report must draw from the file alone.
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={tmp / 'chromium-profile'}", "--proxy-server=127.0.0.1:9",
                           "--enable-logging=stderr", "--v=0", f"--virtual-time-budget={VIRTUAL_TIME_MS}",
                           *args], capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def storm_report(tmp_path_factory):
    """The HTML report of the storm scenario's whole run, written by the CLI from a real store."""
    tmp = tmp_path_factory.mktemp("report")
    res = R.run(scenarios.get("kv-eviction-storm"), None, 0)
    write_window(res.window, str(tmp / "storm.db"), T0)
    html = tmp / "report.html"
    p = subprocess.run([sys.executable, "-m", "gpudiag", "investigate", "--store", str(tmp / "storm.db"),
                        "--from", str(T0), "--to", str(T0 + 7200), "--html", str(html)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stderr
    return html


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """``reports(name)``: the HTML report of a scenario's run (written in-process), made once per module."""
    tmp = tmp_path_factory.mktemp("reports")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            res = R.run(scenarios.get(name), None, 0)
            cache[name] = tmp / f"{name}.html"
            I.write_html(str(cache[name]), res.window, res.findings)
        return cache[name]

    return get


def _errors(dom: str) -> str:
    """The text of the report's error box ('' when hidden and empty)."""
    box = re.search(r'<pre id="report-errors"([^>]*)>(.*?)</pre>', dom, re.S)
    assert box is not None, "the report's error box is missing"
    return "" if "hidden" in box.group(1) and box.group(2) == "" else box.group(2) or "shown"


def _sections(dom: str) -> dict[str, list[str]]:
    """Each finding section's DOM, by kind."""
    out: dict[str, list[str]] = {}
    for m in re.finditer(r'<section class="finding" id="[^"]*" data-kind="([^"]*)">(.*?)</section>', dom, re.S):
        out.setdefault(m.group(1), []).append(m.group(2))
    return out


def _plots(section: str) -> list[str]:
    """The DOM of each plotly chart drawn in a section."""
    starts = [m.start() for m in re.finditer(r'class="plotly-graph-div js-plotly-plot"', section)]
    return [section[a:b] for a, b in zip(starts, starts[1:] + [len(section)])]


def _legend(chart: str) -> list[str]:
    return re.findall(r'class="legendtext"[^>]*>([^<]*)<', chart)


def _dump(tmp: Path, html: Path, *, clean: bool = True) -> str:
    """The DOM after the page ran; with ``clean``, the console must show no uncaught error."""
    p = _chromium(tmp, "--dump-dom", html.as_uri())
    assert p.returncode == 0, p.stderr[-2000:]
    assert not clean or "Uncaught" not in p.stderr, p.stderr[-2000:]
    return p.stdout


@pytest.mark.parametrize("scenario", list(SCENARIO_KINDS))
def test_each_finding_of_a_scenario_is_drawn_with_the_charts_of_its_own_evidence(scenario, reports, tmp_path):
    dom = _dump(tmp_path, reports(scenario))
    assert _errors(dom) == "", f"JavaScript errors: {_errors(dom)}"
    # The causal chain comes first, a box per finding.
    assert dom.index('id="chain"') < dom.index('<section class="finding"')
    sections = _sections(dom)
    assert dom.count('class="finding"') >= 2 * sum(len(s) for s in sections.values())  # box + section
    for kind in SCENARIO_KINDS[scenario]:
        assert kind in sections, f"no section for {kind}: {list(sections)}"
        section = sections[kind][0]
        plots = _plots(section)
        skipped = section.count('class="no-chart"')
        assert len(plots) + skipped == len(charts_for(kind)), (kind, len(plots), skipped)
        assert plots, f"{kind}: none of its charts was drawn"
        for chart in plots:
            traces = re.findall(r'class="(?:trace scatter|trace bars)', chart)
            assert traces and "main-svg" in chart, f"{kind}: a chart without traces"
            # The finding's span is a labelled band with its legend entry.
            assert any(x.startswith(f"span: {kind} (") for x in _legend(chart)), _legend(chart)
            assert "shapelayer" in chart and f"{kind} (" in chart


def test_a_cpu_starved_report_draws_the_hot_host_thread_beside_an_idle_gpu_on_a_ratio_axis(reports, tmp_path):
    dom = _dump(tmp_path, reports("cpu-starved"))
    first = _plots(_sections(dom)["cpu_starved_gpu"][0])[0]
    legend = _legend(first)
    assert any("hottest thread (engine-loop)" in x for x in legend) and any("utilization" in x for x in legend)
    ticks = re.findall(r'class="ytick"[^>]*>.*?data-unformatted="([^"]*)"', first, re.S)
    assert ticks[0] == "0%" and "100%" in ticks, ticks
    # The latency regression it caused shades its cause's span too, with a legend entry of its own.
    for chart in _plots(_sections(dom)["latency_regression"][0]):
        assert "span: cpu_starved_gpu (critical), cause" in _legend(chart), _legend(chart)


def test_a_latency_axis_starts_at_zero_and_draws_the_slo(reports, tmp_path):
    dom = _dump(tmp_path, reports("degenerate-grid"))
    for chart in _plots(_sections(dom)["latency_regression"][0]):
        ticks = re.findall(r'class="ytick"[^>]*>.*?data-unformatted="([^"]*)"', chart, re.S)
        assert ticks and float(ticks[0]) == 0.0, ticks
        assert "SLO P99" in chart and "baseline P99" in chart


def test_the_store_report_written_by_the_cli_draws_the_storm_and_its_cause(storm_report, tmp_path):
    dom = _dump(tmp_path, storm_report)
    assert _errors(dom) == ""
    sections = _sections(dom)
    blocks = _legend(_plots(sections["memory_fragmentation"][0])[0])
    assert any("largest free block" in x for x in blocks) and "failed KV request size" in blocks, blocks
    evictions = _plots(sections["kv_eviction_storm"][0])[0]
    assert any(x.startswith("KV evictions per") for x in _legend(evictions))
    assert len(re.findall(r'class="point"', evictions)) > 10


def test_a_chart_without_data_is_left_out_with_the_series_it_missed(reports, tmp_path):
    # A declared chart whose series the window lacks names them instead of drawing an empty axis.
    html = reports("cotenant").read_text(encoding="utf-8")
    assert "range\":[-1,1]" not in html.replace(" ", "")
    for m in re.finditer(r"<p class='no-chart'>([^<]*)</p>", html):
        assert "not drawn, no data in this window for" in m.group(1)


def test_a_script_error_in_the_report_is_shown_in_its_error_box(reports, tmp_path):
    # The checks above can fail: the same report with a failing script shows the error.
    html = reports("cpu-starved").read_text(encoding="utf-8")
    broken = tmp_path / "broken.html"
    broken.write_text(html.replace("</body>", "<script>throw new Error('chart data missing');</script></body>"),
                      encoding="utf-8")
    dom = _dump(tmp_path, broken, clean=False)
    shown = _errors(dom)
    assert "A chart could not be drawn" in shown and "chart data missing" in shown


def _png(path: Path) -> tuple[int, int, bytes]:
    """(width, height, decompressed image data) of a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, width, height, idat = 8, 0, 0, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    return width, height, zlib.decompress(b"".join(idat))


@pytest.mark.parametrize("scenario", list(SCENARIO_KINDS))
def test_a_screenshot_of_each_scenario_report_shows_its_charts(scenario, reports, tmp_path_factory):
    shot = tmp_path_factory.mktemp("screenshots") / f"report-{scenario}.png"
    p = _chromium(shot.parent, "--hide-scrollbars", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                  f"--screenshot={shot}", reports(scenario).as_uri())
    assert p.returncode == 0 and shot.exists(), p.stderr[-2000:]
    width, height, pixels = _png(shot)
    assert (width, height) == WINDOW
    # A blank or single-colour page compresses to a few kilobytes; charts with text and fills do not.
    assert shot.stat().st_size > 100_000, shot.stat().st_size
    assert len(set(pixels[i:i + 4] for i in range(0, len(pixels), 4096))) > 50


def test_an_xid_that_first_appears_in_the_window_is_drawn_as_one_event():
    import pandas as pd

    from gpudiag.report_html import labelled_counter_increases

    gpu = pd.DataFrame({"t": [0.0, 10.0, 20.0, 30.0, 40.0],
                        "xid": [{}, {}, {"79": 1.0}, {}, {"79": 1.0}]})  # the label missing at 30 s: a gap
    (series,) = labelled_counter_increases(gpu, "xid", 10.0).values()
    assert series.sum() == 1.0 and series[20.0] == 1.0

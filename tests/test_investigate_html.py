"""The `gpudiag investigate --html` report in a real browser: Debian's Chromium, headless, offline.

The report of the kv-eviction-storm scenario's two hours (written into a real
store as the agent writes it in --sim mode) is opened from a file:// URL by
``chromium --headless`` with no network. The page must load without a
JavaScript error (the report shows such errors in its own ``#report-errors``
box, which the dumped DOM carries), draw the four charts with their data,
and give a screenshot worth looking at.
"""

from __future__ import annotations

import math
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from gpudiag import repro as R
from gpudiag.agent.store import Store
from gpudiag.frames import Frame
from gpudiag.investigate import CHART_TITLES
from gpudiag.reference_engine import scenarios

T0 = 1_700_000_000.0
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Headless Chromium runs timers on a virtual clock: this much of it lets plotly finish drawing.
VIRTUAL_TIME_MS = 10_000
WINDOW = (1400, 2200)


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
def report(tmp_path_factory):
    """The HTML report of the storm scenario's whole run, written by the CLI from a real store."""
    tmp = tmp_path_factory.mktemp("report")
    res = R.run(scenarios.get("kv-eviction-storm"), None, 0)
    store = Store.open(str(tmp / "storm.db"))
    for kind, df in res.window.tables.items():
        by_t: dict[float, list[dict]] = {}
        for row in df.to_dict("records"):
            t = row.pop("t")
            by_t.setdefault(t, []).append({k: v for k, v in row.items()
                                           if not (isinstance(v, float) and math.isnan(v))})
        store.append(Frame(kind, T0 + t, rows) for t, rows in by_t.items())
        store.flush()
    store.close()
    html = tmp / "report.html"
    p = subprocess.run([sys.executable, "-m", "gpudiag", "investigate", "--store", str(tmp / "storm.db"),
                        "--from", str(T0), "--to", str(T0 + 7200), "--html", str(html)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stderr
    return html


def _charts(dom: str) -> dict[int, str]:
    """The DOM of each chart div (chart-0 ... chart-3)."""
    starts = [dom.index(f'id="chart-{i}"') for i in range(len(CHART_TITLES))] + [len(dom)]
    return {i: dom[starts[i]:starts[i + 1]] for i in range(len(CHART_TITLES))}


def _legend(chart: str) -> list[str]:
    return re.findall(r'class="legendtext"[^>]*>([^<]*)<', chart)


def test_the_report_loads_offline_without_javascript_errors_and_draws_the_four_charts(report, tmp_path):
    p = _chromium(tmp_path, "--dump-dom", report.as_uri())
    assert p.returncode == 0, p.stderr[-2000:]
    dom = p.stdout
    errors = re.search(r'<pre id="report-errors"([^>]*)>(.*?)</pre>', dom, re.S)
    assert errors is not None, "the report's error box is missing"
    assert "hidden" in errors.group(1) and errors.group(2) == "", f"JavaScript errors: {errors.group(2)}"
    assert "Uncaught" not in p.stderr, p.stderr[-2000:]
    charts = _charts(dom)
    for i, title in enumerate(CHART_TITLES):
        assert "js-plotly-plot" in charts[i] and "main-svg" in charts[i], f"chart {i} ({title}) was not drawn"
        assert re.search(rf'class="gtitle"[^>]*>{re.escape(title)}<', charts[i]), title
    # Three-colour memory: white, grey and black stacked (filled) per process over time.
    memory = _legend(charts[0])
    assert sum("white: allocated" in x for x in memory) == 1 and any("grey:" in x for x in memory) \
        and any("black:" in x for x in memory), memory
    assert len(re.findall(r'class="js-fill"', charts[0])) >= 3
    # Utilization on the left axis, TPOT P99 on a second axis on the right.
    util = _legend(charts[1])
    assert any("utilization" in x for x in util) and any("TPOT P99" in x for x in util), util
    assert 'class="yaxislayer-above"' in charts[1] and "y2" in charts[1]
    # Evictions and allocation failures as bars on the timeline.
    assert _legend(charts[2]) == ["KV evictions per minute", "KV allocation failures per minute"]
    assert len(re.findall(r'class="trace bars"', charts[2])) == 2
    assert len(re.findall(r'class="point"', charts[2])) > 10
    # The largest free block as a line, the failed requests as markers above it.
    blocks = _legend(charts[3])
    assert any("largest free block" in x for x in blocks) and "failed KV request size" in blocks, blocks
    assert len(re.findall(r'class="point"', charts[3])) > 10
    # The storm is shaded on every chart.
    assert all("shapelayer" in c and re.search(r'fill: rgb\(2[24]0, ', c) for c in charts.values())


def test_a_script_error_in_the_report_is_shown_in_its_error_box(report, tmp_path):
    # The check above can fail: the same report with a failing script shows the error.
    broken = tmp_path / "broken.html"
    broken.write_text(report.read_text(encoding="utf-8").replace(
        "</body>", "<script>throw new Error('chart data missing');</script></body>"), encoding="utf-8")
    p = _chromium(tmp_path, "--dump-dom", broken.as_uri())
    errors = re.search(r'<pre id="report-errors"([^>]*)>(.*?)</pre>', p.stdout, re.S)
    assert errors is not None and "hidden" not in errors.group(1)
    assert "A chart could not be drawn" in errors.group(2) and "chart data missing" in errors.group(2)


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


def test_a_screenshot_of_the_report_shows_the_charts(report, tmp_path):
    shot = tmp_path / "report.png"
    p = _chromium(tmp_path, "--hide-scrollbars", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                  f"--screenshot={shot}", report.as_uri())
    assert p.returncode == 0 and shot.exists(), p.stderr[-2000:]
    width, height, pixels = _png(shot)
    assert (width, height) == WINDOW
    # A blank or single-colour page compresses to a few kilobytes; four charts of two
    # hours of data with text and fills do not.
    assert shot.stat().st_size > 100_000, shot.stat().st_size
    assert len(set(pixels[i:i + 4] for i in range(0, len(pixels), 4096))) > 50

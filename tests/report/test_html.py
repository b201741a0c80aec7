"""render_html: the compare report as one self-contained page, opened in headless Chromium.

The browser tests need Debian's chromium and chromium-driver (.ci/run installs
them) and selenium (the test extra); without them they fail, never skip.
"""

import json
import math
import re
import shutil

import numpy as np
import pytest

import odmlq
from odmlq.report._html import render_html
from samples.digits import batches, load_digits_splits, train

INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1200,1600")
_BROWSERS = ("chromium", "chromium-browser", "google-chrome")


# --- data -------------------------------------------------------------------

@pytest.fixture(scope="module")
def cnn_report() -> dict:
    """compare() on the trained digits CNN, int8, as its JSON data."""
    digits = load_digits_splits()
    model, variables = train("cnn", digits, seconds=5, max_steps=60)  # a report needs no accuracy
    plan = odmlq.plan(model, INT8, digits.x_test[:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, batches(digits.x_calibration, 32), variables=variables)
    scales = odmlq.compute_scales(plan, calibration, variables)
    report = odmlq.compare(model, plan, scales, digits.x_test[:64], variables=variables)
    return json.loads(report.to_json())


def _metrics(sqnr_db, *, nan=0, hist=None, lsb=1.0, clipped=0.0) -> dict:
    m = {"sqnr_db": sqnr_db, "cosine": 0.9999, "max_abs": 0.05, "mean_abs": 0.01, "lsb": lsb,
         "clipped": clipped, "nan": nan}
    if hist is not None:
        m["hist"] = hist
    return m


def _hist(width: float, unit: str = "LSB") -> dict:
    """41 bins over [-8, 8]: a rounding peak `width` bins wide and a far tail."""
    counts = [0] * 41
    for i in range(41):
        d = abs(i - 20)
        counts[i] = int(4000 * math.exp(-d * d / (2 * width * width))) if d < 4 * width else 0
    counts[39] = 3
    return {"lo": -8.0, "hi": 8.0, "unit": unit, "counts": counts}


def version2_report() -> dict:
    """A hand-built version-2 report: every key the renderer draws.

    Edges listed worst first; `index` gives the execution order. One run has
    no error (null = inf), one edge has NaNs, one advice entry is unmeasured.
    """
    order = ["input_0", "conv1/conv", "conv1/relu", "conv1/avg_pool", "conv2/conv", "conv2/relu",
             "conv2/reshape", "dense1/dot_general", "dense1/relu", "head/dot_general"]
    local = {"conv2/relu": 9.8, "input_0": None, "dense1/relu": 36.0}
    simulate = {"conv2/relu": 9.6, "input_0": 56.5}
    edges = []
    for index, name in enumerate(order):
        module = name.split("/")[0] if "/" in name else ""
        loc = local.get(name, 40.0 + index)
        sim = simulate.get(name, 9.5 if index > 5 else 38.0 + index)
        runs = {"local": _metrics(loc, hist=_hist(1.0)),
                "simulate": _metrics(sim, hist=_hist(3.0 if index >= 5 else 1.0),
                                     clipped=0.12 if name == "conv2/relu" else 0.0),
                "litert": _metrics(sim, hist=_hist(3.0 if index >= 5 else 1.0),
                                   nan=5 if name == "head/dot_general" else 0)}
        edges.append({"edge": name, "op": name, "module_path": module, "spec": "int8 per-tensor asym minmax",
                      "index": index, "who": "local" if name == "conv2/relu" else "inherited", "runs": runs})
    edges.sort(key=lambda e: (math.inf if e["runs"]["local"]["sqnr_db"] is None
                              else e["runs"]["local"]["sqnr_db"]))
    rng = np.random.default_rng(0)
    weights = []
    for param, channels in [("conv1/kernel", 16), ("conv2/kernel", 32), ("dense1/kernel", 64),
                            ("head/kernel", 10)]:
        spread = rng.uniform(0.2, 0.6, channels)
        outliers = [3, 17] if param == "conv2/kernel" else []
        spread[outliers] *= 6
        weights.append({"param": param, "module_path": param.split("/")[0],
                        "spec": "int8 per-channel sym", "axis": -1,
                        "min": (-spread * rng.uniform(0.6, 1.0, channels)).tolist(),
                        "max": spread.tolist(), "outliers": outliers})
    advice = [
        {"edge": "conv2/relu", "module_path": "conv2", "change": "calibrate with Percentile(99.99)",
         "rule": {"module_path": "conv2", "act_calibration": "Percentile(99.99)"},
         "why": "12% of values clip: the range is too small",
         "measured": {"output_sqnr_db": 36.2, "gain_db": 26.6, "size_bytes": 39038, "size_delta_bytes": 0}},
        {"edge": "dense1/relu", "module_path": "dense1", "change": "int16 activations",
         "rule": {"module_path": "dense1", "act_qtype": "int16"}, "why": "max error 25 LSB",
         "measured": {"output_sqnr_db": 38.9, "gain_db": 0.6, "size_bytes": 39038,
                      "size_delta_bytes": 128}},
        {"edge": "head/dot_general", "module_path": "head", "change": "keep float", "rule": {},
         "why": "NaN in the LiteRT run", "measured": None},
    ]
    return {"format": "odmlq.report", "version": 2, "runs": ["local", "simulate", "litert"],
            "edges": edges,
            "outputs": {"output_0": _metrics(9.7)},
            "unmapped_tensors": ["tfl.quantize"], "weights": weights, "advice": advice,
            "notes": ["litert: 5 NaN values in head/dot_general", "calibrated on 128 examples"]}


# --- the page without a browser -----------------------------------------------

def test_module_path_is_escaped_everywhere():
    data = version2_report()
    evil = '<script>alert("x")</script>&'
    data["edges"][0]["module_path"] = evil
    data["edges"][0]["edge"] = evil + "/relu"
    data["weights"][0]["param"] = evil
    data["advice"][0]["why"] = evil
    data["notes"].append(evil)
    page = render_html(data, title=evil)
    assert "<script" not in page and "alert(&quot;x&quot;)" in page
    assert page.count("&lt;script&gt;") >= 6  # title, heading, table, plot tooltips, weights, advice


def test_page_refers_to_nothing_outside_itself():
    page = render_html(version2_report())
    # The only URL is the SVG namespace, a name that is never fetched.
    assert set(re.findall(r"[a-z]+://[^\"' ]+", page)) == {"http://www.w3.org/2000/svg"}
    assert not re.search(r"<(script|link|img|iframe)|\b(src|href)=|@import|url\(", page)


def test_inf_is_drawn_at_the_top_and_written_inf():
    data = version2_report()
    page = render_html(data)
    row = re.search(r"<tr><td class=\"num\">\d+</td><td class=\"code name\">input_0<span>.*?</tr>", page).group(0)
    assert ">inf</td>" in row  # local SQNR null: no error
    plot = re.search(r'<svg class="plot" data-plot="sqnr".*?</svg>', page).group(0)
    assert ">inf</text>" in plot and "local inf dB" in plot  # the tick and the marker's tooltip


def test_version1_data_leaves_out_what_it_lacks():
    data = version2_report()
    for key in ("runs", "weights", "advice", "notes", "unmapped_tensors"):
        del data[key]
    for e in data["edges"]:
        del e["index"], e["who"]
        for m in e["runs"].values():
            del m["hist"]
    page = render_html(data)
    assert 'id="edges"' in page and 'data-plot="sqnr"' in page
    for absent in ('id="weights"', 'id="advice"', 'id="histograms"', 'id="notes"'):
        assert absent not in page
    assert "no execution index" in page and '<td class="who--">-</td>' in page


def test_empty_report_and_empty_sections():
    page = render_html({"format": "odmlq.report", "version": 2, "edges": [], "outputs": {},
                        "weights": [], "advice": [], "notes": []})
    assert "No edges in this report." in page and "No advice" in page and "No weight statistics" in page
    assert "<tbody></tbody>" in page


def test_minus_inf_is_drawn_at_the_bottom():
    data = version2_report()
    data["edges"][0]["runs"]["simulate"]["sqnr_db"] = -999.0  # how the JSON writes -inf
    page = render_html(data)
    assert ">-inf</td>" in page and ">−inf</text>" in page and "simulate -inf dB" in page


def test_many_channels_share_bars_and_keep_outliers():
    data = version2_report()
    channels = 1000
    data["weights"] = [{"param": "big/kernel", "module_path": "big", "spec": "int8", "axis": 1,
                        "min": [-1.0] * channels, "max": [1.0] * channels, "outliers": [777]}]
    data["weights"][0]["max"][777] = 9.0
    plot = re.search(r'<svg class="plot" data-plot="weights".*?</svg>', render_html(data)).group(0)
    assert plot.count('class="channel"') + plot.count('class="outlier"') == 250  # 4 channels a bar
    assert plot.count('class="outlier"') == 1 and "channels 776-779" in plot


def test_nan_values_do_not_break_the_page():
    data = version2_report()
    data["edges"][1]["runs"]["simulate"]["sqnr_db"] = float("nan")
    data["edges"][1]["runs"]["simulate"]["cosine"] = float("nan")
    data["edges"][2]["runs"]["litert"]["nan"] = None
    page = render_html(data)
    assert ">nan</td>" in page and 'points=""' not in page


# --- the page in Chromium --------------------------------------------------------

@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium through chromedriver; fails (never skips) when either is missing."""
    binary = next((shutil.which(b) for b in _BROWSERS if shutil.which(b)), None)
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        pytest.fail("The HTML report tests need Chromium and chromedriver on PATH (found browser="
                    f"{binary}, chromedriver={driver_path}); on Debian: apt-get install chromium "
                    "chromium-driver (.ci/run does this).", pytrace=False)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("The HTML report tests need selenium: pip install -e '.[test]'.", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = binary  # with both paths given, selenium-manager never runs (offline CI)
    for flag in CHROMIUM_FLAGS + (f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def _open(browser, page: str, path) -> list[dict]:
    """Loads the page from a file; returns the browser's SEVERE log entries."""
    path.write_text(page, encoding="utf-8")
    browser.get_log("browser")  # drop anything from an earlier page
    browser.get(path.as_uri())
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


_SIZES = """return Array.from(document.querySelectorAll('svg.plot')).map(s => {
  const r = s.getBoundingClientRect(); return [s.dataset.plot, r.width, r.height]; });"""
_ROWS = "return document.querySelectorAll(arguments[0]).length;"
_REMOTE = """return Array.from(document.querySelectorAll('[src],[href],link,script,img,iframe,object'))
  .map(e => e.outerHTML.slice(0, 80));"""


def test_real_report_renders_in_chromium(browser, cnn_report, tmp_path):
    data = cnn_report
    errors = _open(browser, render_html(data, title="digits CNN int8"), tmp_path / "report.html")
    assert errors == []
    assert browser.title == "digits CNN int8"
    assert browser.execute_script(_ROWS, "#edges tbody tr") == len(data["edges"])
    assert browser.execute_script(_ROWS, "#advice tbody tr") == len(data.get("advice") or [])
    # Whatever the report's version holds: histograms of the 6 worst edges, one plot per weight.
    with_hist = [e for e in data["edges"] if any(isinstance(m.get("hist"), dict) for m in e["runs"].values())]
    expected = (["sqnr"] + ["histogram"] * min(6, len(with_hist))
                + ["weights"] * min(12, len(data.get("weights") or [])))
    sizes = browser.execute_script(_SIZES)
    assert [name for name, _, _ in sizes] == expected
    assert all(w > 300 and h > 150 for _, w, h in sizes), sizes
    runs = {r for e in data["edges"] for r in e["runs"]}
    lines = browser.execute_script("return document.querySelectorAll('svg[data-plot=sqnr] polyline').length")
    assert lines >= len(runs)
    assert browser.execute_script(_REMOTE) == []


def test_version2_report_renders_in_chromium(browser, tmp_path):
    data = version2_report()
    errors = _open(browser, render_html(data), tmp_path / "report.html")
    assert errors == []
    assert browser.title == "odmlq report"
    assert browser.execute_script(_ROWS, "#edges tbody tr") == len(data["edges"])
    assert browser.execute_script(_ROWS, "#advice tbody tr") == len(data["advice"])
    assert browser.execute_script(_ROWS, "#notes li") == len(data["notes"])
    # Internal detail (tensors no plan edge names) is folded at the end, not among the notes.
    assert browser.execute_script(_ROWS, "#details details:not([open]) li") == 2
    sizes = browser.execute_script(_SIZES)
    names = [name for name, _, _ in sizes]
    assert names == ["sqnr"] + ["histogram"] * 6 + ["weights"] * len(data["weights"]), names
    assert all(w > 200 and h > 100 for _, w, h in sizes), sizes
    outliers = browser.execute_script("return document.querySelectorAll('svg[data-plot=weights] rect.outlier').length")
    assert outliers == sum(len(w["outliers"]) for w in data["weights"])
    assert browser.execute_script(_REMOTE) == []


def test_report_save_html_writes_the_rendered_page_atomically(tmp_path):
    data = version2_report()
    data["advice"] = []  # its hand-written rules are for the renderer only
    report = odmlq.report.Report.from_json(data)
    path = tmp_path / "report.html"
    path.write_text("the user's old page")
    assert report.save_html(path, title="mine") == str(path)
    assert path.read_text(encoding="utf-8") == render_html(report.to_dict(), title="mine")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary file left


# --- a 100-edge model at 1280 px -------------------------------------------------

@pytest.fixture(scope="module")
def bert_report() -> dict:
    """compare() on the zoo's BERT (100 edges) against its LiteRT export with one
    layer's MLP kept in float (float islands and a conversion), as JSON data."""
    from tests.zoo.models import hf_bert

    zoo = hf_bert()
    batches = zoo.make_batches(2, 2, 0)
    rules = [odmlq.Rule("inner/encoder/layer/1/intermediate.*", skip=True)] + INT8
    with pytest.warns(UserWarning, match="float ops in the exported model"):
        result = odmlq.export_tflite(zoo.model, rules, batches, variables=zoo.variables, verify=False,
                                     allow_float_ops=True, progress=False)
    report = odmlq.compare(zoo.model, result.plan, result.scales, *batches[0], variables=zoo.variables,
                           tflite=result.tflite, contributions=False)
    return json.loads(report.to_json())


_FITS = """return [document.documentElement.scrollWidth, window.innerWidth,
  Array.from(document.querySelectorAll('.scroll')).filter(e => e.offsetParent !== null)
    .map(e => [e.closest('section').id, e.scrollWidth, e.clientWidth])];"""
# Each x label of the SQNR plot: its anchor (the right end of its box), the
# height of one line of its text on screen, and its box; the plot's box.
_LABELS = """const svg = document.querySelector('svg[data-plot=sqnr]');
const scale = svg.getBoundingClientRect().width / svg.viewBox.baseVal.width;
const labels = Array.from(svg.querySelectorAll('text[transform]')).map(t => {
  const r = t.getBoundingClientRect();
  return [r.right, t.getBBox().height * scale, r.left, r.top, r.bottom]; });
const bands = Array.from(svg.querySelectorAll('text.band')).map(t => {
  const r = t.getBoundingClientRect(); return [r.left, r.right]; });
const box = svg.getBoundingClientRect();
return [labels, bands, [box.left, box.right]];"""


def test_a_100_edge_report_fits_1280_px_and_its_labels_do_not_overlap(browser, bert_report, tmp_path):
    data = bert_report
    assert len(data["edges"]) >= 100
    # The attention masks' sentinel is no error: no edge's own rounding is off by 1e38 LSB (it
    # was, at the two mask edges); every local error is a rounding of at most a few LSB.
    assert all((e["runs"]["local"]["lsb"] or 0) < 4 for e in data["edges"]), data["edges"][0]
    browser.set_window_size(1280, 1600)
    try:
        assert _open(browser, render_html(data, title="BERT int8"), tmp_path / "report.html") == []
        page, window, tables = browser.execute_script(_FITS)
        assert page <= window, (page, window)  # no horizontal scroll of the page
        assert tables and all(inner <= outer for _, inner, outer in tables), tables  # every table fits its card
        labels, bands, (left, right) = browser.execute_script(_LABELS)
    finally:
        browser.set_window_size(1200, 1600)
    # Slanted at 40 degrees, two labels clear each other when their anchors are a
    # line height apart across the slant; each stays inside the plot.
    labels.sort()
    assert 15 <= len(labels) < len(data["edges"])  # thinned, not dropped
    for (x0, height, *_), (x1, *_) in zip(labels, labels[1:]):
        assert (x1 - x0) * math.sin(math.radians(40)) >= height - 0.5, (x0, x1, height)
    assert all(box_left >= left - 1 and anchor <= right + 1 for anchor, _, box_left, _, _ in labels)
    bands.sort()
    assert all(a[1] <= b[0] for a, b in zip(bands, bands[1:])), bands
    # The worst edge (first in the table) is among the labelled ones.
    worst = data["edges"][0]["edge"]
    texts = browser.execute_script(
        "return Array.from(document.querySelectorAll('svg[data-plot=sqnr] text[transform]')).map(t => t.textContent)")
    assert any(worst.endswith(t.lstrip("…")) for t in texts), (worst, texts)


def test_a_100_edge_report_folds_all_but_the_worst_25_and_lists_float_islands(browser, bert_report, tmp_path):
    data = bert_report
    assert _open(browser, render_html(data), tmp_path / "report.html") == []
    assert browser.execute_script(_ROWS, "#edges > div.scroll tbody tr") == 25
    assert browser.execute_script(_ROWS, "#more-edges:not([open]) tbody tr") == len(data["edges"]) - 25
    islands = [f for f in data["float_ops"] if f["kind"] == "island"]
    conversions = [f for f in data["float_ops"] if f["kind"] == "conversion"]
    # One MLP in float: its FULLY_CONNECTED and GELU compute in float, a DEQUANTIZE and a QUANTIZE around them.
    assert {f["op"] for f in islands} >= {"FULLY_CONNECTED", "GELU", "QUANTIZE", "DEQUANTIZE"}, islands
    assert conversions and all("intermediate" in f["module_path"] for f in conversions), conversions
    assert browser.execute_script(_ROWS, "#float-ops tbody tr") == len(data["float_ops"])
    heading = browser.execute_script("return document.querySelector('#float-ops h2').textContent")
    assert heading == f"Float islands ({sum(f['count'] for f in islands)}) and conversions ({len(conversions)})"
    assert "no plan edge" not in browser.execute_script("return document.querySelector('#summary').textContent")


def test_float_ops_read_back_and_print(bert_report):
    report = odmlq.report.Report.from_json(bert_report)
    assert report.to_dict()["float_ops"] == bert_report["float_ops"]
    text = str(report)
    assert "Float islands (" in text and "conversion  inner/encoder/layer/1/intermediate" in text, text

"""Regenerates docs/report.png: the HTML compare report of the digits CNN with a planted fault.

The CNN is trained for a fixed number of steps, quantized to int8 and
calibrated; then the activation edge conv2/relu gets a range 10x too small
(as tests/test_report.py plants it), so the report has something to find.
The page is rendered with headless Chromium through chromedriver (Debian:
apt-get install chromium chromium-driver; pip install selenium).

Usage:
  python docs/make_report_screenshot.py [--out docs/report.png] [--html report.html]
"""

from __future__ import annotations

import argparse
import base64
import json
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WIDTH, HEIGHT = 1200, 1600
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", f"--window-size={WIDTH},{HEIGHT}")


def planted_fault_report() -> dict:
    """compare() data of the int8 digits CNN whose conv2/relu range is 10x too small."""
    import numpy as np

    import odmlq
    from odmlq.calibration import FixedRange
    from samples.digits import batches, load_digits_splits, train

    digits = load_digits_splits()
    # A large time budget: the step count decides, so the weights repeat run to run.
    model, variables = train("cnn", digits, seconds=600, max_steps=300)
    plan = odmlq.plan(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")],
                      digits.x_test[:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, batches(digits.x_calibration, 32), variables=variables)
    lo, hi = calibration.range("conv2/relu", "int8", symmetric=False)
    faulty = odmlq.Calibration(dict(calibration))
    faulty.observe("conv2/relu_fault", FixedRange(float(lo) / 10, float(hi) / 10), np.zeros(1))
    entries = dict(calibration)
    entries["conv2/relu"] = faulty["conv2/relu_fault"]
    scales = odmlq.compute_scales(plan, odmlq.Calibration(entries), variables)
    report = odmlq.compare(model, plan, scales, digits.x_test[:64], variables=variables)
    return json.loads(report.to_json())


def screenshot(page: pathlib.Path, out: pathlib.Path) -> tuple[int, int]:
    """Saves a full-page PNG of `page`, WIDTH wide; returns its size."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("google-chrome")
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        sys.exit("Needs chromium and chromedriver on PATH: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    with tempfile.TemporaryDirectory() as profile:
        for flag in FLAGS + (f"--user-data-dir={profile}",):
            options.add_argument(flag)
        driver = webdriver.Chrome(options=options, service=Service(driver_path))
        try:
            driver.get(page.as_uri())
            width = driver.execute_script("return document.documentElement.clientWidth")
            height = driver.execute_script("return Math.ceil(document.querySelector('main')"
                                           ".getBoundingClientRect().bottom)")
            shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
                "format": "png", "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
        finally:
            driver.quit()
    out.write_bytes(base64.b64decode(shot["data"]))
    return width, height


def main() -> None:
    from odmlq.report._html import render_html

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "report.png")
    parser.add_argument("--html", type=pathlib.Path, help="also keep the HTML page here")
    args = parser.parse_args()
    page = render_html(planted_fault_report(), title="digits CNN, int8, conv2/relu range 10x too small")
    with tempfile.TemporaryDirectory() as directory:
        path = args.html or pathlib.Path(directory) / "report.html"
        path.write_text(page, encoding="utf-8")
        width, height = screenshot(path.resolve(), args.out)
    print(f"wrote {args.out} ({width}x{height})")


if __name__ == "__main__":
    main()

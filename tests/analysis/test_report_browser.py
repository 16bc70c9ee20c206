"""The report of a real run, opened in headless Chromium (Debian's chromium and chromedriver, installed by
`scripts/setup.sh browser`; driven through selenium's WebDriver): no console errors, every image loads, nothing
asks for anything outside the report's folder, nothing is wider than a 1280-pixel window, and a screenshot of the
whole page is saved beside the run (its path is printed).

The run is test_adaptive_gym's full run: the real NeMo Gym stack (ng_run, ng_collect_rollouts), `shardrun submit`
and `merge-and-profile`, against the stand-in policy whose per-task pass rates are never, always and sometimes.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from shardrun.rundir import store
from tests.e2e.test_adaptive_gym import full_run, shardrun

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(1500)]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WIDTH = 1280


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory: pytest.TempPathFactory, gym_venv: Path) -> Path:
    """merged/ of a real run, with `shardrun report` written into it."""
    tmp = tmp_path_factory.mktemp("browser")
    with full_run(tmp, gym_venv):
        pass
    shardrun("report", str(tmp / "full"), cwd=tmp)
    return store.merged_dir(tmp / "full")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("Chromium or chromedriver missing; run ./scripts/setup.sh browser")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={WIDTH},900",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()


def requested_urls(driver: Any) -> list[str]:
    """Every URL the page asked for (the DevTools network events chromedriver logs)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


OVERFLOW_JS = """
const limit = window.innerWidth;
const wide = [];
for (const el of document.querySelectorAll('body *')) {
  const r = el.getBoundingClientRect();
  if (r.right > limit + 0.5) wide.push(el.tagName + ' right=' + r.right);
  if (el.scrollWidth > el.clientWidth + 1 && getComputedStyle(el).overflowX !== 'visible')
    wide.push(el.tagName + '.' + el.className + ' scrolls: ' + el.scrollWidth + ' > ' + el.clientWidth + ' (' +
              (el.querySelector('th, td') || el).textContent.slice(0, 40) + ')');
}
return {inner: limit, page: document.documentElement.scrollWidth, wide: wide,
        height: document.documentElement.scrollHeight};
"""


def screenshot(driver: Any, height: int, path: Path) -> Path:
    """The whole page, WIDTH pixels wide, as a PNG at `path`."""
    clip = {"x": 0, "y": 0, "width": WIDTH, "height": height, "scale": 1}
    png = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
    )
    path.write_bytes(base64.b64decode(png["data"]))
    assert path.stat().st_size > 10_000
    return path


def test_the_report_of_a_real_run_in_chromium(report_dir: Path, browser: Any) -> None:
    page = report_dir / "report.html"
    browser.get(page.as_uri())
    layout = browser.execute_script(OVERFLOW_JS)
    shot = screenshot(browser, layout["height"], report_dir.parent.parent / "report-screenshot.png")
    print(f"screenshot of the report: {shot}")

    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == [], errors

    images = browser.execute_script(
        "return Array.from(document.images).map(i => [i.getAttribute('src'), i.complete, i.naturalWidth])"
    )
    drawn = sorted(p.name for p in report_dir.glob("report_*.png"))
    assert sorted(src for src, _, _ in images) == drawn and len(drawn) >= 4
    assert all(done and width > 0 for _, done, width in images), images

    urls = requested_urls(browser)
    assert urls and all(u.startswith(report_dir.as_uri() + "/") for u in urls), urls

    assert layout["inner"] == WIDTH
    assert layout["page"] <= WIDTH and layout["wide"] == [], layout

    # what a researcher reads first is on the page: the buckets, the intervals, the select commands
    text = browser.find_element("tag name", "body").text
    for expected in ("never solved", "sometimes solved", "always solved", "95% CI", "--drop-solved --drop-unsolved"):
        assert expected in text

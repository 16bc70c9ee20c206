"""Screenshot a report.html in headless Chromium, 1280 pixels wide (how docs/images/demo-report.png is made).

Usage: .venv/bin/python scripts/report_screenshot.py RUN_DIR/merged/report.html OUT.png [--max-height PX]
Needs Debian's chromium and chromedriver (scripts/setup.sh browser), as tests/analysis/test_report_browser.py does.
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path
from typing import Any

WIDTH = 1280


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--max-height", type=int, default=0, help="crop the page to this many pixels (0: the whole page)")
    args = p.parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={WIDTH},900",
    ):
        options.add_argument(arg)
    driver: Any = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    try:
        driver.set_page_load_timeout(120)
        driver.get(args.report.resolve().as_uri())
        height = int(driver.execute_script("return document.documentElement.scrollHeight"))
        if args.max_height:
            height = min(height, args.max_height)
        clip = {"x": 0, "y": 0, "width": WIDTH, "height": height, "scale": 1}
        png = driver.execute_cdp_cmd(
            "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
        )
    finally:
        driver.quit()
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_bytes(base64.b64decode(png["data"]))
    tmp.replace(args.out)
    print(f"{args.out}: {WIDTH} x {height} px")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A headless chromium for the browser tests, driven by selenium through Debian's chromedriver.

A missing browser fails the test, it never skips it: `.ci/run` installs `chromium` and
`chromium-driver` with apt-get, and `make test` installs selenium (the `dev` extra). No
browser or driver is ever downloaded at run time (selenium's own manager is bypassed by
naming both binaries).
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVER = "chromedriver"
INSTALL_HINT = "apt-get install -y --no-install-recommends chromium chromium-driver (.ci/run does it)"


def start_browser(width: int = 1280, height: int = 800):
    """A headless chromium whose viewport is `width` x `height` CSS pixels; the caller quits it."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is missing: install the dev extra (pip install -e '.[dev]'; make test does)")
    binary = next((path for path in map(shutil.which, BROWSERS) if path), None)
    driver_path = shutil.which(DRIVER)
    if binary is None or driver_path is None:
        pytest.fail(f"no chromium{' driver' if binary else ''} on PATH: {INSTALL_HINT}")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--hide-scrollbars"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    set_viewport(driver, width, height)
    return driver


def set_viewport(driver, width: int, height: int) -> None:
    """Make the page's viewport exactly `width` x `height` (the window size includes no chrome
    in headless mode, but this does not depend on it)."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )


def screenshot(driver, path: Path, *, full_page: bool = False) -> Path:
    """Save a PNG of the viewport, or of the whole page's height with `full_page`."""
    params: dict = {"format": "png"}
    if full_page:
        width, height = driver.execute_script("return [innerWidth, document.documentElement.scrollHeight]")
        params |= {
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
        }
    data = driver.execute_cdp_cmd("Page.captureScreenshot", params)["data"]
    path.write_bytes(base64.b64decode(data))
    return path

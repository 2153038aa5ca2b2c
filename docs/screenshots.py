"""Take the README's screenshots of the demo's report: 1280 and 390 pixels wide, the 1889 sentence focused.

Usage (from the repository root; needs Debian's ``chromium`` and ``chromium-driver`` and the ``test``
extra's selenium, as the report's browser tests)::

    HF_HUB_OFFLINE=1 .venv/bin/python docs/screenshots.py

It draws the report of the recorded demo run (``docs/demo/eiffel.json``, see
``docs/regenerate_examples.py``) with the current code, opens it in headless Chromium, focuses the
player whose text holds "1889" (its tooltip shows in the status line) and writes
``docs/eiffel-report-1280.png`` and ``docs/eiffel-report-390.png`` (a phone's width), each a window
scrolled to the conversation.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOTS = {1280: (1000, ROOT / "docs" / "eiffel-report-1280.png"), 390: (1000, ROOT / "docs" / "eiffel-report-390.png")}


def main() -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    from coalescence.report import load_source, render_report, write_report

    work = Path(tempfile.mkdtemp(prefix="coalescence-shots-"))
    try:
        page = work / "eiffel.html"
        os.chdir(ROOT)  # the page names its source as given: docs/demo/eiffel.json
        write_report(page, render_report(load_source("docs/demo/eiffel.json")))
        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={work / 'profile'}"):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            for width, (height, out) in SHOTS.items():
                driver.set_window_size(width, height)
                driver.get(page.as_uri())
                fact = next(m for m in driver.find_elements(By.CSS_SELECTOR, "mark.player") if "1889" in m.text)
                heading = next(h for h in driver.find_elements(By.CSS_SELECTOR, "h2, h3, h4") if h.text == "The conversation")
                driver.execute_script("arguments[0].scrollIntoView(true); arguments[1].focus({preventScroll: true})", heading, fact)
                driver.save_screenshot(str(out))
                print(f"wrote {out.relative_to(ROOT)}")
        finally:
            driver.quit()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

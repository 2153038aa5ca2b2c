"""The HTML report in a real browser: Debian's headless Chromium, driven by selenium.

The pages are made from real explanations of the tiny random Llama (``explain --html`` in-process),
opened from disk, and read back as the browser renders them: what it requested (Chrome's
performance log of DevTools Network events, and the page's resource timing), what it logged to the
console, the computed colours of the highlights, the visible text, the focus tooltip, and where the
index links lead. Without Chromium these tests skip, naming the install command.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.report_runs import SECOND, TRICKY, Run, explain, prompt_messages, run_cli

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
INSTALL = "apt-get install chromium chromium-driver"
BROWSER_UI = ("chrome://", "chrome-untrusted://", "devtools://")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1100,900",
)

pytestmark = [
    pytest.mark.skipif(
        not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
        reason=f"headless Chromium is not installed: {INSTALL} (as root; .ci/run does it)",
    ),
]
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install -c constraints.txt -e '.[test]'")
pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium with a fresh profile, logging the console and DevTools Network events."""
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="coalescence-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.get("about:blank")  # let a fresh profile's start page settle before any log is read
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Run:
    run = explain(tmp_path_factory.mktemp("b-single"), tiny_model_dir, TRICKY, "--unit", "sentence", "--method", "exact")
    assert run.code == 0, run.stderr
    return run


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Run:
    run = explain(tmp_path_factory.mktemp("b-batch"), tiny_model_dir, [TRICKY, SECOND], "--unit", "sentence", "--method", "loo")
    assert run.code == 0, run.stderr
    return run


def open_page(driver: Any, path: Path) -> dict[str, Any]:
    """Load ``path`` and return what loading it requested and logged."""
    driver.get_log("performance")  # drop earlier events
    driver.get_log("browser")
    url = path.resolve().as_uri()
    driver.get(url)
    requests = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            params = message["params"]
            if not params.get("documentURL", "").startswith(BROWSER_UI):  # the browser's own pages
                requests.append(params["request"]["url"])
    return {
        "url": url,
        "requests": requests,
        "console": driver.get_log("browser"),
        "resources": driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)"),
    }


def rgb(css: str) -> tuple[int, int, int]:
    r, g, b = (int(x) for x in re.findall(r"\d+", css)[:3])
    return r, g, b


def scale_position(color: tuple[int, int, int]) -> float:
    """Where a colour lies on matplotlib's RdBu (0 = dark red end, 0.5 = centre, 1 = dark blue end):
    the nearest of 255 samples of the colormap itself."""
    import matplotlib

    cmap = matplotlib.colormaps["RdBu"]
    samples = [(k / 254, tuple(round(255 * c) for c in cmap(k / 254)[:3])) for k in range(255)]
    return min(samples, key=lambda s: sum((a - b) ** 2 for a, b in zip(s[1], color, strict=True)))[0]


def test_no_network_request_and_no_console_error(browser: Any, single: Run, batch: Run) -> None:
    for run in (single, batch):
        seen = open_page(browser, run.html)
        assert seen["requests"] == [seen["url"]]  # the file itself, nothing else
        assert seen["resources"] == []  # no sub-resource of any kind
        assert [e for e in seen["console"] if e["level"] in ("SEVERE", "WARNING")] == []


def test_one_highlighted_element_per_player(browser: Any, single: Run) -> None:
    open_page(browser, single.html)
    marks = browser.find_elements("css selector", "#ex0 mark.player:not(.extra)")
    players = single.doc["players"]
    assert [int(m.get_attribute("data-index")) for m in marks] == list(range(len(players)))
    shown = [browser.execute_script("return arguments[0].innerText", m) for m in marks]
    assert shown == [p["text"] for p in players]


def test_highlight_colours_are_ordered_as_the_values(browser: Any, single: Run) -> None:
    open_page(browser, single.html)
    colours = browser.execute_script(
        "return [...document.querySelectorAll('#ex0 mark.player:not(.extra)')].map(m => getComputedStyle(m).backgroundColor)"
    )
    values = [p["value"] for p in single.doc["players"]]
    positions = [scale_position(rgb(c)) for c in colours]
    by_value = [positions[i] for i in sorted(range(len(values)), key=lambda i: values[i])]
    assert by_value == sorted(by_value)  # a larger value never sits lower on the scale
    for v, pos in zip(values, positions, strict=True):
        assert (pos < 0.5) if v < 0 else (pos > 0.5) if v > 0 else (pos == 0.5)
    top = max(range(len(values)), key=lambda i: abs(values[i]))
    assert positions[top] in (0.0, 1.0)  # the largest |value| takes an end of the scale


def test_visible_conversation_text_equals_the_messages(browser: Any, single: Run) -> None:
    open_page(browser, single.html)
    for k, message in enumerate(prompt_messages(TRICKY)):
        element = browser.find_element("css selector", f'#ex0 .content[data-message="{k}"]')
        # innerText: the text as rendered (pre-wrap keeps every space, tab and line break; the CR of
        # the CRLF, written &#13;, survives the HTML parser)
        assert browser.execute_script("return arguments[0].innerText", element) == message["content"]
        assert browser.execute_script("return arguments[0].textContent", element) == message["content"]


def test_keyboard_focus_shows_each_players_value(browser: Any, single: Run) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    open_page(browser, single.html)
    players = single.doc["players"]
    ranked = sorted(range(len(players)), key=lambda i: (-players[i]["value"], i))
    tip = "return getComputedStyle(arguments[0], '::after').content"
    first = browser.find_element("css selector", "#ex0 mark.player")
    assert browser.execute_script(tip, first) in ("none", "normal")  # hidden until focused
    ActionChains(browser).send_keys(Keys.TAB).perform()  # the first stop: "How to read this"
    assert browser.switch_to.active_element.tag_name == "summary"
    for p in players:  # then Tab walks the players in conversation order
        ActionChains(browser).send_keys(Keys.TAB).perform()
        active = browser.switch_to.active_element
        assert active.get_attribute("data-index") == str(p["index"])
        value = f"{p['value']:+.4f}" if p["value"] == 0 or abs(p["value"]) >= 1e-3 else f"{p['value']:+.3e}"
        text = " ".join(p["text"].split())
        text = text if len(text) <= 40 else text[:39] + "\u2026"
        expected = f"{p['label']} \u201c{text}\u201d: {value} nats \u00b7 rank {ranked.index(p['index']) + 1} of {len(players)}"
        assert browser.execute_script(tip, active) == json.dumps(expected, ensure_ascii=False)
        # a status line fixed to the window's bottom-left, never wider than the window
        assert browser.execute_script("return getComputedStyle(arguments[0], '::after').position", active) == "fixed"


def test_hover_shows_the_tooltip(browser: Any, single: Run) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    open_page(browser, single.html)
    mark = browser.find_elements("css selector", "#ex0 mark.player")[1]
    ActionChains(browser).move_to_element(mark).perform()
    shown = browser.execute_script("return getComputedStyle(arguments[0], '::after').content", mark)
    assert single.doc["players"][1]["label"] in shown


def test_index_links_resolve(browser: Any, batch: Run) -> None:
    open_page(browser, batch.html)
    links = browser.find_elements("css selector", "nav#index a")
    assert len(links) == len(batch.doc["explanations"])
    for k in range(len(links)):
        link = browser.find_elements("css selector", "nav#index a")[k]
        target = link.get_attribute("href").split("#", 1)[1]
        link.click()
        assert browser.execute_script("return location.hash") == f"#{target}"
        top, bottom, height = browser.execute_script(
            "const r = document.getElementById(arguments[0]).getBoundingClientRect(); return [r.top, r.bottom, innerHeight]", target
        )
        assert 0 <= top < height and bottom > 0  # scrolled into view
        labels = browser.execute_script(
            "return [...document.getElementById(arguments[0]).querySelectorAll('mark.player')].map(m => m.title.split(' \u201c')[0])", target
        )
        assert labels == [p["label"] for p in batch.doc["explanations"][k]["players"]]
        browser.execute_script("window.scrollTo(0, 0)")


@pytest.mark.parametrize("width", [390, 1280])
def test_the_page_fits_the_width_and_tooltips_stay_inside(browser: Any, permutation_run: Run, width: int) -> None:
    """At a phone's width (390 px) and a laptop's (1280 px): nothing runs past the right edge of the
    page (wide tables and the chart scroll inside their own box), the ranked table's text column stays
    readable, and a focused player's tooltip is a box inside the window."""
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": width, "height": 844, "deviceScaleFactor": 1, "mobile": width < 500})
    try:
        open_page(browser, permutation_run.html)
        assert browser.execute_script("return window.innerWidth") == width
        assert browser.execute_script("return document.documentElement.scrollWidth") <= width
        cell = browser.find_element("css selector", "#ex0 table.ranked td.snippet")
        assert cell.size["width"] >= 150  # about 12 rem on a phone: words, not letters, per line
        active = browser.find_element("css selector", "#ex0 mark.player")
        browser.execute_script("arguments[0].focus()", active)
        style = browser.execute_script(
            "const s = getComputedStyle(arguments[0], '::after'); return [s.position, s.left, s.bottom, s.maxWidth];", active
        )
        position, left, bottom, max_width = style
        assert position == "fixed" and float(left.rstrip("px")) >= 0 and float(bottom.rstrip("px")) >= 0
        assert float(left.rstrip("px")) + float(max_width.rstrip("px")) <= width
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


@pytest.fixture(scope="module")
def permutation_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Run:
    run = explain(tmp_path_factory.mktemp("b-perm"), tiny_model_dir, TRICKY, "--unit", "sentence", "--method", "permutation", "--budget", "40")
    assert run.code == 0, run.stderr
    return run


@pytest.mark.parametrize("width", [390, 1280])
def test_the_compare_page_fits_the_width(browser: Any, permutation_run: Run, tmp_path: Path, width: int) -> None:
    """``compare --html`` at a phone's width and a laptop's: nothing runs past the page's right edge
    (the table scrolls in its own box, the charts take one column), the text column keeps words on
    its lines, and the page requests nothing."""
    page = tmp_path / "compare.html"
    code, _, stderr = run_cli(["compare", str(permutation_run.run_dir), "--method", "permutation,loo", "--html", str(page)])
    assert code == 0, stderr
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": width, "height": 844, "deviceScaleFactor": 1, "mobile": width < 500})
    try:
        loaded = open_page(browser, page)
        assert loaded["requests"] == [loaded["url"]] and loaded["console"] == []
        assert browser.execute_script("return document.documentElement.scrollWidth") <= width
        widths = browser.execute_script("return [...document.querySelectorAll('table.compare td.snippet')].map(e => e.getBoundingClientRect().width)")
        assert widths and min(widths) >= 150
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})

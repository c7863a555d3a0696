"""The app in headless Chromium: a generation per method shows in the panels what the run
produced, and a screenshot of every panel lands in test-output/ for a person to look at.

Playwright cannot download a browser on our machines, so this drives Debian's /usr/bin/chromium
(`apt-get install -y chromium`) and skips, saying so, where there is none.
"""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

import pytest

import specflash
from app.methods import available_methods
from app.ui import build_demo
from specflash.errors import SpecFlashError
from specflash.models.presets import default_drafter
from specflash.trace import RunRecord

pytestmark = pytest.mark.slow
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")

PRESET = "tiny-qwen3"
PROMPT = "What is 12 * 7? The answer is 84. What is 12 * 7?"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
OUT = Path(__file__).resolve().parents[1] / "test-output"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def page(tiny_root):
    if not Path(CHROMIUM).exists():
        pytest.skip("no Chromium at /usr/bin/chromium: `apt-get install -y chromium` (never `playwright install`)")
    OUT.mkdir(exist_ok=True)
    demo = build_demo(default_model=PRESET, cache_dir=tiny_root)
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        page.locator("#prompt textarea").wait_for()
        yield page
        browser.close()
    demo.close()


@pytest.fixture(scope="module")
def target(tiny_root):
    return specflash.load(PRESET, device="cpu", cache_dir=tiny_root)


def tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()
    page.wait_for_timeout(400)


def choose(page, elem_id: str, value: str) -> None:
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=value, exact=True).click()
    assert page.locator(f"#{elem_id} input").input_value() == value


def wait_done(page, method: str) -> None:
    """Until the stats table names this method and its run has finished (no longer 'running');
    on a timeout the page is saved as test-output/timeout-METHOD.png."""
    try:
        _wait_stats(page, method)
    except sync_api.TimeoutError:
        shot(page, f"timeout-{method}")
        raise


def _wait_stats(page, method: str) -> None:
    """The stats say the run finished (they say so only once every panel is drawn)."""
    page.wait_for_function(
        """m => { const rows = (document.querySelector('#stats')?.innerText || '').split('\\n');
                  const cell = k => (rows.find(r => r.startsWith(k + '\\t')) || '').split('\\t')[1];
                  return cell('method') === m && cell('finish') && cell('finish') !== 'running'; }""",
        arg=method, timeout=60_000,
    )


def shot(page, name: str) -> None:
    page.screenshot(path=str(OUT / f"{name}.png"), full_page=True)


def runnable(target, tiny_root) -> dict[str, RunRecord]:
    out = {}
    for method in available_methods():
        try:
            out[method] = specflash.generate(target, PROMPT, method, max_new_tokens=24,
                                             drafter=default_drafter(PRESET, method, tiny_root), cache_dir=tiny_root)
        except SpecFlashError:
            continue
    return out


def test_every_method_in_the_browser(page, target, tiny_root):
    runs = runnable(target, tiny_root)
    tab(page, "Run")
    page.locator("#prompt textarea").fill(PROMPT)
    page.locator("#max-tokens input[type=number]").fill("24")
    page.locator("#max-tokens input[type=number]").press("Enter")
    for method, expected in runs.items():
        tab(page, "Run")
        choose(page, "method", method)
        page.locator("#run").click()
        wait_done(page, method)
        classes = page.locator("#output .tok").evaluate_all("els => els.map(e => e.classList[1])")
        want = [f"tok-{'accepted' if i < len(s.accepted) else s.correction_kind}"
                for s in expected.steps for i in range(len(s.committed))]
        assert classes == want, method
        assert page.locator("#output .tok").first.get_attribute("data-card").startswith("step 0")
        shot(page, f"run-{method}")
        if method == "draft":  # a token click opens the step inspector at that token's step
            token = page.locator("#output .tok[data-step]").nth(3)
            token.click()
            page.wait_for_timeout(600)
            assert page.locator("#step-slider input[type=number]").input_value() == token.get_attribute("data-step")
            assert page.get_by_role("tab", name="Step inspector").get_attribute("aria-selected") == "true"
        tab(page, "Step inspector")
        page.locator("#step-plot .js-plotly-plot").wait_for()
        assert "the target added" in page.locator("#step-table").inner_text()
        drafted = next((s for s in expected.steps if s.tokens), None)  # the step the inspector opens on
        rows = page.locator("#step-table tr[class^=node-]").count()
        assert rows == (len(drafted.tokens) if drafted else 0), method
        shot(page, f"steps-{method}")
        tab(page, "PTD tree")
        if method == "ptd":
            page.locator("#ptd-plot .js-plotly-plot").wait_for()
            assert page.locator("#ptd-plot").inner_text().count("draft tree") >= 2
            shot(page, "ptd-tree")
            page.locator("#ptd-bigger").click()  # the same prompt again, with the paper preset's trees
            tab(page, "Export / import")
            page.wait_for_function("""() => (document.querySelector('#export-json')?.textContent || '')
                                              .includes('"preset": "paper"')""", timeout=60_000)
        else:
            assert "no PTD tree" in page.locator("#ptd-note").inner_text()
    shot(page, "ptd-empty")


def with_head_extras(run: RunRecord) -> RunRecord:
    """A real run with DeLS and AdaFlash extras written into its drafted steps (those methods
    may not exist yet; their panels must still read the contract)."""
    for step in run.steps:
        n = len(step.tokens)
        if n:
            step.extras["dels"] = {"long": [1.0 + 0.1 * i for i in range(n)], "short": [0.5 - 0.3 * i for i in range(n)],
                                   "prior": [0.2] * n, "flipped": [i == 1 for i in range(n)]}
            step.extras["adaflash"] = {"score": 0.6, "verify_len": n, "cut_tokens": step.tokens[:2], "rule": "threshold"}
    return run


def test_imported_run_feeds_the_head_panels(page, target, tiny_root):
    run = with_head_extras(specflash.generate(target, PROMPT, "draft", max_new_tokens=24, drafter=PRESET, cache_dir=tiny_root))
    tab(page, "Export / import")
    page.locator("#import-text textarea").fill(run.to_json())
    page.locator("#import").click()
    tab(page, "Run")  # the stats table is read as rendered text, so its tab must show
    wait_done(page, "draft")
    tab(page, "Export / import")
    shot(page, "export-import")
    tab(page, "DeLS")
    page.locator("#dels-plot .js-plotly-plot").wait_for()
    assert "DeLS" in page.locator("#dels-plot").inner_text()
    shot(page, "dels")
    tab(page, "AdaFlash")
    page.locator("#ada-plot .js-plotly-plot").wait_for()
    page.locator("#ada-cut .draft-cut").first.wait_for()
    shot(page, "adaflash")
    tab(page, "Run")
    assert page.locator("#output .tok-accepted").count() > 0
    assert page.locator("#method input").input_value() == "draft"  # the controls took the run's settings
    shot(page, "run-imported")


def test_compare_panel(page):
    tab(page, "Compare")
    page.locator("#compare").click()
    page.wait_for_function(
        """() => { const t = document.querySelector('#compare-note')?.innerText || '';
                   return t.startsWith('Done:') && t.includes('measured on'); }""",
        timeout=120_000,
    )
    table = page.locator("#compare-table").inner_text()
    assert "ar" in table and "pld" in table
    page.locator("#accept-plot .js-plotly-plot").wait_for()
    page.locator("#cost-plot .js-plotly-plot").wait_for()
    assert page.locator("#compare-outputs .compare-output").count() >= 2
    shot(page, "compare")
    page.locator("#compare-table [role=gridcell]", has_text=re.compile(r"^\s*pld\s*$")).first.click()
    tab(page, "Run")
    wait_done(page, "pld")
    assert "Loaded from Compare: pld" in page.locator("#stats").inner_text()

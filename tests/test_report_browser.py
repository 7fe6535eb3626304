"""The HTML report in a real headless browser: it renders, every image loads, nothing logs an error.

Needs Debian's chromium (/usr/bin/chromium) and the python ``playwright`` package (the test extra).
Without them the test is skipped locally, but fails where the environment variable ``CI`` is set:
CI installs both and must run it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from test_analysis import _write_run

from ddlscope.analyze.report import report_runs
from ddlscope.store.db import ResultsStore

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def _need(condition: bool, why: str) -> None:
    if not condition:
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI must run the browser check of the HTML report")
        pytest.skip(why)


def _tiny_report(tmp_path: Path) -> Path:
    """A report over a baseline and a 2-peer collaborative run (rows written by hand, nothing trained)."""
    db = tmp_path / "r.db"
    with ResultsStore(db) as store:
        ids = [_write_run(store, "base", "single", [dict(start=0.0, runtime=10.0, steps=4, phases=(0.01, 0.3, 0.6, 0.09, 0.0),
                                                         evals=[(5.0, 0.6), (10.0, 0.9)])], config={"dataset": "digits"}),
               _write_run(store, "collab", "collaborative", [
                   dict(start=0.0, runtime=14.0, steps=4, phases=(0.01, 0.3, 0.6, 0.09, 0.3), evals=[(7.0, 0.5), (14.0, 0.8)],
                        net=3_000_000, background_cpu_s=0.2),
                   dict(start=0.5, runtime=15.0, steps=4, phases=(0.01, 0.3, 0.6, 0.09, 0.3), evals=[(8.0, 0.4), (15.0, 0.85)],
                        net=2_000_000, background_cpu_s=0.2)], peers=2, config={"dataset": "digits"})]
    with open(os.devnull, "w") as null:
        from rich.console import Console

        return report_runs(db, ids, tmp_path / "report", console=Console(file=null))


def test_html_report_renders_in_headless_chromium(tmp_path):
    _need(CHROMIUM.exists() or shutil.which("chromium") is not None, f"no chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need(False, "python package playwright is not installed (pip install -e '.[test]')")
    html_path = _tiny_report(tmp_path)
    images_in_page = html_path.read_text().count("<img ")
    assert images_in_page >= 4
    problems: list[str] = []
    shot = tmp_path / "report.png"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM if CHROMIUM.exists() else shutil.which("chromium")),
                                     args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} {r.failure}"))
            page.goto(html_path.as_uri(), wait_until="load")
            images = page.eval_on_selector_all(
                "img", "els => els.map(e => ({src: e.getAttribute('src'), complete: e.complete, width: e.naturalWidth}))")
            title = page.title()
            tables = page.locator("table").count()
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert problems == []
    assert len(images) == images_in_page
    assert [i["src"] for i in images if not (i["complete"] and i["width"] > 0)] == []
    assert title == "ddlscope report" and tables >= 3
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000  # a full page with plots, not a blank one

"""The dashboard tests' browser: Debian's Chromium (``.ci/system-packages`` installs it) through
Playwright, a page that records every console error and uncaught exception it shows."""

from __future__ import annotations

import shutil
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
"""Where Chromium is; None on a machine without it (the tests that need it are skipped)."""


def open_page(pw: Any, height: int = 1000) -> tuple[Any, list[str]]:
    """A new 1280-wide page of a headless Chromium, and the list its console errors and page errors
    are appended to (a test asserts it stays empty)."""
    browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": 1280, "height": height})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    return page, problems

"""Open a page in headless Chromium (Debian's ``chromium``): its DOM after load, what the page logged
to the console (script errors, blocked content) and a screenshot. For the HTML report's tests and
scripts/html_screenshots.py; nothing here runs when a report is written."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--enable-logging=stderr", "--v=0")
CONSOLE = re.compile(r":CONSOLE(?:\(\d+\))?[:\]]")


@dataclass
class PageLoad:
    dom: str  # the document after load, serialized (--dump-dom)
    console: list[str]  # console lines the page produced: a report page produces none
    screenshot: Path | None


def find_chromium() -> str | None:
    """The browser to drive: $TRACEDIFF_CHROMIUM, else the first of CANDIDATES on PATH."""
    given = os.environ.get("TRACEDIFF_CHROMIUM")
    if given:
        return given
    return next((found for name in CANDIDATES if (found := shutil.which(name))), None)


def load(page: Path, chromium: str, screenshot: Path | None = None, size: tuple[int, int] = (1400, 2400),
         dark: bool = False, timeout: float = 60) -> PageLoad:
    """Load ``page`` once in a fresh profile (nothing shared with another run): DOM, console, and
    optionally a PNG of the first ``size`` pixels. RuntimeError if the browser fails."""
    with tempfile.TemporaryDirectory(prefix="tracediff-chromium-") as profile:
        args = [chromium, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
                "--dump-dom"]
        if dark:
            args.append("--blink-settings=preferredColorScheme=0")  # 0: dark
        if screenshot is not None:
            args.append(f"--screenshot={screenshot}")
        args.append(page.resolve().as_uri())
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if done.returncode != 0 or "<html" not in done.stdout:
        tail = "\n".join(done.stderr.splitlines()[-5:])
        raise RuntimeError(f"{chromium} exited {done.returncode} loading {page}: {tail}")
    console = [line for line in done.stderr.splitlines() if CONSOLE.search(line)]
    if screenshot is not None and not screenshot.is_file():
        raise RuntimeError(f"{chromium} wrote no screenshot to {screenshot}")
    return PageLoad(done.stdout, console, screenshot)

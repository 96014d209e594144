"""Screenshots of the HTML report for people to look at: the sample's diverged (training vs serving
with the aux-layer bug) and matching (training vs serving) compares, light and dark, as PNG files
beside their pages.

    python scripts/html_screenshots.py [OUT_DIR]     # default: $TRACEDIFF_ARTIFACTS or artifacts/

Needs a Chromium (Debian: apt-get install chromium; or TRACEDIFF_CHROMIUM=/path/to/chrome).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/ and tracediff/ from this checkout

import tracediff as td  # noqa: E402
from testbed.browser import find_chromium, load  # noqa: E402
from tracediff.report.html import render_html  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "traces" / "eagle3"
PAIRS = {"diverged": "serving_aux_bug.h5", "match": "serving.h5"}


def main(argv: list[str]) -> int:
    chromium = find_chromium()
    if chromium is None:
        print("no chromium found: apt-get install chromium, or set TRACEDIFF_CHROMIUM", file=sys.stderr)
        return 2
    root = Path(argv[0]) if argv else Path(os.environ.get("TRACEDIFF_ARTIFACTS") or REPO / "artifacts")
    out = root / "html_report"
    out.mkdir(parents=True, exist_ok=True)
    for label, serving in PAIRS.items():
        page = out / f"{label}.html"
        page.write_text(render_html(td.compare(SAMPLES / "training.h5", SAMPLES / serving)), encoding="utf-8")
        for dark in (False, True):
            shot = out / f"{label}{'-dark' if dark else ''}.png"
            loaded = load(page, chromium, screenshot=shot, size=(1400, 3000), dark=dark)
            status = "clean" if not loaded.console else f"console: {loaded.console}"
            print(f"{shot} ({status})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

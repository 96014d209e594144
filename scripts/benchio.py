"""What every bench under scripts/ does with its figures: print them as JSON, and write them to
``--out`` too when given."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: Path | None) -> int:
    """Print ``result`` (indented JSON), write it to ``out`` if given; 0, a bench's exit code."""
    text = json.dumps(result, indent=1)
    print(text)
    if out is not None:
        out.write_text(text)
    return 0

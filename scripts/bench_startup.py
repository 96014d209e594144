"""Benchmark: what a command pays before it works, against a bare interpreter in the same run.

For each command (``tracediff --help``, ``show`` and ``compare`` on the committed sample, and
``import tracediff`` as a recorder's host pays it) in a fresh interpreter: the wall time of the
whole process, the imports' total (``python -X importtime``: the cumulative time of each top-level
import), and which heavy modules were loaded (numpy, pyarrow, h5py, torch). Baseline: ``python
-c pass`` run the same way, interleaved. Figures are medians over ``--reps``.

Usage: python scripts/bench_startup.py [--reps 7] [--out startup.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchio import emit

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "traces" / "eagle3"
HEAVY = ("numpy", "pyarrow", "h5py", "torch")
RUN = ("import sys; from tracediff.entry import main; sys.argv = ['tracediff', *{args!r}]\n"
       "try:\n    main()\nexcept SystemExit:\n    pass\n"
       "print('LOADED', ' '.join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)")
COMMANDS = {
    "python -c pass (baseline)": "pass",
    "import tracediff": "import sys, tracediff\nprint('LOADED', ' '.join(m for m in "
                        f"{HEAVY!r} if m in sys.modules), file=sys.stderr)",
    "tracediff --help": RUN.format(args=["--help"], heavy=HEAVY),
    "tracediff show": RUN.format(args=["show", str(SAMPLE / "serving.h5")], heavy=HEAVY),
    "tracediff compare (sample)": RUN.format(args=["compare", str(SAMPLE / "training.h5"),
                                                   str(SAMPLE / "serving.h5")], heavy=HEAVY),
}


def once(code: str, checkout: Path = ROOT) -> tuple[float, float, list[str]]:
    """(wall seconds, import seconds, heavy modules loaded) of one fresh interpreter running ``code``
    on ``checkout``'s tracediff."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)})
    wall = time.perf_counter() - started
    imports, loaded = 0, []
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = (part.strip() for part in line.split("|"))
            if cumulative.isdigit() and not name.startswith(" ") and line.split("|")[2][1:2] != " ":
                imports += int(cumulative)
        elif line.startswith("LOADED"):
            loaded = line.split()[1:]
    return wall, imports / 1e6, loaded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--before", type=Path, help="another checkout (e.g. a git worktree of an older "
                        "commit): its commands run too, interleaved, as a second baseline")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    checkouts = {"": ROOT, **({" (before)": args.before.resolve()} if args.before else {})}
    runs: dict[str, list[tuple[float, float, list[str]]]] = {
        name + tag: [] for name in COMMANDS for tag in checkouts}
    for _ in range(args.reps):  # interleaved: the machine's drift hits every command alike
        for name, code in COMMANDS.items():
            for tag, checkout in checkouts.items():
                runs[name + tag].append(once(code, checkout))
    base = statistics.median(w for w, _, _ in runs["python -c pass (baseline)"])
    result = {}
    for name, seen in runs.items():
        wall = statistics.median(w for w, _, _ in seen)
        result[name] = {"wall_s": round(wall, 4), "over_baseline_s": round(wall - base, 4),
                        "imports_s": round(statistics.median(i for _, i, _ in seen), 4),
                        "heavy_loaded": seen[-1][2]}
    return emit(result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

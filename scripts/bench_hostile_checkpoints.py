"""Benchmark: peak memory, time and first stderr line of replay, explain, doctor and bundle --draft
on each hostile draft checkpoint (testbed/hostile.py) and on chains deeper than the inputs hold,
each command the real CLI (.venv/bin/tracediff) in its own process.

Every run gets a fresh empty $TMPDIR (what it leaves there is reported), a wall-clock limit and an
address-space cap (RLIMIT_AS: a run that would take the machine's memory fails instead); peak RSS
is the child's own (wait4's ru_maxrss). The healthy sample draft is the baseline.

Usage: python scripts/bench_hostile_checkpoints.py [--timeout 60] [--cap-gb 4] [--only SUBSTR]
       [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from testbed.hostile import (  # noqa: E402
    HOSTILE,
    SAMPLE_DRAFT,
    SAMPLES,
    hostile_draft,
    run_capped,
    with_num_steps,
)

TRACEDIFF = REPO / ".venv" / "bin" / "tracediff"  # the real CLI, as installed
TARGET = SAMPLES / "target"
SERVING, TRAINING, BUG = SAMPLES / "serving.h5", SAMPLES / "training.h5", SAMPLES / "serving_aux_bug.h5"


@dataclass(frozen=True)
class Run:
    case: str
    command: str
    exit: int | str  # the exit code, or "timeout"
    seconds: float
    peak_rss_mb: float
    stderr: str  # its first line (and a traceback's last)
    tmp_left: list[str]  # what the run left in its $TMPDIR


def commands(draft: Path, work: Path, replayed: Path = SERVING, explained: Path = BUG,
             extra: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The four commands that load a draft, on the sample traces."""
    loads = ["--draft", str(draft), "--target", str(TARGET)]
    return {"replay": ["replay", str(replayed), *loads, *extra],
            "explain": ["explain", str(TRAINING), str(explained), *loads, *extra],
            "doctor": ["doctor", *loads],
            "bundle --draft": ["bundle", str(TRAINING), str(explained), "-o", str(work / "bundle"), *loads,
                               *extra]}


def run(case: str, name: str, args: list[str], work: Path, limit: float, cap: int) -> Run:
    shutil.rmtree(work / "bundle", ignore_errors=True)
    done = run_capped(args, work, limit, cap, program=(str(TRACEDIFF),))
    return Run(case, name, done.exit, done.seconds, done.peak_rss_mb, done.first_line, done.tmp_left)


def cases(work: Path) -> list[tuple[str, dict[str, list[str]]]]:
    """(case, its commands): the healthy draft, each hostile draft, and chains too deep."""
    out = [("healthy sample draft", commands(SAMPLE_DRAFT, work))]
    for name in HOSTILE:
        draft = hostile_draft(name, work / "drafts" / name.replace(" ", "_").replace("/", "_"))
        out.append((name, commands(draft, work)))
    for depths in (100_000, 10**9, 2**63):
        deep = commands(SAMPLE_DRAFT, work, extra=("--depths", str(depths)))
        out.append((f"--depths {depths}", {k: v for k, v in deep.items() if k != "doctor"}))
    steps = {"replay": with_num_steps(SERVING, work / "serving_steps.h5", 100_000),
             "explain": with_num_steps(BUG, work / "bug_steps.h5", 100_000)}
    deep = commands(SAMPLE_DRAFT, work, replayed=steps["replay"], explained=steps["explain"])
    out.append(("trace num_steps 100000", {k: v for k, v in deep.items() if k != "doctor"}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a run may take")
    parser.add_argument("--cap-gb", type=float, default=4.0, help="address-space cap of each run (GiB)")
    parser.add_argument("--only", default="", help="run only the cases whose name holds this")
    parser.add_argument("--out", type=Path, help="also write the runs as JSON")
    opts = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_hostile.") as scratch:
        work = Path(scratch)
        for case, argv in cases(work):
            if opts.only not in case:
                continue
            for name, args in argv.items():
                done = run(case, name, args, work, opts.timeout, int(opts.cap_gb * (1 << 30)))
                runs.append(done)
                left = f"  [left in $TMPDIR: {', '.join(done.tmp_left)}]" if done.tmp_left else ""
                print(f"{case:34} {name:15} exit {str(done.exit):7} {done.seconds:6.1f} s "
                      f"{done.peak_rss_mb:7.0f} MB  {done.stderr}{left}", flush=True)
    worst = max(runs, key=lambda r: r.peak_rss_mb)
    print(f"peak RSS over all runs: {worst.peak_rss_mb:.0f} MB ({worst.case}, {worst.command}); "
          f"cap {opts.cap_gb:g} GiB of address space, {opts.timeout:g} s per run")
    if opts.out:
        opts.out.write_text(json.dumps([asdict(r) for r in runs], indent=1))


if __name__ == "__main__":
    main()

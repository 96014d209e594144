"""Recorder memory in three flood cases, each in a fresh subprocess: peak RSS growth against the bound.

Cases (issue 19): 300k one-row requests at a 16 MiB queue bound; 40 rows at position 16,000,000;
rows with 32 KiB request ids. Before the fix: +258 MiB, +625 MiB and +1.6 GB (peak 4.7-5.8 GB).
Usage: python scripts/bench_recorder_memory.py [--scale 0.1] [--baseline TREE]
(--baseline: a checkout of the old code, e.g. `git worktree add /tmp/old REV`, run side by side.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, resource, sys
import numpy as np
import tracediff as td

case, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
bound = 16 << 20
def rss_kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
def vm_peak_kib():  # address space: a dense table reserves memory that stays unresident until touched
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmPeak:"))
row = np.zeros((1, 4), np.float32)
with td.record(out + ".warm.arrow", queue_bytes=bound) as rec:  # imports and first-use costs
    rec.log("h", row, token_ids=[1])
base, vm_base = rss_kib(), vm_peak_kib()
# on_full="block": every row reaches the writer
with td.record(out, queue_bytes=bound, on_full="block", block_timeout=600) as rec:
    for i in range(n):
        if case == "requests":
            rec.log("h", row, token_ids=[i % 1000], request=f"req-{i}")
        elif case == "far":
            rec.log("h", row, token_ids=[1], positions=[16_000_000], request=f"far-{i}")
        else:
            rec.log("h", row, token_ids=[1], request=("%d-" % i).ljust(32 << 10, "x"))
# the writer's token table fed the same rows directly (learn, and take every 64 calls, as the writer
# does): the bytes its arrays and ids hold at the end (the dense table before reserved to the last position)
from tracediff.record.tokens import TokenBook
book = TokenBook()
for i in range(n):
    request = {"requests": f"req-{i}", "far": f"far-{i}"}.get(case) or f"{i}-".ljust(32 << 10, "x")
    position = np.array([16_000_000 if case == "far" else 0])
    book.learn(np.array([request], dtype=object), position, np.array([1]))
    if i % 64 == 63:
        book.take_new()
arrays = lambda seq: (getattr(seq, "pos", None), seq.token, seq.flags)
held = sum(len(name) + sum(a.nbytes for a in arrays(seq) if a is not None)
           for name, seq in book._sequences.items())
print(json.dumps({"case": case, "book_mib": held / 2**20, "n": n,
                  "peak_growth_mib": (rss_kib() - base) / 1024,
                  "vm_growth_mib": (vm_peak_kib() - vm_base) / 1024,
                  "bound_mib": bound / 2**20, "dropped": dict(rec.dropped_reasons)}))
"""

BEFORE = {"requests": "+258 MiB", "far": "+625 MiB", "ids": "+1.6 GB"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each case's row count")
    parser.add_argument("--baseline", help="a source tree of the code to compare against, run side by side")
    args = parser.parse_args()
    trees = {"now": None} if not args.baseline else {"baseline": args.baseline, "now": None}
    cases = {"requests": 300_000, "far": 40, "ids": 50_000}
    with tempfile.TemporaryDirectory() as tmp:
        for case, n in cases.items():
            n = max(1, int(n * args.scale)) if case != "far" else n
            for label, tree in trees.items():
                env = dict(os.environ, PYTHONPATH=tree) if tree else None
                done = subprocess.run(
                    [sys.executable, "-c", CHILD, case, str(n), f"{tmp}/{label}-{case}.arrow"],
                    capture_output=True,
                    text=True,
                    check=True,
                    env=env,
                    cwd=tmp,  # not this checkout: `-c` puts the working directory first on sys.path
                )
                result = json.loads(done.stdout.strip().splitlines()[-1])
                print(
                    f"{label:8} {case:9} n={n:<7} peak RSS growth {result['peak_growth_mib']:8.1f} MiB "
                    f"token table {result['book_mib']:8.1f} MiB (bound {result['bound_mib']:.0f} MiB; "
                    f"issue: {BEFORE[case]}) dropped {result['dropped']}"
                )


if __name__ == "__main__":
    main()

"""Benchmark: replay and explain throughput (rows/s) against a plain forward of the same draft.

  forward   the draft's TTT unroll over each request's rows (``Eagle3Draft.unroll``), inputs
            already as tensors: the floor, what any offline run of the draft costs
  replay    ``tracediff.eagle3.replay.replay`` on the same trace: reading the rows, the unroll,
            scoring, and the self-check's second unroll of the server's chains
  explain   ``tracediff.eagle3.explain.explain_traces`` of the trace against itself with a second
            checkpoint (another rope_theta): pairing plus one unroll per run (2 + 2 per differing
            group + pairs)

On the committed sample (traces/eagle3/: 3 requests, ~66 rows, hidden 64) with the trace's own
chain depth. Each repeat runs the three back to back in a rotating order; figures are medians of
rows/s and of the ratio to the forward in the same repeat.

Usage: python scripts/bench_explain.py [--repeats 7] [--trace traces/eagle3/serving.h5] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tracediff/ from this checkout

import torch  # noqa: E402
from benchio import emit  # noqa: E402

import tracediff as td  # noqa: E402
from tracediff.eagle3.checkpoint import load_draft, target_embedding  # noqa: E402
from tracediff.eagle3.explain import explain_traces  # noqa: E402
from tracediff.eagle3.replay import chain_depths, contiguous_rows, replay, request_rows  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "eagle3"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--trace", type=Path, default=SAMPLE / "serving.h5")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    embed = target_embedding(SAMPLE / "target")
    draft = load_draft(SAMPLE / "draft", embed)
    with tempfile.TemporaryDirectory() as tmp:
        other_dir = Path(tmp) / "draft"
        shutil.copytree(SAMPLE / "draft", other_dir)
        config = json.loads((other_dir / "config.json").read_text())
        (other_dir / "config.json").write_text(json.dumps({**config, "rope_theta": 10.0}))
        other = load_draft(other_dir, embed)
    with td.open_trace(args.trace) as trace:
        depths = chain_depths(trace).depths
        requests = list(request_rows(trace, None))
        fc_in = [r.fc.head(contiguous_rows(r.positions)).read() for r in requests]
    inputs = [(torch.from_numpy(x[None]),
               torch.from_numpy(r.next_tokens[None, : contiguous_rows(r.positions)]),
               torch.from_numpy(r.rope_positions[None, : contiguous_rows(r.positions)]))
              for x, r in zip(fc_in, requests)]
    rows = sum(int(x.shape[1]) for x, _, _ in inputs)

    def forward() -> None:
        with torch.no_grad():
            for fc_in, ids, positions in inputs:
                draft.unroll(fc_in, ids, depths, positions=positions)

    def run_replay() -> None:
        with td.open_trace(args.trace) as trace:
            replay(trace, draft)

    def run_explain() -> None:
        with td.open_trace(args.trace) as a, td.open_trace(args.trace) as b:
            explain_traces(a, b, {"a": draft, "b": other})

    variants = {"forward": forward, "replay": run_replay, "explain": run_explain}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        names = list(variants)
        names = names[repeat % len(names):] + names[: repeat % len(names)]
        for name in names:
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    result = {"rows": rows, "depths": depths, "repeats": args.repeats}
    for name in variants:
        result[name] = {"seconds": statistics.median(times[name]),
                        "rows_per_s": rows / statistics.median(times[name]),
                        "ratio_to_forward": statistics.median(
                            t / f for t, f in zip(times[name], times["forward"]))}
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())

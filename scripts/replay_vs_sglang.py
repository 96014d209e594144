"""Replay's figure against SGLang's own chains, per served case: the table of issue 24's note.

Serves the committed sample's target and draft (traces/eagle3/) through SGLang 0.5.23's real
target and draft code on CPU (``testbed.sglang_cpu.serve_sample``: 7 steps, topk 1, four chat
prompts sharing a system prefix, 24 new tokens) once per case, scores the chains ``draft_forward``
returned as a greedy verify scores them (those whose every drafted position lies inside the served
text), and replays the recorded trace (the engine's reading:
SGLang's) with its self-check. Needs torch and sglang 0.5.23; about a minute on 2 cores.

Usage: python scripts/replay_vs_sglang.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/ and tracediff/ from this checkout

import tracediff as td  # noqa: E402
from testbed.sglang_cpu import serve_sample  # noqa: E402
from tracediff.eagle3.checkpoint import load_draft, target_embedding, target_tensor  # noqa: E402
from tracediff.eagle3.readings import engine_choice  # noqa: E402
from tracediff.eagle3.replay import replay  # noqa: E402

CASES = {
    "healthy": {},
    "norm_output true": {"config": {"norm_output": True}},
    "norm_output false": {"config": {"norm_output": False}},
    "rope_theta 500000": {"config": {"rope_theta": 500000.0}},
    "no d2t": {"without_d2t": True},
    "num_steps 1": {"num_steps": 1},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name, changes in CASES.items():
            run = serve_sample(Path(work) / name.replace(" ", "_"), **{"num_steps": 7, **changes})
            with td.open_trace(run.trace) as trace:
                choice = engine_choice(trace.engine)
                draft = load_draft(run.draft_dir, target_embedding(run.target_dir), reading=choice.reading,
                                   target_head=target_tensor(run.target_dir, "lm_head"))
                report = replay(trace, draft, engine=choice)
            check = report.self_check
            rows.append({"case": name, "server": 1 + sum(a - 1 for a in run.accepted) / len(run.accepted),
                         "server_chains": len(run.accepted), "replay": report.expected_accept_len,
                         "replay_chains": report.chains,
                         "self_check": None if check is None else f"{check.reproduced}/{check.chains}"})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print("| served | SGLang's chains | replay | self-check |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['case']} | {r['server']:.4f} ({r['server_chains']}) | {r['replay']:.4f} "
                  f"({r['replay_chains']}) | {r['self_check']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

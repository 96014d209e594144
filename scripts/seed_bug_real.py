"""The seed bug with the real code on both sides: SpecForge trains, SGLang serves, tracediff names it.

    python scripts/seed_bug_real.py [--out DIR]

Needs torch, sglang 0.5.23 and specforge 0.2.0 (the README's test setup); about a minute on 2 cores.

One tiny Llama target (8 layers) and one EAGLE-3 draft, built once from fixed seeds. For each case:

- training: SpecForge gets its features the way its capture backend does, from SGLang's real
  target code after ``set_eagle3_layers_to_capture(ids)``, recorded through the SGLang integration;
  then one real SpecForge training step (``OnlineEagle3Model``, TTT unroll, its own loss and
  optimizer) on those features, recorded through the SpecForge integration;
- serving: the same prompts through SGLang's real target and draft code, which read the aux layer
  ids from the exported draft config, recorded through the SGLang integration;
- ``td.compare(training, serving)``.

The cases: ``match`` (the draft config says what training used), ``aux_layer_set`` (the seed's
team: training config [embed, 2, 4], exported draft config [2, 4, 6]; the real case was [embed, 3,
31] against [3, 31, 59]), ``layer_offset`` (a training pipeline that indexed HF ``hidden_states``
with SGLang's ids: it believes it trains on layers [1, 3, 5] and feeds the outputs of [0, 2, 4]).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/ and tracediff/ from this checkout

import tracediff as td  # noqa: E402
from testbed import sglang_cpu  # noqa: E402
from testbed.sglang_cpu import CpuServer, tiny_checkpoint  # noqa: E402
from testbed.specforge_step import train_step  # noqa: E402
from tracediff.diff.results import Report  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 301, 12], [60, 61, 9, 400, 33, 8, 150]]
NEW_TOKENS = 6
NUM_STEPS = 3  # serving: speculative_num_steps (topk 1)
TTT_LENGTH = 3  # training: TTT unroll length


@dataclass(frozen=True)
class Case:
    """What training believes, what its features really hold, and what the exported config says."""

    name: str
    training_ids: tuple[int, ...]  # the training config's aux_hidden_state_layer_ids (SpecForge ids)
    captured_ids: tuple[int, ...]  # the ids the capture really ran with (SGLang ids, output of layer i)
    serving_ids: tuple[int, ...]  # eagle_aux_hidden_state_layer_ids in the exported draft config


CASES = (
    Case("match", (1, 3, 5), (1, 3, 5), (1, 3, 5)),
    Case("aux_layer_set", (-1, 2, 4), (-1, 2, 4), (2, 4, 6)),
    Case("layer_offset", (1, 3, 5), (0, 2, 4), (1, 3, 5)),
)


def serve(workdir: Path, case: Case, out: Path) -> list[list[int]]:
    """The prompts through SGLang's real target + draft, recorded; returns the texts served (each
    prompt and its output), which training then learns from."""
    target_dir, target_weights, draft_dir, draft_weights = tiny_checkpoint(workdir, aux_ids=case.serving_ids)
    with td.record(out, source="serving") as rec:
        server = CpuServer(target_dir, target_weights, draft_dir, draft_weights, num_steps=NUM_STEPS,
                           recorder=rec)
        served = server.serve(PROMPTS, NEW_TOKENS)
        server.close()
    return [prompt + output for prompt, output in zip(PROMPTS, served)]


def train(workdir: Path, case: Case, texts: Sequence[Sequence[int]], out: Path) -> dict:
    """Capture, then one real SpecForge training step on the features; returns SpecForge's metrics."""
    target_dir, target_weights, draft_dir, draft_weights = tiny_checkpoint(workdir, aux_ids=case.training_ids)
    return train_step(texts, target_dir, target_weights, draft_dir, draft_weights,
                      training_ids=case.training_ids, captured_ids=case.captured_ids,
                      out=out, length=TTT_LENGTH)


def run_case(case: Case, out_dir: Path) -> Report:
    with tempfile.TemporaryDirectory() as work:
        texts = serve(Path(work) / "serve", case, out_dir / f"{case.name}.serving.h5")
        train(Path(work) / "train", case, texts, out_dir / f"{case.name}.training.h5")
    return td.compare(out_dir / f"{case.name}.training.h5", out_dir / f"{case.name}.serving.h5")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where the traces go (default: a temp dir)")
    args = parser.parse_args(argv)
    sglang_cpu.prepare()
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="seed_bug_real-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        report = run_case(case, out_dir)
        first = report.first_divergence.name if report.first_divergence else "-"
        why = ", ".join(d.kind for d in report.diagnoses) or "-"
        print(f"{case.name:14s} {report.verdict:10s} first={first} why={why} "
              f"coverage={report.coverage.fraction:.0%}")
    print(f"traces in {out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

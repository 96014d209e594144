"""Write the committed sample traces under traces/ from a tiny HF Llama with a fixed seed.

    python scripts/make_sample_traces.py [--out traces]

The model is built from a config (nothing is downloaded); its layers are watched with
``rec.watch_modules`` exactly as a user would in a training job.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import transformers

import tracediff as td


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(config).eval()


def record_forward(path: Path, model: transformers.LlamaForCausalLM, ids: torch.Tensor) -> None:
    meta = {"target_model": "tiny-llama-4L-64H (seed 0)", "aux_layer_ids": [0, 1, 2],
            "aux_layer_convention": "output_of_layer"}
    with td.record(path, source="training", meta=meta) as rec:
        rec.watch(model.model.embed_tokens, "target.embed")
        rec.watch_modules(model, "model.layers.*", "target.layer.{*}")
        rec.watch(model.lm_head, "target.logits")
        with torch.no_grad():
            for step in range(2):
                batch = ids[:, : 8 + 4 * step]
                with rec.context(step=step, token_ids=batch, request=[f"req{step}.{b}" for b in range(2)]):
                    logits = model(batch).logits
                rec.log("target.token", logits.argmax(-1), step=step, token_ids=batch,
                        request=[f"req{step}.{b}" for b in range(2)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "traces")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = tiny_llama()
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 512, size=(2, 12)))
    for name in ("tiny_llama.h5", "tiny_llama.arrow"):
        record_forward(args.out / name, model, ids)
        print("wrote", args.out / name, (args.out / name).stat().st_size, "bytes")


if __name__ == "__main__":
    main()

"""One real SpecForge 0.2.0 training step on texts, recorded: the training side of a training-vs-serving
compare on CPU (scripts/seed_bug_real.py, tests/test_vllm_live.py).

SpecForge gets its features the way its SGLang capture backend does: SGLang's real target code after
``set_eagle3_layers_to_capture(captured_ids)`` (recorded through the SGLang integration), then one
real training step (``OnlineEagle3Model``, TTT unroll, its own loss and optimizer) on those features,
recorded through the SpecForge integration.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import tracediff as td
from testbed.sglang_cpu import CpuServer, prepare

TTT_LENGTH = 3  # the TTT unroll length


def train_step(texts: Sequence[Sequence[int]], target_dir: str | Path, target_weights: dict,
               draft_dir: str | Path, draft_weights: dict, *, training_ids: Sequence[int],
               captured_ids: Sequence[int], out: Path, length: int = TTT_LENGTH) -> dict:
    """Capture with ``captured_ids`` (SGLang's ids), train one step with the draft at ``draft_dir``
    whose training config says ``training_ids``; returns SpecForge's metrics, the trace in ``out``."""
    prepare()  # SGLang's and SpecForge's CUDA-only imports, stood in for on CPU
    import torch
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    from testbed.specforge_cpu import CpuTrainer, build_draft, collate
    from tracediff.integrations import specforge

    # The capture pass's own logits (its LogitsProcessor's last row) are not training data: SpecForge
    # keeps the hidden states and computes the target's tokens itself (recorded as target.token).
    with td.record(out, source="training", exclude=["target.logits"]) as rec:
        server = CpuServer(str(target_dir), target_weights, recorder=rec)
        try:
            features = server.capture([list(text) for text in texts], captured_ids)
        finally:
            server.close()
        config = json.loads((Path(draft_dir) / "config.json").read_text())
        embed = target_weights["model.embed_tokens.weight"]
        draft = build_draft(config, weights={**draft_weights, "embed_tokens.weight": embed})
        model = OnlineEagle3Model(draft, length=length)
        samples = [{"input_ids": torch.tensor(f.input_ids), "loss_mask": torch.ones(len(f.input_ids),
                                                                                     dtype=torch.long),
                    "aux_hidden_state": f.aux[None], "hidden_state": f.last_hidden[None]} for f in features]
        batch = collate(samples, sample_ids=[f"sample{i}" for i in range(len(samples))])
        handle = specforge.install(rec, model, aux_layer_ids=list(training_ids))
        metrics = CpuTrainer(model, target_weights["lm_head.weight"]).step(batch)
        handle.remove()
    return metrics

"""One real SpecForge 0.2.0 EAGLE-3 training step on a CPU, for tests and proofs.

Everything the step runs is SpecForge's own code: ``Eagle3TrainStrategy.forward_loss`` (its
``TargetHead.preprocess`` shift, the frozen target lm_head, ``OnlineEagle3Model``'s TTT unroll),
``TrainerCore.train_step`` (backward, metric reduction), ``FSDPTrainingBackend`` with
``wrap=False`` (no process group) and ``BF16Optimizer`` (fp32 masters, grad clipping, AdamW).

Two things stand between that code and a CPU, and this module handles both:

1. ``import specforge`` needs triton: ``sglang_cpu.prepare()`` installs SGLang's own triton stub
   and turns torch.compile off (SpecForge compiles RMSNorm, RoPE and the teacher softmax; with
   compile off they run as the plain torch they are written in).
2. The EAGLE-3 loss calls ``specforge.core.loss.LogSoftmaxLoss.apply``, a triton kernel that the
   stub cannot run. SpecForge ships the same loss in plain torch in the same file,
   ``specforge.core.loss._compute_loss`` (marked "Reference implementation"; its
   ``benchmarks/benchmark_loss.py`` checks the kernel against it): ``-sum(mask * p * log_softmax(
   logits)).mean()`` over all B*T rows. For a 0/1 mask that is the value the kernel computes row
   by row, and autograd gives the gradient its backward writes by hand (compared by reading both;
   never run against the kernel, which needs a GPU). ``reference_loss()`` points the name
   ``LogSoftmaxLoss`` in ``specforge.algorithms.eagle3.model`` at that function for the duration
   of a step; SpecForge has no flag or fallback of its own.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from testbed.sglang_cpu import prepare

DEFAULT_SEED = 0


@contextmanager
def reference_loss() -> Iterator[None]:
    """SpecForge's plain-torch loss in place of its triton kernel, inside the block only."""
    prepare()
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.core.loss import _compute_loss

    saved = eagle3_model.LogSoftmaxLoss
    eagle3_model.LogSoftmaxLoss = _ReferenceLoss(_compute_loss)
    try:
        yield
    finally:
        eagle3_model.LogSoftmaxLoss = saved


class _ReferenceLoss:
    """Stands where ``LogSoftmaxLoss`` is called (``.apply(logits, target_p, position_mask)``)."""

    def __init__(self, compute: Any) -> None:
        self.apply = compute


def build_draft(config: Mapping[str, Any], *, seed: int = DEFAULT_SEED,
                weights: Mapping[str, torch.Tensor] | None = None) -> Any:
    """SpecForge's ``LlamaForCausalLMEagle3`` from a config dict (a draft config.json's fields),
    initialised with ``seed``, then given ``weights`` (SpecForge export keys: ``fc.weight``,
    ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, optional
    ``embed_tokens.weight``) when passed. Embeddings frozen, as SpecForge's builder leaves them."""
    prepare()
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    torch.manual_seed(seed)
    draft = LlamaForCausalLMEagle3(LlamaConfig(**dict(config)))
    if weights is not None:
        missing, unexpected = draft.load_state_dict(dict(weights), strict=False)
        missing = [key for key in missing if key != "embed_tokens.weight" and "rotary_emb" not in key]
        if missing or unexpected:
            raise ValueError(f"draft weights do not fit: missing {missing}, unexpected {unexpected}")
    draft.freeze_embedding()
    return draft


def load_draft(path: str | Path, *, embed_tokens: torch.Tensor | None = None) -> Any:
    """A SpecForge-exported draft directory (config.json + model.safetensors, read with safetensors
    only) as SpecForge's ``LlamaForCausalLMEagle3``; ``embed_tokens`` when the file has none."""
    import json

    from tracediff.eagle3.checkpoint import CONFIG, read_weights

    config = json.loads((Path(path) / CONFIG).read_text())
    weights = read_weights(path)
    if embed_tokens is not None and "embed_tokens.weight" not in weights:
        weights["embed_tokens.weight"] = embed_tokens
    return build_draft(config, weights=weights)


@dataclass
class Batch:
    """What SpecForge's EAGLE-3 step reads for a batch (offline layout, right padded): token ids
    before any shift, 1 = real token, 1 = in the loss, the packed aux states the draft's fc
    receives, and the target's last hidden state (after its final norm) for the target lm_head."""

    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L]
    aux_hidden: torch.Tensor  # [B, L, K*H]
    last_hidden: torch.Tensor  # [B, L, H]
    sample_ids: Sequence[str] | None = None

    def train_batch(self) -> Any:
        """SpecForge's ``TrainBatch`` (the offline hidden-state representation)."""
        from specforge.runtime.contracts import TrainBatch

        ids = list(self.sample_ids) if self.sample_ids is not None else \
            [f"sample{b}" for b in range(self.input_ids.shape[0])]
        return TrainBatch(sample_ids=ids, strategy="eagle3", metadata={"target_repr": "hidden_state"},
                          tensors={"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                                   "loss_mask": self.loss_mask, "hidden_state": self.aux_hidden,
                                   "target": self.last_hidden})


def collate(samples: Sequence[Mapping[str, torch.Tensor]], sample_ids: Sequence[str] | None = None,
            max_len: int = 4096) -> Batch:
    """A ``Batch`` from samples in SpecForge's offline feature layout (``input_ids`` [L],
    ``loss_mask`` [L], ``aux_hidden_state`` [1, L, K*H], ``hidden_state`` [1, L, H]) through
    SpecForge's own ``normalize_offline_sample`` (it zeroes the last token's loss mask) and
    ``pad_and_concatenate_features`` (right padding with zeros, as its ``DataCollatorWithPadding``,
    which needs the ``datasets`` package)."""
    prepare()
    from specforge.algorithms.common.collation import pad_and_concatenate_features
    from specforge.algorithms.eagle3.data import normalize_offline_sample

    keys = ("input_ids", "attention_mask", "loss_mask", "hidden_state", "target")
    normalized = [normalize_offline_sample(dict(sample), max_len=max_len) for sample in samples]
    batch = pad_and_concatenate_features(normalized, sequence_axes=dict.fromkeys(keys, 1), required_keys=keys)
    return Batch(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 loss_mask=batch["loss_mask"], aux_hidden=batch["hidden_state"], last_hidden=batch["target"],
                 sample_ids=sample_ids)


@torch.no_grad()
def hf_sample(target: torch.nn.Module, input_ids: torch.Tensor, loss_mask: torch.Tensor,
              aux_layer_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """One sample in SpecForge's offline feature layout from a Hugging Face Llama-style model: aux =
    the outputs of decoder layers ``aux_layer_ids`` (SpecForge's output-of-layer ids, packed
    ascending as its SGLang capture packs them; taken by hooks, since HF's last ``hidden_states``
    entry is after the final norm), hidden_state = that last entry (SpecForge's last hidden state)."""
    from tracediff.eagle3.capture import AuxSpec, run_target

    aux = run_target(target, input_ids[None]).aux(AuxSpec(tuple(aux_layer_ids), ascending=True))
    last = target(input_ids=input_ids[None], output_hidden_states=True).hidden_states[-1]
    return {"input_ids": input_ids, "loss_mask": loss_mask, "aux_hidden_state": aux, "hidden_state": last}


class CpuTrainer:
    """SpecForge's own step machinery around an ``OnlineEagle3Model``, one ``step`` per batch."""

    def __init__(self, eagle3_model: Any, target_lm_head: torch.Tensor, *, lr: float = 1e-3,
                 max_grad_norm: float = 0.5, total_steps: int = 1000, ploss_decay: float = 0.8) -> None:
        prepare()
        from specforge.optimizer import BF16Optimizer
        from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
        from specforge.training.controller import TrainerCore
        from specforge.training.strategies.base import Eagle3TrainStrategy

        self.model = eagle3_model
        self.global_step = 0
        backend = FSDPTrainingBackend(ParallelConfig(), optimizer_factory=lambda module: BF16Optimizer(
            module, lr=lr, max_grad_norm=max_grad_norm, total_steps=total_steps, warmup_ratio=0.0,
            lr_scheduler="constant"))
        backend.prepare_model(eagle3_model, wrap=False, optimizer_target=eagle3_model.draft_model)
        strategy = Eagle3TrainStrategy(eagle3_model, target_head=target_head(target_lm_head),
                                       ploss_decay=ploss_decay)
        self.core = TrainerCore(strategy, backend)

    def step(self, batch: Batch) -> dict[str, Any]:
        """One forward + loss + backward + optimizer step; SpecForge's metrics for it (``loss``,
        ``acc``, ``acc_i`` / ``ploss_i`` per TTT step, ``grad_norm``)."""
        from specforge.training.strategies.base import StepContext

        with reference_loss():
            result = self.core.train_step(batch.train_batch(), StepContext(global_step=self.global_step))
        self.global_step += 1
        return dict(result.metrics)


def target_head(lm_head: torch.Tensor) -> Any:
    """SpecForge's frozen ``TargetHead`` holding ``lm_head`` [V, H]. It reads its shape from a
    config directory; a temporary one with a Llama config of that shape stands in for the model's."""
    prepare()
    from specforge.modeling.target.target_head import TargetHead
    from transformers import LlamaConfig

    vocab, hidden = lm_head.shape
    with tempfile.TemporaryDirectory() as folder:
        LlamaConfig(vocab_size=vocab, hidden_size=hidden).save_pretrained(folder)
        head = TargetHead(folder)
    with torch.no_grad():
        head.fc.weight.copy_(lm_head)
    head.freeze_weights()
    return head.eval()

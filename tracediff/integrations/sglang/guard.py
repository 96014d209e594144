"""The version guard: every SGLang internal the recording reads, checked before anything is
attached, so that another SGLang fails loudly instead of recording wrong tensors."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

from tracediff.eagle3.conventions import sglang_version
from tracediff.eagle3.versions import SGLANG_VERSION

SUPPORTED_SGLANG = (SGLANG_VERSION,)  # eagle3/versions.py


class SglangInternalsError(RuntimeError):
    """An SGLang internal the recording reads is missing or changed: recording would give wrong
    tensors, so nothing is recorded."""


def parameter_names(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _require(ok: bool, internal: str) -> None:
    if not ok:
        supported = ", ".join(SUPPORTED_SGLANG)
        raise SglangInternalsError(f"sglang {sglang_version()}: {internal} is missing or changed "
                                   f"(tracediff records SGLang {supported}); nothing is recorded")


def _has_fields(cls: type, names: Sequence[str], label: str) -> None:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for name in names:
        _require(name in fields, f"{label}.{name}")


def check_internals(draft: Any = None, worker: Any = None) -> None:
    """Every SGLang internal the recording reads, checked before anything is attached; raises
    SglangInternalsError naming the first one missing or changed, and the installed version. A
    target's own parts are checked where they are found (models.target_layout)."""
    try:
        from sglang.srt.layers.layer_boundary.residual.stream import ResidualStream
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    except Exception as exc:  # sglang absent, or it cannot import here (no triton on a CPU machine)
        raise SglangInternalsError(f"sglang {sglang_version()} cannot be imported in this process "
                                   f"({type(exc).__name__}: {exc}); nothing is recorded") from None

    _has_fields(ForwardBatch, ("forward_mode", "batch_size", "input_ids", "positions", "extend_seq_lens_cpu",
                               "spec_info", "residual_stream"), "ForwardBatch")
    _require(callable(getattr(ForwardMode, "is_extend", None)), "ForwardMode.is_extend")
    _require(callable(getattr(ForwardMode, "is_idle", None)), "ForwardMode.is_idle")
    _has_fields(LogitsProcessorOutput, ("next_token_logits", "hidden_states"), "LogitsProcessorOutput")
    _require("residual" in getattr(ResidualStream, "__slots__", ()), "ResidualStream.residual")
    _require({"rid", "origin_input_ids"} <= set(parameter_names(Req.__init__)), "Req(rid, origin_input_ids)")
    _has_fields(ScheduleBatch, ("reqs",), "ScheduleBatch")
    if draft is not None:
        _check_draft(draft)
        from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

        draft_forward = getattr(EagleDraftWorker, "draft_forward", None)
        _require(parameter_names(draft_forward)[:2] == ["self", "forward_batch"],
                 "EagleDraftWorker.draft_forward(self, forward_batch)")
    if worker is not None:
        for name in ("hot_token_id", "topk", "speculative_num_steps"):
            _require(hasattr(worker, name), f"EagleDraftWorker.{name}")


def _model_forward(module: Any, label: str) -> None:
    _require(parameter_names(module.forward)[:3] == ["input_ids", "positions", "forward_batch"],
             f"{label}.forward(input_ids, positions, forward_batch)")


def _check_draft(draft: Any) -> None:
    name = type(draft).__name__
    model: Any = getattr(draft, "model", None)
    for attr in ("embed_tokens", "fc", "layers"):
        _require(hasattr(model, attr), f"{name}.model.{attr}")
    _model_forward(model, f"{name}.model")
    for attr in ("logits_processor", "hot_token_id", "config"):
        _require(hasattr(draft, attr), f"{name}.{attr}")

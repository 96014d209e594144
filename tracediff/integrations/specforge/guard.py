"""The SpecForge version guard: which internals the recorder relies on, checked before it attaches.

``check_supported(model)`` returns the ``OnlineEagle3Model`` to hook, or raises
``SpecForgeUnsupported`` with one line naming what this SpecForge lacks.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from tracediff.eagle3.versions import SPECFORGE_VERSION

SUPPORTED_SPECFORGE = (SPECFORGE_VERSION,)  # eagle3/versions.py
MODEL_MODULE = "specforge.algorithms.eagle3.model"
STEP_FIELDS = ("input_ids", "position_ids", "target_token_ids", "loss_mask")
FORWARD_ARGS = ("input_ids", "attention_mask", "target", "loss_mask", "hidden_states", "position_ids")
DRAFT_MODULES = ("embed_tokens", "fc", "midlayer", "lm_head")


class SpecForgeUnsupported(RuntimeError):
    """This SpecForge lacks an internal the recorder relies on (one line: what, which version)."""


def check_supported(eagle3_model: Any) -> Any:
    """The ``OnlineEagle3Model`` to hook; ``SpecForgeUnsupported`` naming what is missing."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("specforge")
    except PackageNotFoundError:
        raise SpecForgeUnsupported("specforge is not installed") from None
    where = f"SpecForge {found} (tracediff supports {', '.join(SUPPORTED_SPECFORGE)})"

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise SpecForgeUnsupported(f"{where} lacks {what}, which the recorder needs")

    try:
        model_module = importlib.import_module(MODEL_MODULE)
        adapters = importlib.import_module("specforge.core.eagle3_adapters")
        llama = importlib.import_module("specforge.modeling.draft.llama3_eagle")
        strategies = importlib.import_module("specforge.training.strategies.base")
    except ImportError as exc:
        raise SpecForgeUnsupported(f"{where}: cannot import {exc.name}") from None
    cls: Any = getattr(model_module, "OnlineEagle3Model", None)
    need(cls is not None, f"{MODEL_MODULE}.OnlineEagle3Model")
    model = eagle3_model if isinstance(eagle3_model, cls) else getattr(eagle3_model, "module", None)
    if not isinstance(model, cls):
        raise SpecForgeUnsupported(f"{type(eagle3_model).__name__} is not SpecForge's OnlineEagle3Model")
    params = inspect.signature(type(model).forward).parameters
    need(all(arg in params for arg in FORWARD_ARGS), f"OnlineEagle3Model.forward({', '.join(FORWARD_ARGS)})")
    need(callable(getattr(model, "_make_adapter", None)), "OnlineEagle3Model._make_adapter")
    need(all(hasattr(model, a) for a in ("draft_model", "length", "attention_backend")),
         "OnlineEagle3Model.draft_model / .length / .attention_backend")
    fields = getattr(getattr(adapters, "StepState", None), "__dataclass_fields__", {})
    need(all(f in fields for f in STEP_FIELDS), f"StepState fields {', '.join(STEP_FIELDS)}")
    need(callable(getattr(llama, "apply_rotary_pos_emb", None)), "llama3_eagle.apply_rotary_pos_emb")
    strategy = getattr(strategies, "Eagle3TrainStrategy", None)
    need(callable(getattr(strategy, "forward_loss", None)), "Eagle3TrainStrategy.forward_loss")
    draft = model.draft_model
    need(all(hasattr(draft, m) for m in (*DRAFT_MODULES, "d2t", "t2d", "config")),
         f"draft modules {', '.join(DRAFT_MODULES)} and d2t/t2d buffers")
    if model.attention_backend == "usp":
        raise SpecForgeUnsupported(f"{where}: attention_backend 'usp' (sequence parallel) is not supported")
    return model


__all__ = ["MODEL_MODULE", "SUPPORTED_SPECFORGE", "SpecForgeUnsupported", "check_supported"]

"""Where an SGLang target keeps what the recording reads, for every family that serves EAGLE-3.

``target_layout(model)`` finds the parts through SGLang's shared mechanisms, not one class: the text
body is the module that owns ``layers_to_capture`` (a VL wrapper's language model included), its
layers either hand the residual stream on through ``attn_boundary`` ("boundary" layers: the stream
is read where SGLang reads it for capture) or return ``(branch, residual)`` ("classic" layers, e.g.
Gemma 3: the stream is their sum). ``model_role(cls)`` says which classes the launcher attaches to:
every class of SGLang's model registry that defines ``set_eagle3_layers_to_capture`` is a target,
an EAGLE-3 draft class (``...Eagle3...``) is a draft. A part that is missing raises
SglangInternalsError naming the class and the internal, before anything is attached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracediff.integrations.sglang.guard import SglangInternalsError, parameter_names, sglang_version

BOUNDARY = "boundary"  # layers defer the residual add; forward_batch.residual_stream holds the stream
CLASSIC = "classic"  # layers return (branch, residual); the stream after a layer is their sum
CAPTURE_FLAG = "_is_layer_to_capture"  # per-layer capture flags (Qwen2/3-MoE, Qwen3-Next): never cleared


@dataclass(frozen=True)
class TargetLayout:
    """The parts of one SGLang target the recording hooks, and what the contract names it by."""

    model: Any  # the object SGLang serves (has set_eagle3_layers_to_capture)
    body: Any  # the text model: embed_tokens, layers, norm, layers_to_capture
    logits_processor: Any  # hands the aux hidden states to the draft (LogitsProcessorOutput.hidden_states)
    pattern: str  # BOUNDARY or CLASSIC
    model_class: str  # e.g. sglang.srt.models.deepseek_v2.DeepseekV3ForCausalLM
    family: str  # the model file: deepseek_v2

    @property
    def layers(self) -> Any:
        return self.body.layers

    def capture_layers(self) -> list[int]:
        """The layer boundaries that really capture, in capture order: k = the stream entering layer
        k (k = len(layers): after the last layer). Per-layer flags, where the family sets them, decide
        (a second set_eagle3_layers_to_capture leaves the first one's flags set); else
        ``layers_to_capture``, as SGLang's layer loop reads it."""
        flagged = [k for k, layer in enumerate(self.layers) if getattr(layer, CAPTURE_FLAG, False)]
        if flagged:
            return flagged
        return sorted({int(k) for k in self.body.layers_to_capture})

    def contract(self) -> dict:
        return {"target_model_class": self.model_class, "target_family": self.family,
                "target_layer_pattern": self.pattern, "target_num_layers": len(self.layers)}


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


MODELS = "sglang.srt.models."  # the package of SGLang's model files


def family_of(cls: type) -> str:
    """The SGLang model file of the class, or of the nearest base class in one (a subclass of your
    own keeps its family): ``sglang.srt.models.qwen3_moe`` -> ``qwen3_moe``; ``unknown`` if none."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(MODELS):
            return klass.__module__.rsplit(".", 1)[-1]
    return "unknown"


OTHER_DRAFTS = ("Eagle", "NextN", "MTP")  # draft models of other algorithms (EAGLE-1/2, MTP): never a target


def model_role(cls: type) -> str | None:
    """``"draft"`` for an EAGLE-3 draft class, ``"target"`` for a class that captures aux states for
    EAGLE-3, else None. Drafts subclass targets (LlamaForCausalLMEagle3, and EAGLE-2's
    LlamaForCausalLMEagle or DeepSeek's NextN inherit the setter too), so drafts are asked first."""
    if "eagle3" in cls.__module__.rsplit(".", 1)[-1] or "Eagle3" in cls.__name__:
        return "draft"
    if any(marker in cls.__name__ for marker in OTHER_DRAFTS):
        return None
    if callable(getattr(cls, "set_eagle3_layers_to_capture", None)):
        return "target"
    return None


def _missing(model: Any, internal: str) -> SglangInternalsError:
    return SglangInternalsError(f"sglang {sglang_version()}: {class_name(type(model))} has no {internal}; "
                                "its target states are not recorded")


def _body(model: Any) -> Any:
    """The module owning ``layers_to_capture`` and ``layers``, nearest the top (a VL wrapper's text model)."""
    for _, module in model.named_modules():
        if hasattr(module, "layers_to_capture") and hasattr(module, "layers"):
            return module
    raise _missing(model, "text model with layers_to_capture and layers")


def _logits_processor(model: Any) -> Any:
    for _, module in model.named_modules():
        found = getattr(module, "logits_processor", None)
        if found is not None:
            return found
    raise _missing(model, "logits_processor")


def target_layout(model: Any) -> TargetLayout:
    """The parts of ``model`` the recording reads; SglangInternalsError names the first one missing."""
    if not callable(getattr(model, "set_eagle3_layers_to_capture", None)):
        raise _missing(model, "set_eagle3_layers_to_capture")
    body = _body(model)
    for attr in ("embed_tokens", "norm"):
        if not hasattr(body, attr):
            raise _missing(model, f"{type(body).__name__}.{attr}")
    layers = list(body.layers)
    if not layers:
        raise _missing(model, f"{type(body).__name__}.layers (empty: a pipeline stage without layers)")
    boundary = all(callable(getattr(getattr(layer, "attn_boundary", None), "prepare", None))
                   for layer in layers)
    if not boundary:
        for i, layer in enumerate(layers):
            if not {"hidden_states", "residual"} <= set(parameter_names(layer.forward)):
                raise _missing(model, f"layers[{i}]: neither attn_boundary.prepare nor "
                               "forward(hidden_states, residual)")
    cls = type(model)
    return TargetLayout(model=model, body=body, logits_processor=_logits_processor(model),
                        pattern=BOUNDARY if boundary else CLASSIC, model_class=class_name(cls),
                        family=family_of(cls))

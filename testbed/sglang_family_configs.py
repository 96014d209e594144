"""Tiny HF transformers configs for SGLang's EAGLE-3 target families (test bed, not shipped).

One ``Family`` per SGLang model file: the HF config a checkpoint of that family carries (hidden 64,
``LAYERS`` layers, vocab ``VOCAB``), its architecture name, the KV pool it needs and the server
arguments its constructors read. Fields a real checkpoint's config.json has and HF's config class
lacks are set on the config (SGLang reads them). ``sglang_families`` builds and runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

LAYERS = 6
VOCAB = 512
HIDDEN = 64

_COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                               max_position_embeddings=256, tie_word_embeddings=False)
_GQA: dict[str, Any] = dict(num_attention_heads=4, num_key_value_heads=2)
# MLA (DeepSeek-V2/V3, Kimi, GLM-4 MoE lite): latent KV of rank 32, rope head dim 8
_MLA: dict[str, Any] = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
# SGLang publishes these for backends that do what the model asks (attention sinks, absorbed MLA in
# prefill); the forwards then run on TorchNativeAttnBackend
_TRITON: dict[str, Any] = dict(attention_backend="triton")
_ABSORBED_MLA: dict[str, Any] = dict(attention_backend="triton", enable_deterministic_inference=True)


@dataclass(frozen=True)
class Family:
    """One SGLang target family: ``name`` is its model file under ``sglang/srt/models``."""

    name: str
    arch: str
    config: Callable[[], Any]
    kv: str = "mha"  # "mha", "mla" (latent KV pool) or "sinks" (MHA + attention sinks)
    server_args: Mapping[str, Any] = field(default_factory=dict)
    tolerance: float = 1e-5  # SGLang vs HF in float32, relative to the largest value of a state
    text_arch: str | None = None  # a wrapper (VL) family: the HF text model the reference runs
    wrap: Callable[[str], None] | None = None  # rewrites the saved text checkpoint into the wrapper's layout


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(intermediate_size=128, **_GQA, **_COMMON)


def _qwen2() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(intermediate_size=128, **_GQA, **_COMMON)


def _qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(intermediate_size=128, head_dim=16, **_GQA, **_COMMON)


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                          num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], **_GQA, **_COMMON)


def _qwen2_moe() -> Any:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                          num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                          **_GQA, **_COMMON)


def _glm4_moe() -> Any:
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(intermediate_size=128, moe_intermediate_size=32, n_shared_experts=1,
                         n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                         first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                         use_qk_norm=True, attention_bias=True, **_GQA, **_COMMON)


def _glm4_moe_lite() -> Any:
    from transformers import Glm4MoeLiteConfig

    # eps 1e-6: HF's q_a/kv_a latent norms hard-code it, SGLang's read rms_norm_eps (at 1e-5: 1e-4 apart)
    config = Glm4MoeLiteConfig(intermediate_size=128, moe_intermediate_size=32, n_shared_experts=1,
                               n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
                               routed_scaling_factor=1.8, rms_norm_eps=1e-6,
                               mlp_layer_types=["dense"] + ["sparse"] * (LAYERS - 1), **_MLA, **_COMMON)
    config.first_k_dense_replace, config.moe_layer_freq, config.topk_method = 1, 1, "noaux_tc"
    return config


def deepseek_v3() -> Any:
    """A tiny DeepSeek-V3 / Kimi-K2.5 text model: MLA, routed + shared experts, the first layer dense,
    yarn rope as the real config.json has it (SGLang's CPU rope factory knows no other for MLA)."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(intermediate_size=128, moe_intermediate_size=32, n_shared_experts=1,
                              n_routed_experts=4, routed_scaling_factor=2.5, n_group=2, topk_group=1,
                              num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
                              rope_interleave=True,
                              rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                                                   beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
                                                   original_max_position_embeddings=64),
                              **_MLA, **_COMMON)
    config.moe_layer_freq, config.topk_method, config.scoring_func = 1, "noaux_tc", "sigmoid"
    config.ep_size, config.num_nextn_predict_layers = 1, 1
    return config


def _kimi_k25_checkpoint(path: str) -> None:
    """A DeepSeek-V3 text checkpoint -> Kimi-K2.5's layout: every weight under ``language_model.``,
    config.json a KimiK25 config whose text_config is the DeepSeek-V3 one (a one-block vision tower
    keeps SGLang's init: text-only prompts never reach it)."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    weights = os.path.join(path, "model.safetensors")
    save_file({f"language_model.{k}": v.contiguous() for k, v in load_file(weights).items()}, weights)
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    config = dict(architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25", text_config=text,
                  vision_config=dict(patch_size=14, num_attention_heads=2, num_hidden_layers=1,
                                     hidden_size=32, intermediate_size=64, mm_hidden_size=32,
                                     vt_hidden_size=32, text_hidden_size=text["hidden_size"]),
                  tie_word_embeddings=False, torch_dtype="float32")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(intermediate_size=64, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=4, layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
                        **_GQA, **_COMMON)


def _minimax_m2() -> Any:
    from transformers import MiniMaxM2Config

    partial_rope: dict[str, Any] = dict(rotary_dim=8)  # the released checkpoints' field (HF: a legacy kwarg)
    config = MiniMaxM2Config(intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                             **partial_rope, **_GQA, **_COMMON)
    config.scoring_func, config.use_routing_bias = "sigmoid", True
    config.use_qk_norm, config.qk_norm_type = True, "per_layer"
    return config


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    pattern = ["sliding_attention", "sliding_attention", "full_attention"] * (LAYERS // 3)
    return Gemma3TextConfig(intermediate_size=128, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                            layer_types=pattern, **_GQA, **{**_COMMON, "tie_word_embeddings": True})


def _apertus() -> Any:
    from transformers import ApertusConfig

    return ApertusConfig(intermediate_size=128, **_GQA, **_COMMON)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM", _llama),
    Family("qwen2", "Qwen2ForCausalLM", _qwen2),
    Family("qwen3", "Qwen3ForCausalLM", _qwen3),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", _qwen2_moe),
    Family("glm4_moe", "Glm4MoeForCausalLM", _glm4_moe),
    Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", _glm4_moe_lite, kv="mla", server_args=_ABSORBED_MLA),
    Family("deepseek_v2", "DeepseekV3ForCausalLM", deepseek_v3, kv="mla", server_args=_ABSORBED_MLA),
    # Kimi-K2.5 (the VL wrapper, text-only prompts): the ids go unchanged to its DeepseekV3ForCausalLM
    Family("kimi_k25", "KimiK25ForConditionalGeneration", deepseek_v3, kv="mla", server_args=_ABSORBED_MLA,
           text_arch="DeepseekV3ForCausalLM", wrap=_kimi_k25_checkpoint),
    # SGLang keeps the attention sinks in bfloat16
    Family("gpt_oss", "GptOssForCausalLM", _gpt_oss, kv="sinks", server_args=_TRITON, tolerance=1e-4),
    Family("minimax_m2", "MiniMaxM2ForCausalLM", _minimax_m2),
    Family("gemma3_causal", "Gemma3ForCausalLM", _gemma3),
    # SGLang's XIELU activation keeps its parameters in bfloat16 (HF: the model's dtype)
    Family("apertus", "ApertusForCausalLM", _apertus, tolerance=1e-3),
)}

"""What a serving trace states about its run: aux ids as configured and resolved, the vocab map's
hash, the resolved server arguments, TP rank and size."""

from __future__ import annotations

import hashlib
from typing import Any

from tracediff.eagle3.draft_summary import draft_config_summary
from tracediff.jsonio import stated

SPEC_ARGS = {"algorithm": "speculative_algorithm", "num_steps": "speculative_num_steps",
             "topk": "speculative_eagle_topk", "num_draft_tokens": "speculative_num_draft_tokens"}
SERVER_ARGS = ("attention_backend", "dtype", "device", "tp_size", "page_size", "disable_cuda_graph",
               "disable_overlap_schedule", "speculative_draft_window_size")


def sha256(tensor: Any) -> str:
    return hashlib.sha256(tensor.detach().to("cpu").contiguous().numpy().tobytes()).hexdigest()


def draft_contract(draft: Any) -> dict:
    import torch

    config = draft.config
    eagle = getattr(config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    model = draft.model
    values: dict[str, Any] = {
        "aux_layer_ids": None if ids is None else [int(i) for i in ids],
        "draft_config": draft_config_summary(config),
        # 0.5.23 builds norm_before_fc's input_norm and fc_norm from the config: it applies what the
        # checkpoint asks for (the key's meaning in every producer's contract)
        "fc_norms_applied": hasattr(model, "input_norm") and hasattr(model, "fc_norm"),
        "draft_input_shift": 1,
        "d2t_reading": "offset",
        "draft_engine": "sglang",  # the draft code that ran (tracediff/eagle3/readings.py)
    }
    hot = draft.hot_token_id
    values["vocab_map_applied"] = hot is not None  # without one SGLang takes draft ids for target ids
    if hot is not None:
        hot = hot.detach().to("cpu", torch.int64)
        values["hot_token_id_sha256"] = sha256(hot)
        values["d2t_sha256"] = sha256(hot - torch.arange(len(hot)))
    return values


def server_contract(server_args: Any) -> dict:
    """Server arguments as SGLang resolved them (its rewrites show only in ``resolved_view``), and
    the speculative arguments as the user gave them (a clamp shows as a difference of the two)."""
    if server_args is None:
        return {}
    from sglang.srt.arg_groups.model_override_base import resolved_view

    view = resolved_view(server_args)
    spec = {k: stated(getattr(view, attr, None)) for k, attr in SPEC_ARGS.items()}
    asked = {k: stated(getattr(server_args, attr, None)) for k, attr in SPEC_ARGS.items()}
    args = {attr: stated(getattr(view, attr, None)) for attr in SERVER_ARGS}
    name = getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", None)
    return {"speculative_args": spec, "speculative_args_requested": asked, "server_args": args,
            "target_model": name, "attention_backend": args["attention_backend"]}



def tp_ranks() -> dict:
    """TP rank and size as SGLang holds them (the recorder writes one file per rank)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        return {"tp_rank": int(parallel.tp_rank), "tp_size": int(parallel.tp_size)}
    except Exception:  # no parallel context published (a model built outside a server)
        return {}

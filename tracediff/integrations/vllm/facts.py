"""What a vLLM serving trace states about its run, read from the worker's own model runner.

The resolved speculative config (method, draft tokens per step, the draft's path), the aux layers
the server selected (``aux_hidden_state_layers``: vLLM's ids, id k = the stream entering layer k)
and the ids it read them from, the draft's config and vocab map, dtype, compilation mode and the
scheduler settings that shape batches. What each aux slot really holds is measured (hooks.py).
"""

from __future__ import annotations

import hashlib
from typing import Any

from tracediff.eagle3.draft_summary import draft_config_summary
from tracediff.integrations.target_summary import target_config_summary, target_identity
from tracediff.integrations.vllm.guard import vllm_version
from tracediff.jsonio import stated

PRODUCER = "vllm"  # as the trace's ``producers`` and ``draft_engine`` name it



def _sha256(tensor: Any) -> str:
    return hashlib.sha256(tensor.detach().to("cpu").contiguous().numpy().tobytes()).hexdigest()


def config_ids(hf_config: Any) -> list[int] | None:
    """The aux ids a draft config gives, read as vLLM 0.32 reads them: a top-level
    ``eagle_aux_hidden_state_layer_ids``, else ``eagle_config``'s; None when neither gives any."""
    ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
    if not ids:
        eagle = getattr(hf_config, "eagle_config", None)
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    return [int(i) for i in ids] if isinstance(ids, (list, tuple)) and ids else None


def run_facts(runner: Any) -> dict[str, Any]:
    """The contract keys of one worker's run (never raises for a missing optional part)."""
    import torch

    config = runner.vllm_config
    model_config = config.model_config
    compilation = config.compilation_config
    mode = getattr(compilation, "mode", None)
    scheduler = config.scheduler_config
    values: dict[str, Any] = {
        "source": "serving", "vllm_version": vllm_version(), "torch_version": torch.__version__,
        "target_model": stated(getattr(model_config, "model", None)),
        "compilation_mode": stated(getattr(mode, "name", mode)),
        "enforce_eager": bool(getattr(model_config, "enforce_eager", False)),
        "dtypes": {"target": str(getattr(model_config, "dtype", "")).replace("torch.", "")},
        "server_args": {
            "max_model_len": stated(getattr(model_config, "max_model_len", None)),
            "enable_prefix_caching": stated(getattr(config.cache_config, "enable_prefix_caching", None)),
            "block_size": stated(getattr(config.cache_config, "block_size", None)),
            "enable_chunked_prefill": stated(getattr(scheduler, "enable_chunked_prefill", None)),
            "max_num_batched_tokens": stated(getattr(scheduler, "max_num_batched_tokens", None)),
            "max_num_seqs": stated(getattr(config.scheduler_config, "max_num_seqs", None)),
            "async_scheduling": stated(getattr(config.scheduler_config, "async_scheduling", None)),
        },
        **target_identity(runner.model),
    }
    hf = getattr(model_config, "hf_config", None)
    if "target_config" not in values and hf is not None:  # a model class without a ``config`` of its own
        values["target_config"] = target_config_summary(hf, runner.model)
    body = getattr(runner.model, "model", None)
    layers = getattr(body, "aux_hidden_state_layers", None)
    if layers:
        values["aux_hidden_state_layers"] = [int(k) for k in layers]
    spec = getattr(runner, "speculative_config", None)
    if spec is not None:
        values.update(speculative_facts(spec))
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and getattr(drafter, "model", None) is not None:
        values.update(draft_facts(drafter.model, spec))
    return values


def speculative_facts(spec: Any) -> dict[str, Any]:
    """The speculative config as vLLM resolved it; ``speculative_args`` in the keys every serving
    trace uses (a chain of ``num_steps`` draft tokens, topk 1, verified with the bonus token)."""
    k = getattr(spec, "num_speculative_tokens", None)
    method = stated(getattr(spec, "method", None))
    draft = getattr(spec, "draft_model_config", None)
    return {
        "speculative_config": {"method": method, "num_speculative_tokens": stated(k),
                               "model": stated(getattr(spec, "model", None)),
                               "disable_padded_drafter_batch": stated(
                                   getattr(spec, "disable_padded_drafter_batch", None))},
        "speculative_args": {"algorithm": method, "num_steps": stated(k), "topk": 1,
                             "num_draft_tokens": None if k is None else int(k) + 1},
        "aux_layer_ids": None if draft is None else config_ids(getattr(draft, "hf_config", None)),
    }


def draft_facts(draft: Any, spec: Any) -> dict[str, Any]:
    """The draft as vLLM built it: its config, its vocab map (``draft_id_to_target_id``: offsets),
    and that the fc norms its config asks for are applied."""
    import torch

    config = getattr(draft, "config", None)
    values: dict[str, Any] = {
        "draft_engine": PRODUCER, "draft_input_shift": 1, "d2t_reading": "offset",
        "draft_class": f"{type(draft).__module__}.{type(draft).__qualname__}",
        # as in every producer's contract: whether the engine applies the fc norms the checkpoint asks
        # for (vLLM 0.32's combine_hidden_states applies norm_before_fc's input_norm and each fc_norm)
        "fc_norms_applied": True,
    }
    if config is not None:
        values["draft_config"] = draft_config_summary(config)
        values["norm_before_residual"] = stated(getattr(config, "norm_before_residual", None))
    d2t = getattr(draft, "draft_id_to_target_id", None)
    values["vocab_map_applied"] = d2t is not None
    if d2t is not None:
        values["d2t_sha256"] = _sha256(d2t.detach().to("cpu", torch.int64))
    return values

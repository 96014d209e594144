"""Plain-torch stand-ins for the few SGLang kernels some target families call and CPU lacks (test bed).

Each replaces one triton-only function at the seam the model calls, with the same math, so the rest
of the family's real code runs: Qwen2-MoE's shared-expert gate, MiniMax-M2's serial q/k RMSNorm, and
an attention backend that applies GPT-OSS's attention sinks (TorchNativeAttnBackend has none).
"""

from __future__ import annotations

from typing import Any

import torch


def _gate_sigmoid_mul(hidden_states: torch.Tensor, gate_weight: torch.Tensor,
                      shared_output: torch.Tensor) -> torch.Tensor:
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float().reshape(-1, 1))
    return (gate * shared_output.float()).to(shared_output.dtype)


def _gate_sigmoid_mul_add(hidden_states: torch.Tensor, gate_weight: torch.Tensor, shared_output: torch.Tensor,
                          final_hidden_states: torch.Tensor) -> None:
    final_hidden_states.add_(_gate_sigmoid_mul(hidden_states, gate_weight, shared_output))


def _rms_sumsq(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """The rows' sums of squares in the triton kernel's layout: q's at [0, B), k's at [B, 2B)."""
    return torch.cat([x1.float().pow(2).sum(-1), x2.float().pow(2).sum(-1)])


def _rms_apply(x1: torch.Tensor, x2: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, sum_sq: torch.Tensor,
               tp_world: int = 1, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x1.shape[0]

    def apply(x: torch.Tensor, w: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
        inv = torch.rsqrt(sq[:, None] / x.shape[-1] / tp_world + eps)
        return (x.float() * inv * w.float()).to(x.dtype)

    return apply(x1, w1, sum_sq[:rows]), apply(x2, w2, sum_sq[rows : 2 * rows])


def install() -> None:
    """Put the stand-ins in place (idempotent). They replace functions that cannot run without
    triton, so no family that ran before changes."""
    import sglang.srt.models.minimax_m2 as minimax_m2
    import sglang.srt.models.qwen2_moe as qwen2_moe

    qwen2_moe.fused_gate_sigmoid_mul = _gate_sigmoid_mul
    qwen2_moe.fused_gate_sigmoid_mul_add = _gate_sigmoid_mul_add
    minimax_m2.rms_sumsq_serial = _rms_sumsq
    minimax_m2.rms_apply_serial = _rms_apply


def sinks_backend(runner: Any) -> Any:
    """A TorchNativeAttnBackend that applies attention sinks (``sinks=`` per head, GPT-OSS): one extra
    logit per head in the softmax that takes probability mass and adds no value."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class SinksBackend(TorchNativeAttnBackend):
        def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, fb: Any,
                    sinks: torch.Tensor, decode: bool, save_kv_cache: bool) -> torch.Tensor:
            if save_kv_cache:
                where = KVWriteLoc(fb.out_cache_loc, self.swa_out_cache_loc)
                self.token_to_kv_pool.set_kv_buffer(layer, where, k, v)
            heads, kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
            keys = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            values = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
            q = q.view(-1, heads, layer.qk_head_dim)
            out = q.new_empty(q.shape[0], heads, layer.v_head_dim)
            window = layer.sliding_window_size
            start = 0
            for i in range(int(fb.batch_size)):
                kv_len = int(fb.seq_lens[i])
                q_len = 1 if decode else int(fb.extend_seq_lens[i])
                slots = self.req_to_token_pool.req_to_token[fb.req_pool_indices[i], :kv_len]
                key = keys[slots].float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
                value = values[slots].float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
                query = q[start : start + q_len].float().transpose(0, 1)
                scores = query @ key.transpose(1, 2) * layer.scaling  # [heads, q_len, kv_len]
                q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
                k_pos = torch.arange(kv_len)[None]
                allowed = k_pos <= q_pos
                if window is not None and window > -1:
                    allowed &= k_pos >= q_pos - window
                scores = scores.masked_fill(~allowed, float("-inf"))
                sink = sinks.float().view(heads, 1, 1).expand(heads, q_len, 1)
                probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
                out[start : start + q_len] = (probs @ value).transpose(0, 1).to(out.dtype)
                start += q_len
            return out.reshape(-1, heads * layer.v_head_dim)

        def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                           save_kv_cache: bool = True, sinks: Any = None, **kwargs: Any) -> Any:
            if sinks is None:
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            return self._attend(q, k, v, layer, forward_batch, sinks, False, save_kv_cache)

        def forward_decode(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                           save_kv_cache: bool = True, sinks: Any = None, **kwargs: Any) -> Any:
            if sinks is None:
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            return self._attend(q, k, v, layer, forward_batch, sinks, True, save_kv_cache)

    return SinksBackend(runner)

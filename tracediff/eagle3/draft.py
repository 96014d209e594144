"""The EAGLE-3 draft in plain torch, numerically the same as SpecForge's LlamaForCausalLMEagle3.

One midlayer: ``cat([input_layernorm(embed), hidden_norm(h)])`` -> attention (+ residual h) ->
post_attention_layernorm -> MLP (+ residual); ``norm`` -> ``lm_head`` gives draft logits, and the
pre-norm output is the hidden fed to the next depth. fc runs at depth 0 only. Where engines read
the config differently (``norm_output``, ``norm_before_fc``, ``norm_before_residual``, RoPE:
tracediff/eagle3/readings.py), the draft computes as its ``Numerics`` say.

Attention at depth d follows SpecForge's TTT: a query at row t sees the depth-0 keys of rows
<= t (causal) plus the keys of its own row at depths 1..d (its draft chain), with RoPE at
position + d. Serving's chain drafting is the same computation restricted to the last row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from tracediff.eagle3.config import DraftConfig
from tracediff.eagle3.readings import READINGS, SGLANG, Numerics
from tracediff.eagle3.vocab import DIRECT, OFFSET


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Embedding(nn.Embedding):
    """nn.Embedding left uninitialised on the meta device (shapes only: doctor's checks, the loader's
    before it allocates): torch's meta ``normal_`` imports torch._dynamo, which leaves a
    ``$TMPDIR/torchinductor_$USER`` directory behind. Initialised as torch does everywhere else."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, head_dim] for integer positions [B, T] (Llama default RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, None], emb.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


@dataclass
class DraftKV:
    """Keys/values the draft attends to: depth-0 keys of every row, and each later depth's keys."""

    k0: torch.Tensor | None = None  # [B, heads, S, head_dim]
    v0: torch.Tensor | None = None
    chain: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # [B, heads, T, hd]


class Attention(nn.Module):
    def __init__(self, config: DraftConfig, theta: float) -> None:
        super().__init__()
        hd, heads, kv = config.attention_head_dim, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.heads, self.kv_heads, self.theta = hd, heads, kv, theta
        self.q_proj = nn.Linear(2 * config.hidden_size, heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, kv * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, config.hidden_size, bias=False)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(self.heads // self.kv_heads, dim=1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: DraftKV, depth: int,
                visible: torch.Tensor) -> torch.Tensor:
        """``visible[t]``: how many depth-0 keys row t may see (its own index + 1 in a prefix)."""
        q = self._heads(self.q_proj(x), self.heads)
        k = self._heads(self.k_proj(x), self.kv_heads)
        v = self._heads(self.v_proj(x), self.kv_heads)
        cos, sin = rope_tables(positions + depth, self.head_dim, self.theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if depth == 0:
            cache.k0 = k if cache.k0 is None else torch.cat([cache.k0, k], dim=2)
            cache.v0 = v if cache.v0 is None else torch.cat([cache.v0, v], dim=2)
        else:
            cache.chain.append((k, v))
        assert cache.k0 is not None and cache.v0 is not None, "depth 0 runs first"
        k0, v0 = self._repeat(cache.k0), self._repeat(cache.v0)
        scale = math.sqrt(self.head_dim)
        scores = torch.matmul(q, k0.transpose(2, 3)) / scale
        hidden = torch.arange(k0.shape[2], device=k0.device)[None, :] >= visible[:, None]
        scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
        chain = [(self._repeat(ki), self._repeat(vi)) for ki, vi in cache.chain]
        if chain:
            diag = torch.stack([(q * ki).sum(-1) / scale for ki, _ in chain], dim=-1)
            scores = torch.cat([scores, diag], dim=-1)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights[..., : k0.shape[2]], v0)
        for i, (_, vi) in enumerate(chain):
            out = out + weights[..., k0.shape[2] + i, None] * vi
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, config: DraftConfig, theta: float, norm_before_residual: bool = False) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.norm_before_residual = norm_before_residual  # vLLM: the attention's residual is hidden_norm(h)
        self.hidden_norm = RMSNorm(config.hidden_size, eps)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(config, theta)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config)

    def forward(self, embed: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: DraftKV,
                depth: int, visible: torch.Tensor) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embed), normed], dim=-1)
        residual = normed if self.norm_before_residual else hidden
        hidden = residual + self.self_attn(x, positions, cache, depth, visible)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class DepthResult:
    """One draft depth: the canonical tensors it produced, as [B, T, ...] torch tensors."""

    embed: torch.Tensor
    hidden: torch.Tensor  # what this depth hands to the next (pre-norm, or normed where the engine says)
    logits: torch.Tensor
    fc_out: torch.Tensor | None = None


class Eagle3Draft(nn.Module):
    """Weights laid out with the SpecForge export keys, so a checkpoint loads by name. ``numerics``:
    how the engine being played computes this config (default: SGLang's reading of its norms and
    RoPE, which is SpecForge's too wherever ``norm_output`` and ``norm_before_fc`` are absent)."""

    d2t: torch.Tensor  # buffers, registered in __init__
    t2d: torch.Tensor

    def __init__(self, config: DraftConfig, embed_tokens: torch.Tensor | None = None,
                 numerics: Numerics | None = None) -> None:
        super().__init__()
        self.config = config
        self.numerics = READINGS[SGLANG].numerics(config) if numerics is None else numerics
        self.notes: tuple[str, ...] = ()  # how the loader completed the checkpoint (checkpoint.load_draft)
        h, k = config.hidden_size, config.num_aux
        self.embed_tokens = Embedding(config.vocab_size, h)
        if embed_tokens is not None:
            self.embed_tokens.weight.data.copy_(embed_tokens)
        self.input_norm = RMSNorm(k * config.target_hidden, config.rms_norm_eps) if config.norm_before_fc \
            else None
        self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden, config.rms_norm_eps) for _ in range(k)) \
            if config.fc_norm or self.numerics.fc_norm else None
        self.fc = nn.Linear(k * config.target_hidden, h, bias=False)
        self.midlayer = MidLayer(config, self.numerics.rope_theta, self.numerics.norm_before_residual)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))

    def project(self, fc_in: torch.Tensor, norms: bool = True) -> torch.Tensor:
        """fc_in [..., K*H] -> fc_out [..., Hd], with the input norms the engine applies for this
        config (``norms=False`` plays an engine that ignores norm_before_fc / fc_norm)."""
        if self.input_norm is not None and norms and self.numerics.norm_before_fc:
            fc_in = self.input_norm(fc_in)
        if self.fc_norm is not None and norms and self.numerics.fc_norm:
            chunks = fc_in.chunk(len(self.fc_norm), dim=-1)
            fc_in = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(fc_in)

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: DraftKV,
             depth: int, visible: torch.Tensor | None = None) -> DepthResult:
        """One depth over rows [B, T]: ``hidden`` is fc_out at depth 0, else the previous depth's."""
        embed = self.embed_tokens(input_ids).to(hidden.dtype)
        if visible is None:  # the rows are the last T rows of the prefix: row t sees rows <= t
            t = input_ids.shape[-1]
            prior = 0 if cache.k0 is None else cache.k0.shape[2]
            first = (prior + t if depth == 0 else prior) - t
            visible = first + torch.arange(1, t + 1, device=input_ids.device)
        out = self.midlayer(embed, hidden, positions, cache, depth, visible)
        normed = self.norm(out)
        numerics = self.numerics
        return DepthResult(embed=embed, hidden=normed if numerics.next_hidden_normed else out,
                           logits=self.lm_head(normed if numerics.logits_normed else out))

    def unroll(self, fc_in: torch.Tensor, input_ids: torch.Tensor, length: int,
               positions: torch.Tensor | None = None,
               fed: list[torch.Tensor] | None = None) -> list[DepthResult]:
        """SpecForge's TTT forward: fc once, then ``length`` depths, ids shifted left each depth.
        ``fed``: the ids to feed at each depth instead (as wide as ``input_ids``), e.g. the tokens a
        server's chain was fed: its own drafts, not the text."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t) if positions is None else positions
        fc_out = self.project(fc_in)
        hidden, ids, cache, results = fc_out, input_ids, DraftKV(), []
        for depth in range(length):
            if fed is not None and depth < len(fed):
                ids = fed[depth]
            result = self.step(ids, hidden, positions, cache, depth)
            results.append(result)
            hidden = result.hidden
            ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        results[0].fc_out = fc_out
        return results

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocab ids -> target vocab ids (d2t holds offsets)."""
        return draft_ids + self.d2t[draft_ids]


def to_target_fn(draft: Eagle3Draft, reading: str):
    """Draft ids -> target ids under a d2t reading (OFFSET: what d2t means; DIRECT: the misreading)."""
    if reading == OFFSET:
        return draft.to_target
    if reading == DIRECT:
        return lambda ids: draft.d2t[ids]
    raise ValueError(f"unknown d2t reading {reading!r}")

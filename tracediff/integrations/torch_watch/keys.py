"""Row keys of the modules ``--watch`` records, from what each root call carries.

Row keys, by what the root call carries (the contract's ``row_keys`` says which were used):
- ``input_ids`` (``tokens``): a request per batch row, kept across forwards that continue a KV
  cache; positions from ``position_ids``, ``cache_position`` or the attention mask, else counted;
  padding (mask 0) gets position -1. An output shaped like the ids is keyed row by row; one shaped
  like the call's ``logits_to_keep`` selection (``lm_head`` in ``generate``) by the kept tokens.
- no token ids (``step_position``: ``inputs_embeds``, or a program that is not an HF LM): the same
  requests and positions, and a placeholder token ``placeholder(step)`` = -1 - step: negative, so
  never a vocabulary id, and one per step, so that rows align by step and position alone (with
  ``--align step`` and with the default alignment by content alike) with another run of the same
  program, and never with a trace of real tokens. An output of a non-HF root is keyed by its shape:
  ``[B, T, ...]`` a request per batch row at positions 0..T-1, ``[N, ...]`` one request at
  positions 0..N-1.
Anything else (an output of other leading dims, 0-d and 1-d outputs of non-HF roots, calls outside
their root's forward) is a static record of the root's step; the step is the root's forward count.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracediff.record.plugin import RequestGate

NO_TOKEN = -1  # placeholder(0): the token id of rows of step 0 whose call carried no token ids


def placeholder(step: int) -> int:
    """The token id of rows of ``step`` whose call carried no token ids (module docstring)."""
    return NO_TOKEN - step


@dataclass
class OutputKeys:
    """``Recorder.log`` keys for one output; ``subset``: rows of only some of the call's tokens."""

    request: Any
    positions: Any
    token_ids: Any
    attention_mask: Any = None
    subset: bool = False


@dataclass
class Keys:
    """Row keys of one root call."""

    token_ids: Any  # [B, T] or [T] integer tensor; placeholder(step) throughout when the call had none
    positions: Any
    attention_mask: Any
    requests: list[str]
    keep: Any = None  # the call's logits_to_keep
    tokens_known: bool = True
    declared_to: Any = None  # the recorder this call's tokens were declared to

    def rows_for(self, y: Any) -> OutputKeys | None:
        """Keys of an output shaped like the ids, or like the ids ``logits_to_keep`` selects."""
        ids = self.token_ids
        if tuple(y.shape[: ids.dim()]) == tuple(ids.shape):
            return OutputKeys(self.requests, self.positions, ids, self.attention_mask)
        picked = kept_rows(self) if self.keep is not None else None
        if picked is None or tuple(y.shape[: picked.token_ids.dim()]) != tuple(picked.token_ids.shape):
            return None
        return picked

    def declare(self, rec: Any) -> None:
        """Declare the call's tokens, once per recorder: rows of a subset (the last token's logits)
        alone would leave the token table without the prompt their prefix needs."""
        if not self.tokens_known or self.declared_to is rec:
            return
        self.declared_to = rec
        length = self.token_ids.shape[-1]
        ids, positions = self.token_ids.reshape(-1, length), self.positions.reshape(-1, length)
        mask = None if self.attention_mask is None else self.attention_mask.reshape(-1, length)
        for b, request in enumerate(self.requests):
            real = positions[b] >= 0 if mask is None else (mask[b] != 0) & (positions[b] >= 0)
            at = positions[b][real]
            if len(at) and bool((at[1:] - at[:-1] == 1).all()):
                rec.request_tokens(request, ids[b][real], start=int(at[0]))


def kept_rows(keys: Keys) -> OutputKeys | None:
    """The keys of the tokens an HF ``logits_to_keep`` keeps: an int k > 0 the last k, a 1-D tensor
    these positions, a 2-D integer tensor these positions per batch row, a 2-D bool tensor the true
    ones (flattened)."""
    import torch

    keep, ids = keys.keep, keys.token_ids
    pick: Callable[[Any], Any]
    requests: Any = keys.requests
    if isinstance(keep, bool) or not isinstance(keep, (int, torch.Tensor)):
        return None
    if isinstance(keep, int):
        if not 0 < keep < ids.shape[-1]:
            return None
        pick = lambda t: t[..., -keep:]  # noqa: E731
    elif keep.dim() == 1 and keep.dtype not in (torch.bool,) and not keep.is_floating_point():
        pick = lambda t: t[..., keep.to(t.device)]  # noqa: E731
    elif keep.dim() == 2 and ids.dim() == 2 and keep.shape[0] == ids.shape[0]:
        if keep.dtype == torch.bool:
            if keep.shape != ids.shape:
                return None
            counts = keep.sum(1).tolist()
            requests = [r for r, n in zip(keys.requests, counts) for _ in range(n)]
            pick = lambda t: t[keep.to(t.device)]  # noqa: E731
        elif keep.is_floating_point():
            return None
        else:
            pick = lambda t: torch.take_along_dim(t, keep.to(t.device), dim=1)  # noqa: E731
    else:
        return None
    mask = keys.attention_mask
    return OutputKeys(requests, pick(keys.positions), pick(ids), None if mask is None else pick(mask),
                   subset=True)


class RootState:
    """One root module: its forward count, and per thread the requests its calls continue."""

    def __init__(self, gate: RequestGate, root: Any, prefix: str = "") -> None:
        self.step = -1  # the last forward started; outputs outside any call are static records of it
        self.gate = gate
        self.prefix = prefix  # request ids of a second root start r1, r2, ...: never another root's
        self.root = weakref.ref(root)
        self._steps = itertools.count()  # no lock: a child forked mid-call could inherit it held
        self._local = threading.local()  # .requests: the sequences this thread's calls continue

    def start(self) -> int:
        """The step of a call now starting: the root's forward count, one per call on any thread."""
        self.step = step = next(self._steps)
        return step

    def request_ids(self, step: int, batch: int, starts: bool) -> list[str]:
        """A new request per batch row when a sequence starts, the same ones when it continues."""
        requests = getattr(self._local, "requests", None)
        if starts or requests is None or len(requests) != batch:
            requests = self._local.requests = [f"{self.prefix}s{step}b{b}" for b in range(batch)]
        return requests

    def shape_rows(self, y: Any, step: int) -> OutputKeys | None:
        """Keys of an output of a call without token ids, from its shape (module docstring)."""
        import torch

        if y.dim() >= 3:
            batch, length = y.shape[0], y.shape[1]
            requests: Any = [f"{self.prefix}s{step}b{b}" for b in range(batch)]
            shape: tuple[int, ...] = (batch, length)
        elif y.dim() == 2:
            length = y.shape[0]
            requests, shape = f"{self.prefix}s{step}", (length,)
        else:
            return None
        ids = torch.full(shape, placeholder(step), dtype=torch.long)
        return OutputKeys(requests, torch.arange(length).expand(shape), ids)


@dataclass
class Call:
    """One root call in progress on one thread."""

    state: RootState
    step: int
    keys: Keys | None = None


def has_data(x: Any) -> bool:
    """A tensor whose values can be read: not a subclass (FakeTensor under torch.export or a memory
    estimate, FunctionalTensor, DTensor) and not on the meta device."""
    import torch

    return type(x) in (torch.Tensor, torch.nn.Parameter) and not x.is_meta


def row_keys(args: tuple, kwargs: dict, state: RootState, step: int) -> Keys | None:
    """Keys from an HF-style call: input_ids (else inputs_embeds, with placeholder tokens), position_ids /
    attention_mask / cache_position, and the KV cache (``past_key_values``, or ``cache`` in
    transformers 5) to tell a new sequence. Tensors without data are not read (``has_data``)."""
    import torch

    ids: Any = kwargs.get("input_ids")
    if ids is None and args:
        ids = args[0]
    embeds: Any = kwargs.get("inputs_embeds")
    tokens_known = has_data(ids) and not ids.dtype.is_floating_point and ids.dim() in (1, 2)
    if not tokens_known:
        if not (has_data(embeds) and embeds.is_floating_point() and embeds.dim() in (2, 3)):
            return None
        ids = torch.full(embeds.shape[:-1], placeholder(step), dtype=torch.long, device=embeds.device)
    length = ids.shape[-1]
    full_mask: Any = kwargs.get("attention_mask")
    if not has_data(full_mask) or full_mask.dim() != ids.dim():
        full_mask = None  # 4-D masks and the like say nothing per token
    cache: Any = kwargs.get("cache_position")
    cache = cache if has_data(cache) else None
    past = past_length(kwargs.get("past_key_values", kwargs.get("cache")), cache)
    positions: Any = kwargs.get("position_ids")
    if has_data(positions) and (positions.shape == ids.shape or positions.numel() == length):
        positions = positions.reshape(-1, length).expand(ids.shape) if ids.dim() == 2 \
            else positions.reshape(-1)
    elif full_mask is not None:
        positions = (full_mask.long().cumsum(-1) - 1)[..., -length:]
    elif cache is not None and cache.numel() == length:
        positions = cache.reshape(1, length).expand(ids.shape) if ids.dim() == 2 else cache
    else:
        positions = (torch.arange(length, device=ids.device) + past).expand(ids.shape)
    mask = None if full_mask is None else full_mask[..., -length:]
    requests = state.request_ids(step, ids.shape[0] if ids.dim() == 2 else 1, starts=past == 0)
    if state.gate.active and past == 0:
        rows = ids if ids.dim() == 2 else ids.reshape(1, -1)
        for b, request in enumerate(requests):
            real = rows[b] if mask is None else rows[b][mask.reshape(rows.shape)[b] != 0]
            state.gate.admit(request, real.tolist())
    keep = kwargs.get("logits_to_keep", kwargs.get("num_logits_to_keep"))
    return Keys(ids, positions, mask, requests, keep=keep, tokens_known=tokens_known)


def past_length(past: Any, cache: Any) -> int:
    """Tokens already in the KV cache: 0 when a call starts its sequences."""
    if cache is not None and hasattr(cache, "numel") and cache.numel():
        return int(cache.reshape(-1)[0])
    if past is not None and hasattr(past, "get_seq_length"):
        return int(past.get_seq_length())
    return 0


__all__ = ["NO_TOKEN", "Call", "Keys", "OutputKeys", "RootState", "has_data", "placeholder", "row_keys"]

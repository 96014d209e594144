"""``tracediff record --watch GLOB -- CMD``: record modules of any PyTorch program, by dotted name.

Once torch is imported, one global forward pre-hook sees every module call. The first call of a
module not seen before makes it a root: its whole subtree is marked seen, the globs are resolved
against its ``named_modules()`` (``*`` = one name part, ``**`` = any), and each match gets a forward
hook. Every later call of any module costs the hook one call and one dict lookup (measured: see
docs/INTEGRATIONS.md), plus torch's slower hooked call path while any global hook exists.

Names: in an HF causal LM (``LlamaForCausalLM`` etc., also inside a wrapper) the embedding is
``target.embed`` and decoder layer i ``target.layer.{i}`` (its output, docs/FORMAT.md); other
modules keep their dotted name. Row keys come from the root call's ``input_ids``: a request per batch
row, kept across forwards that continue a KV cache; positions from ``position_ids``, ``cache_position``
or the attention mask, else counted; padding (mask 0) gets position -1; the step is the root's
forward count. A call without token ids, or an output whose leading dims are not the ids' shape, is
recorded as a static record of its step.
"""

from __future__ import annotations

import logging
import re
import sys
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any

from tracediff.record.hooks import first_tensor
from tracediff.record.host import tag_of_tensor
from tracediff.record.launch import LaunchConfig, RecorderFactory, RequestGate, when_imported

logger = logging.getLogger("tracediff")


def at_startup(config: LaunchConfig, recorder: RecorderFactory) -> None:
    """Attach once torch is imported; nothing happens before."""
    if config.watch:
        watcher = Watcher(config, recorder)
        when_imported("torch", watcher.install)


def glob_regex(glob: str) -> re.Pattern[str]:
    """A dotted-name glob: ``*`` one part, ``**`` any number of parts, ``?`` one character."""
    parts = re.split(r"(\*\*|\*|\?)", glob)
    table = {"**": ".*", "*": "[^.]+", "?": "[^.]"}
    return re.compile("".join(table.get(p, re.escape(p)) for p in parts) + r"\Z")


@dataclass
class Keys:
    """Row keys of one root call."""

    token_ids: Any  # [B, T] or [T] integer tensor
    positions: Any
    attention_mask: Any
    requests: list[str]


class RootState:
    """One root module's forward count and the row keys of its current call."""

    def __init__(self, gate: RequestGate) -> None:
        self.step = -1
        self.keys: Keys | None = None
        self.requests: list[str] = []
        self.gate = gate

    def before(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.step += 1
        self.keys = row_keys(args, kwargs, self)

    def after(self, module: Any, args: Any, result: Any) -> None:
        self.keys = None

    def request_ids(self, batch: int, starts: bool) -> list[str]:
        """A new request per batch row when a sequence starts, the same ones when it continues."""
        if starts or len(self.requests) != batch:
            self.requests = [f"s{self.step}b{b}" for b in range(batch)]
        return self.requests


def row_keys(args: tuple, kwargs: dict, state: RootState) -> Keys | None:
    """Keys from an HF-style call: input_ids, position_ids / attention_mask / cache_position, and the
    KV cache (``past_key_values``, or ``cache`` in transformers 5) to tell a new sequence."""
    import torch

    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dim() not in (1, 2):
        return None
    length = ids.shape[-1]
    full_mask = kwargs.get("attention_mask")
    if not isinstance(full_mask, torch.Tensor) or full_mask.dim() != ids.dim():
        full_mask = None  # 4-D masks and the like say nothing per token
    cache = kwargs.get("cache_position")
    past = past_length(kwargs.get("past_key_values", kwargs.get("cache")), cache)
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor) and (positions.shape == ids.shape or positions.numel() == length):
        positions = positions.reshape(-1, length).expand(ids.shape) if ids.dim() == 2 \
            else positions.reshape(-1)
    elif full_mask is not None:
        positions = (full_mask.long().cumsum(-1) - 1)[..., -length:]
    elif isinstance(cache, torch.Tensor) and cache.numel() == length:
        positions = cache.reshape(1, length).expand(ids.shape) if ids.dim() == 2 else cache
    else:
        positions = (torch.arange(length) + past).expand(ids.shape)
    mask = None if full_mask is None else full_mask[..., -length:]
    requests = state.request_ids(ids.shape[0] if ids.dim() == 2 else 1, starts=past == 0)
    if state.gate.active and past == 0:
        rows = ids if ids.dim() == 2 else ids.reshape(1, -1)
        for b, request in enumerate(requests):
            real = rows[b] if mask is None else rows[b][mask.reshape(rows.shape)[b] != 0]
            state.gate.admit(request, real.tolist())
    return Keys(ids, positions, mask, requests)


def past_length(past: Any, cache: Any) -> int:
    """Tokens already in the KV cache: 0 when a call starts its sequences."""
    if cache is not None and hasattr(cache, "numel") and cache.numel():
        return int(cache.reshape(-1)[0])
    if past is not None and hasattr(past, "get_seq_length"):
        return int(past.get_seq_length())
    return 0


def causal_lm_names(root: Any) -> dict[str, str]:
    """Canonical names of an HF causal LM's embedding and decoder layers, by dotted module name."""
    modules = dict(root.named_modules())
    for prefix, module in modules.items():
        if not type(module).__name__.endswith("ForCausalLM"):
            continue
        base = ".".join(p for p in (prefix, getattr(module, "base_model_prefix", "model")) if p)
        layers = modules.get(f"{base}.layers")
        if layers is None or f"{base}.embed_tokens" not in modules:
            continue
        names = {f"{base}.embed_tokens": "target.embed"}
        names.update({f"{base}.layers.{i}": f"target.layer.{i}" for i in range(len(layers))})
        return names
    return {}


def recordable(x: Any) -> bool:
    try:
        tag_of_tensor(x)
    except ValueError:
        return False
    return True


class Watcher:
    """The global hook and the roots it found."""

    def __init__(self, config: LaunchConfig, factory: RecorderFactory) -> None:
        self.globs = config.watch
        self.patterns = [glob_regex(g) for g in config.watch]
        self.factory = factory
        self.gate = RequestGate.of(config)
        self.seen: dict[int, weakref.ref] = {}
        self.handle: Any = None
        self.failed = False

    def install(self, torch_module: Any) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook

        self.handle = register_module_forward_pre_hook(self.on_call)

    def on_call(self, module: Any, args: tuple) -> None:
        if id(module) in self.seen:  # the whole per-call cost for modules already seen
            return
        try:
            self.attach(module, args, call_kwargs(module))
        except Exception as exc:
            self.fail(f"attaching to {type(module).__name__}", exc)

    def remember(self, module: Any) -> None:
        key = id(module)

        def forget(_ref: weakref.ref) -> None:
            self.seen.pop(key, None)

        self.seen[key] = weakref.ref(module, forget)

    def attach(self, root: Any, args: tuple, kwargs: dict) -> None:
        for _, module in root.named_modules():
            self.remember(module)
        matched = [(name, m) for name, m in root.named_modules() if any(p.match(name) for p in self.patterns)]
        if not matched:
            return
        canonical = causal_lm_names(root)
        state = RootState(self.gate)
        for name, module in matched:
            module.register_forward_hook(self.output_hook(canonical.get(name, name), state))
        root.register_forward_pre_hook(state.before, with_kwargs=True)
        root.register_forward_hook(state.after)
        state.before(root, args, kwargs)  # this call's own hook list was fixed before we attached

    def output_hook(self, label: str, state: RootState) -> Any:
        def hook(module: Any, args: Any, result: Any) -> None:
            if self.failed:
                return
            try:
                self.record(label, first_tensor(result), state)
            except Exception as exc:
                self.fail(f"recording {label}", exc)

        return hook

    def record(self, label: str, y: Any, state: RootState) -> None:
        if y is None or not recordable(y):
            return
        keys = state.keys
        if keys is not None and self.gate.active and not any(r in self.gate.admitted for r in keys.requests):
            return
        rec = self.factory(source="watch", meta={"watch": list(self.globs)})
        if not rec.active:
            return
        if self.gate.active:
            rec.filter.requests = frozenset(self.gate.admitted)
        if keys is not None and tuple(y.shape[: keys.token_ids.dim()]) == tuple(keys.token_ids.shape):
            rec.log(label, y, step=state.step, request=keys.requests, positions=keys.positions,
                    token_ids=keys.token_ids, attention_mask=keys.attention_mask)
        else:
            rec.log_static(label, y, step=state.step)

    def fail(self, where: str, exc: Exception) -> None:
        """Log once and stop watching; the host keeps running."""
        if not self.failed:
            self.failed = True
            logger.warning("tracediff: --watch stopped (%s: %s: %s); the program keeps running", where,
                           type(exc).__name__, exc)
        if self.handle is not None:
            self.handle.remove()


def call_kwargs(module: Any) -> dict:
    """The keyword arguments of the call now entering ``module``. Global pre-hooks get none, and a
    root's own hooks attach too late for its first call: read them from torch's calling frame."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            break
        local = frame.f_locals
        if local.get("self") is module and isinstance(local.get("kwargs"), dict):
            return dict(local["kwargs"])
        frame = frame.f_back
    return {}


__all__ = ["Watcher", "at_startup", "causal_lm_names", "glob_regex", "row_keys"]

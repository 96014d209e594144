"""``tracediff record --watch GLOB -- CMD``: record modules of any PyTorch program, by dotted name.

Once torch is imported, one global forward pre-hook sees every module call. The first call of a
module not seen before makes it a root: its whole subtree is marked seen, the globs are resolved
against its submodules' ``named_modules()`` names (``*`` = one name part, ``**`` = any; the root
itself has no name and is never watched), and each match gets a forward hook (a module watched under
an earlier root, e.g. called on its own first, moves to the enclosing one). Every later call of any
module costs the hook one call and one dict lookup (measured: see docs/INTEGRATIONS.md), plus
torch's slower hooked call path while any global hook exists.

Names: in an HF causal LM (``LlamaForCausalLM`` etc., also inside a wrapper) the embedding is
``target.embed`` and decoder layer i ``target.layer.{i}`` (its output, docs/FORMAT.md); other
modules keep their dotted name. The contract's ``target_model`` names the HF model (its config's
``name_or_path``, else its architecture and a hash of its config).

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

import atexit
import hashlib
import json
import logging
import re
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from tracediff.record.filters import RecordFilter
from tracediff.record.hooks import first_tensor
from tracediff.record.host import tag_of_tensor
from tracediff.record.launch import LaunchConfig, RecorderFactory, RequestGate, when_imported

logger = logging.getLogger("tracediff")

NO_TOKEN = -1  # placeholder(0): the token id of rows of step 0 whose call carried no token ids
# config keys that say how a model runs, not which model it is
NOT_IDENTITY = {"transformers_version", "dtype", "torch_dtype", "architectures", "use_cache", "return_dict",
                "output_hidden_states", "output_attentions", "attn_implementation"}


def placeholder(step: int) -> int:
    """The token id of rows of ``step`` whose call carried no token ids (module docstring)."""
    return NO_TOKEN - step


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
class Rows:
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

    def rows_for(self, y: Any) -> Rows | None:
        """Keys of an output shaped like the ids, or like the ids ``logits_to_keep`` selects."""
        ids = self.token_ids
        if tuple(y.shape[: ids.dim()]) == tuple(ids.shape):
            return Rows(self.requests, self.positions, ids, self.attention_mask)
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


def kept_rows(keys: Keys) -> Rows | None:
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
    return Rows(requests, pick(keys.positions), pick(ids), None if mask is None else pick(mask), subset=True)


class RootState:
    """One root module's forward count and the row keys of its current call."""

    def __init__(self, gate: RequestGate, prefix: str = "") -> None:
        self.step = -1
        self.keys: Keys | None = None
        self.inside = False
        self.requests: list[str] = []
        self.gate = gate
        self.prefix = prefix  # request ids of a second root start r1, r2, ...: never another root's

    def before(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.step += 1
        self.inside = True
        self.keys = row_keys(args, kwargs, self)

    def after(self, module: Any, args: Any, result: Any) -> None:
        self.keys = None
        self.inside = False

    def request_ids(self, batch: int, starts: bool) -> list[str]:
        """A new request per batch row when a sequence starts, the same ones when it continues."""
        if starts or len(self.requests) != batch:
            self.requests = [f"{self.prefix}s{self.step}b{b}" for b in range(batch)]
        return self.requests

    def shape_rows(self, y: Any) -> Rows | None:
        """Keys of an output of a call without token ids, from its shape (module docstring)."""
        import torch

        if y.dim() >= 3:
            batch, length = y.shape[0], y.shape[1]
            requests: Any = [f"{self.prefix}s{self.step}b{b}" for b in range(batch)]
            shape: tuple[int, ...] = (batch, length)
        elif y.dim() == 2:
            length = y.shape[0]
            requests, shape = f"{self.prefix}s{self.step}", (length,)
        else:
            return None
        ids = torch.full(shape, placeholder(self.step), dtype=torch.long)
        return Rows(requests, torch.arange(length).expand(shape), ids)


def row_keys(args: tuple, kwargs: dict, state: RootState) -> Keys | None:
    """Keys from an HF-style call: input_ids (else inputs_embeds, with placeholder tokens), position_ids /
    attention_mask / cache_position, and the KV cache (``past_key_values``, or ``cache`` in
    transformers 5) to tell a new sequence."""
    import torch

    ids: Any = kwargs.get("input_ids")
    if ids is None and args:
        ids = args[0]
    embeds = kwargs.get("inputs_embeds")
    tokens_known = isinstance(ids, torch.Tensor) and not ids.dtype.is_floating_point and ids.dim() in (1, 2)
    if not tokens_known:
        if not (isinstance(embeds, torch.Tensor) and embeds.is_floating_point() and embeds.dim() in (2, 3)):
            return None
        ids = torch.full(embeds.shape[:-1], placeholder(state.step), dtype=torch.long, device=embeds.device)
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
        positions = (torch.arange(length, device=ids.device) + past).expand(ids.shape)
    mask = None if full_mask is None else full_mask[..., -length:]
    requests = state.request_ids(ids.shape[0] if ids.dim() == 2 else 1, starts=past == 0)
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


def causal_lm(root: Any) -> tuple[Any, dict[str, str]] | None:
    """The HF causal LM in ``root`` and the canonical names of its embedding and decoder layers,
    by dotted module name; None when there is none."""
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
        return module, names
    return None


def causal_lm_names(root: Any) -> dict[str, str]:
    """Canonical names of an HF causal LM's embedding and decoder layers, by dotted module name."""
    found = causal_lm(root)
    return found[1] if found else {}


def model_identity(model: Any) -> str | None:
    """The contract's ``target_model``: the config's ``name_or_path`` when set, else the architecture
    and a short hash of the config (equal for other weights of one model, not for another model)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    name = getattr(config, "name_or_path", "") or ""
    if name:
        return str(name)
    values = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in NOT_IDENTITY}
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()
    return f"{type(model).__name__}-{digest[:12]}"


def recordable(x: Any) -> bool:
    try:
        tag_of_tensor(x)
    except ValueError:
        return False
    return True


def watchable(name: str) -> bool:
    """A name a tensor can be recorded under: not the root's empty name, not the format's ``__``."""
    return bool(name) and not name.startswith("__")


class Watcher:
    """The global hook and the roots it found."""

    def __init__(self, config: LaunchConfig, factory: RecorderFactory) -> None:
        self.globs = config.watch
        self.patterns = [glob_regex(g) for g in config.watch]
        self.factory = factory
        self.gate = RequestGate.of(config)
        self.names = RecordFilter.build(list(config.names) or None, list(config.exclude) or None)
        self.filters = {"names": " ".join([*(f"--names {g}" for g in config.names),
                                           *(f"--exclude {g}" for g in config.exclude)]),
                        "requests": " ".join(filter(None, (
                            f"--requests {config.requests}" if config.requests is not None else "",
                            "--match-prefix " + ",".join(map(str, config.match_prefix))
                            if config.match_prefix is not None else "")))}
        self.seen: dict[int, weakref.ref] = {}
        self.hooks: dict[int, Any] = {}  # id(module) -> its output hook's handle
        self.root_hooks: list[Any] = []
        self.roots = 0
        self.contract: dict[str, Any] = {}  # target_model, row_keys: what each recorder is told
        self.key_kinds: set[str] = set()
        self.told: tuple[Any, dict] | None = None  # the recorder last told, and what
        self.left_out: set[str] = set()  # the filters that left out an output
        self.recorded = False
        self.handle: Any = None
        self.failed = False

    def install(self, torch_module: Any) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook

        self.handle = register_module_forward_pre_hook(self.on_call)
        atexit.register(self.report_left_out)

    def remove(self) -> None:
        """Remove every hook (the global one, the roots', the watched modules')."""
        for handle in [self.handle, *self.root_hooks, *self.hooks.values()]:
            if handle is not None:
                handle.remove()
        self.handle, self.root_hooks, self.hooks = None, [], {}
        atexit.unregister(self.report_left_out)

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
        matched = [(name, m) for name, m in root.named_modules()
                   if watchable(name) and any(p.match(name) for p in self.patterns)]
        if not matched:
            return
        lm = causal_lm(root)
        canonical = lm[1] if lm else {}
        if lm and "target_model" not in self.contract and (identity := model_identity(lm[0])):
            self.contract["target_model"] = identity
        state = RootState(self.gate, prefix=f"r{self.roots}" if self.roots else "")
        self.roots += 1
        for name, module in matched:
            earlier = self.hooks.pop(id(module), None)
            if earlier is not None:  # watched under a root it belongs to: the enclosing model's keys win
                earlier.remove()
            self.hooks[id(module)] = module.register_forward_hook(self.output_hook(canonical.get(name, name),
                                                                                   state))
        self.root_hooks += [root.register_forward_pre_hook(state.before, with_kwargs=True),
                            root.register_forward_hook(state.after, always_call=True)]
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
        if not self.names.keep_name(label):  # before the recorder opens: a process that keeps nothing
            self.left_out.add("names")      # writes nothing
            return
        keys = state.keys
        rows = keys.rows_for(y) if keys is not None else state.shape_rows(y) if state.inside else None
        if rows is not None and self.gate.active:
            requests = [rows.request] if isinstance(rows.request, str) else list(rows.request)
            if not any([self.gate.admit(r) for r in dict.fromkeys(requests)]):
                self.left_out.add("requests")
                return
        rec = self.factory(source="watch", meta={"watch": list(self.globs)})
        if not rec.active:
            return
        self.recorded = True
        if rows is not None:
            self.key_kinds.add("tokens" if keys is not None and keys.tokens_known else "step_position")
        self.tell(rec)
        if self.gate.active:
            rec.filter.requests = frozenset(self.gate.admitted)
        if rows is None:
            rec.log_static(label, y, step=state.step)
            return
        if rows.subset and keys is not None:
            keys.declare(rec)
        rec.log(label, y, step=state.step, request=rows.request, positions=rows.positions,
                token_ids=rows.token_ids, attention_mask=rows.attention_mask)

    def tell(self, rec: Any) -> None:
        """Put the model's identity and the kind of row keys used into the recorder's contract."""
        if self.key_kinds:
            self.contract["row_keys"] = next(iter(self.key_kinds)) if len(self.key_kinds) == 1 else "mixed"
        if self.told is not None and self.told[0] is rec and self.told[1] == self.contract:
            return
        rec.update_contract(**self.contract)
        self.told = (rec, dict(self.contract))

    def report_left_out(self) -> None:
        """At exit: one line when watched modules ran but the filters left out all they produced."""
        if self.recorded or not self.left_out:
            return
        named = " and ".join(self.filters[f] for f in ("names", "requests") if f in self.left_out)
        logger.warning("tracediff: --watch recorded nothing in this process: its watched modules ran, but %s "
                       "left out everything they produced", named)

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


__all__ = ["NO_TOKEN", "Watcher", "at_startup", "causal_lm", "causal_lm_names", "glob_regex",
           "model_identity", "placeholder", "row_keys"]

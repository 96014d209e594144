"""``tracediff record --watch GLOB -- CMD``: record modules of any PyTorch program, by dotted name.

Once torch is imported, two global hooks (a forward pre-hook, and a forward hook torch calls even
when the forward raises) see every module call. The first call of a module not seen before makes it
a root: its whole subtree is marked seen, the globs are resolved against its submodules'
``named_modules()`` names (``*`` = one name part, ``**`` = any; the root itself has no name and is
never watched), and each match is watched (a module watched under an earlier root, e.g. called on
its own first, moves to the enclosing one). A module first called inside a root's forward that is
part of that root (a layer appended, an adapter injected after its first forward) is resolved under
the root's names. Every later call of any module costs each hook one call and one dict lookup
(measured: see docs/INTEGRATIONS.md), plus torch's slower hooked call path while any global hook
exists; a root's call also reads its keyword arguments from torch's calling frame.

Host safety. Nothing is stored on the modules, so a watched model pickles (``torch.save(model)``),
deep-copies and scripts (``torch.jit.script``) as it would unwatched. Nothing the watcher does raises
into the program: its first failure is logged once and stops the watching (the hooks go at the next
module call). Code torch.compile or torch.export traces sees the hooks as no-ops (traced, a hook would
break the graph, or fail it under ``fullgraph=True``), so what runs compiled is not recorded (a
compiled root says so once). Tensors without data (FakeTensor and other tensor subclasses) are not
recorded, and not read for row keys; meta tensors are counted as dropped by the recorder. Threads
calling one model keep their own row keys, and a root called inside its own forward keeps the outer
call's keys after the inner one returns.

Names: in an HF causal LM (``LlamaForCausalLM`` etc., also inside a wrapper) the embedding is
``target.embed`` and decoder layer i ``target.layer.{i}`` (its output, docs/FORMAT.md); other
modules keep their dotted name. The contract's ``target_model`` names the HF model (its config's
``name_or_path``, else its architecture and a hash of its config); ``target_config`` and
``target_embedding_sha256`` identify it (tracediff/integrations/target_summary.py).

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
import itertools
import json
import logging
import os
import re
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from tracediff.errors import did_you_mean
from tracediff.integrations.target_summary import target_identity
from tracediff.record.filters import RecordFilter
from tracediff.record.hooks import first_tensor
from tracediff.record.host import tag_of_tensor
from tracediff.record.launch import LaunchConfig, RecorderFactory, RequestGate, when_imported

logger = logging.getLogger("tracediff")
NAMES_SHOWN = 8  # module names a glob that matched none of them lists

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

    def shape_rows(self, y: Any, step: int) -> Rows | None:
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
        return Rows(requests, torch.arange(length).expand(shape), ids)


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
    """A tensor of a dtype a trace holds, not a subclass (a meta tensor is the recorder's to count)."""
    import torch

    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        tag_of_tensor(x)
    except ValueError:
        return False
    return True


def watchable(name: str) -> bool:
    """A name a tensor can be recorded under: not the root's empty name, not the format's ``__``."""
    return bool(name) and not name.startswith("__")


class Seen:
    """What the watcher knows of a module it has seen called (or seen in a root's subtree)."""

    __slots__ = ("root", "label", "owner")

    def __init__(self) -> None:
        self.root: RootState | None = None  # set when the module is a root
        self.label: str | None = None  # set when the module is watched: its name in the trace ...
        self.owner: RootState | None = None  # ... and the root whose calls key its outputs


class Watcher:
    """The global hooks and the roots they found."""

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
        self.seen: dict[int, Seen] = {}  # id(module) -> what it is; the one lookup of each hook call
        self.refs: dict[int, weakref.ref] = {}  # id(module) -> a reference that forgets it when it dies
        self.roots = 0
        self.contract: dict[str, Any] = {}  # target_model, row_keys: what each recorder is told
        self.key_kinds: set[str] = set()
        self.told: tuple[Any, dict] | None = None  # the recorder last told, and what
        self.left_out: set[str] = set()  # the filters that left out an output
        self.module_names: dict[str, None] = {}  # every watchable name in the roots met, in their order
        self.matched_globs: set[str] = set()  # the --watch globs that matched one of them
        self.recorded = False
        self.handles: list[Any] = []
        self.failed = False
        self.warned_compiled = False
        self.compiling: Callable[[], bool] = lambda: False
        self.local = threading.local()  # .calls: the root calls in progress on this thread, innermost last
        self.lock = threading.RLock()  # attaching (the slow path) is one thread at a time
        os.register_at_fork(after_in_child=self._unlock)

    def _unlock(self) -> None:
        """A child forked while another thread attached must not inherit the held lock."""
        self.lock = threading.RLock()

    def install(self, torch_module: Any) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        compiler = getattr(torch_module, "compiler", None)
        self.compiling = getattr(compiler, "is_compiling", None) or self.compiling
        self.handles = [register_module_forward_pre_hook(self.on_call),
                        register_module_forward_hook(self.on_return, always_call=True)]
        atexit.register(self.report_left_out)
        atexit.register(self.report_unmatched)

    @property
    def handle(self) -> Watcher | None:
        """The hooks as one handle while installed: ``handle.remove()`` removes them all."""
        return self if self.handles else None

    def remove(self) -> None:
        """Remove the hooks (from a pre-hook or outside any module call: torch iterates the global
        forward hooks themselves while a failed forward unwinds)."""
        with self.lock:
            handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()
        atexit.unregister(self.report_left_out)
        atexit.unregister(self.report_unmatched)

    def on_call(self, module: Any, args: tuple) -> None:
        if self.compiling():  # traced by torch.compile / torch.export: a no-op in the graph
            return
        entry = self.seen.get(id(module))  # the whole per-call cost for modules already seen
        if entry is None:
            self.first_call(module, args)
        elif entry.root is not None:
            self.enter(entry.root, module, args)
        elif self.failed:
            self.remove()

    def on_return(self, module: Any, args: Any, result: Any) -> None:
        if self.compiling():
            return
        entry = self.seen.get(id(module))
        if entry is None:
            return
        if entry.label is not None and entry.owner is not None and not self.failed:
            try:
                self.record(entry.label, first_tensor(result), entry.owner, self.current(entry.owner))
            except Exception as exc:
                self.fail(f"recording {entry.label}", exc)
        if entry.root is not None:
            self.leave(entry.root)

    def calls(self) -> list[Call]:
        calls = getattr(self.local, "calls", None)
        if calls is None:
            calls = self.local.calls = []
        return calls

    def current(self, state: RootState) -> Call | None:
        """The innermost call of this root in progress on this thread."""
        for call in reversed(self.calls()):
            if call.state is state:
                return call
        return None

    def enter(self, state: RootState, module: Any, args: tuple) -> None:
        if self.failed:
            self.remove()
            return
        call = Call(state, state.start())
        self.calls().append(call)  # before the keys: the call ends (leave) even if they fail
        try:
            call.keys = row_keys(args, call_kwargs(module), state, call.step)
        except Exception as exc:
            self.fail(f"reading the row keys of a {type(module).__name__} call", exc)

    def leave(self, state: RootState) -> None:
        """End the innermost call of this root on this thread, and any call above it that a raising
        forward left behind."""
        calls = self.calls()
        for i in range(len(calls) - 1, -1, -1):
            if calls[i].state is state:
                del calls[i:]
                return

    def first_call(self, module: Any, args: tuple) -> None:
        if self.failed:
            self.remove()
            return
        try:
            with self.lock:
                if id(module) not in self.seen:  # else another thread attached it meanwhile
                    self.attach(module)
            entry = self.seen.get(id(module))
            if entry is not None and entry.root is not None:
                self.enter(entry.root, module, args)  # its first call is a call like any other
        except Exception as exc:
            self.fail(f"attaching to {type(module).__name__}", exc)

    def remember(self, module: Any) -> Seen:
        key = id(module)
        entry = self.seen.get(key)
        if entry is None:
            def forget(_ref: weakref.ref) -> None:
                self.seen.pop(key, None)
                self.refs.pop(key, None)

            entry = self.seen[key] = Seen()
            self.refs[key] = weakref.ref(module, forget)
        return entry

    def attach(self, module: Any) -> None:
        """A module called for the first time: a part of a root in progress on this thread (added to
        it after its first forward), a compiled module, or a new root."""
        for call in reversed(self.calls()):
            root = call.state.root()
            if root is not None and any(m is module for m in root.modules()):
                self.resolve(root, call.state)
                return
        if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
            self.remember(module)  # its own modules stay unseen: a later eager call of them is recorded
            if not self.warned_compiled:
                self.warned_compiled = True
                logger.warning("tracediff: --watch records nothing of what runs under torch.compile "
                               "(compiled code calls no Python hooks); run with TORCH_COMPILE_DISABLE=1 to "
                               "record it")
            return
        state = RootState(self.gate, module, prefix=f"r{self.roots}" if self.roots else "")
        if self.resolve(module, state):
            self.roots += 1
            self.seen[id(module)].root = state

    def resolve(self, root: Any, state: RootState) -> bool:
        """Mark the root's subtree seen and watch its modules whose names match; whether any did."""
        modules = list(root.named_modules())
        for _, module in modules:
            self.remember(module)
        self.note_names([name for name, _ in modules if watchable(name)])
        matched = [(name, m) for name, m in modules
                   if watchable(name) and any(p.match(name) for p in self.patterns)]
        if not matched:
            return False
        lm = causal_lm(root)
        canonical = lm[1] if lm else {}
        if lm and "target_model" not in self.contract and (identity := model_identity(lm[0])):
            self.contract.update(target_identity(lm[0]), target_model=identity)
        for name, module in matched:  # watched under an earlier root it belongs to: the enclosing keys win
            entry = self.seen[id(module)]
            entry.label, entry.owner = canonical.get(name, name), state
        return True

    def note_names(self, names: list[str]) -> None:
        """Keep a root's module names, and which globs match one, for ``report_unmatched``."""
        self.module_names.update(dict.fromkeys(names))
        self.matched_globs.update(glob for glob, pattern in zip(self.globs, self.patterns)
                                  if glob not in self.matched_globs and any(map(pattern.match, names)))

    def record(self, label: str, y: Any, state: RootState, call: Call | None) -> None:
        if y is None or not recordable(y):
            return
        if not self.names.keep_name(label):  # before the recorder opens: a process that keeps nothing
            self.left_out.add("names")      # writes nothing
            return
        keys = call.keys if call is not None else None
        rows = keys.rows_for(y) if keys is not None else state.shape_rows(y, call.step) if call is not None \
            else None
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
        step = call.step if call is not None else state.step
        if rows is None:
            rec.log_static(label, y, step=step)
            return
        if rows.subset and keys is not None:
            keys.declare(rec)
        rec.log(label, y, step=step, request=rows.request, positions=rows.positions,
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

    def report_unmatched(self) -> None:
        """At exit: one line per --watch glob that matched no module of the models that ran, naming
        their first module names (shallowest first) and how many, and the closest to the glob."""
        names = sorted(self.module_names, key=lambda n: n.count("."))  # stable: in order within a depth
        for glob in self.globs:
            if glob in self.matched_globs or not names:
                continue
            more = f", ... ({len(names)} in all)" if len(names) > NAMES_SHOWN else ""
            hint = did_you_mean(glob, names)
            logger.warning("tracediff: --watch %r matched no module of the models that ran: %s%s%s", glob,
                           ", ".join(names[:NAMES_SHOWN]), more, f"; {hint}" if hint else "")

    def fail(self, where: str, exc: Exception) -> None:
        """Log once and stop watching; the host keeps running. The hooks are removed at the next
        module call (a pre-hook may remove them; a forward hook may be running inside torch's loop
        over them)."""
        if not self.failed:
            self.failed = True
            logger.warning("tracediff: --watch stopped (%s: %s: %s); the program keeps running", where,
                           type(exc).__name__, exc)


def call_kwargs(module: Any) -> dict:
    """The keyword arguments of the call now entering ``module``: global pre-hooks get none, so they
    are read from torch's calling frame (the first one up the stack whose ``self`` is the module)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        local = frame.f_locals
        if local.get("self") is module and isinstance(local.get("kwargs"), dict):
            return dict(local["kwargs"])
        frame = frame.f_back
    return {}


__all__ = ["NO_TOKEN", "Watcher", "at_startup", "causal_lm", "causal_lm_names", "glob_regex",
           "model_identity", "placeholder", "row_keys"]

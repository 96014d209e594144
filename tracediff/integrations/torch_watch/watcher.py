"""The ``--watch`` watcher: records modules of any PyTorch program, by dotted name, through two
global forward hooks.

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

Names: ``names.py``. Row keys: ``keys.py``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from tracediff.errors import did_you_mean
from tracediff.integrations.target_summary import target_identity
from tracediff.integrations.torch_watch.keys import Call, RootState, row_keys
from tracediff.integrations.torch_watch.names import (
    causal_lm,
    glob_regex,
    model_identity,
    recordable,
    watchable,
)
from tracediff.record.filters import RecordFilter
from tracediff.record.hooks import first_tensor
from tracediff.record.plugin import LaunchConfig, RecorderFactory, RequestGate

logger = logging.getLogger("tracediff")
NAMES_SHOWN = 8  # module names a glob that matched none of them lists


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
            try:  # the process's recorder, where it made one: the trace says who stopped and why
                if self.recorded:
                        self.factory(source="watch", meta={"watch": list(self.globs)}).stop_producer(
                        "watch", f"{where}: {type(exc).__name__}: {exc}")
            except Exception:
                pass


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


__all__ = ["Watcher", "call_kwargs"]

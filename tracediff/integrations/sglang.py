"""Recording SGLang's EAGLE-3 serving path (target, draft extend, draft chain) under canonical names.

``install(recorder, target=..., draft=..., worker=...)`` attaches to SGLang's own objects; the
scheduler side calls ``batch_context(reqs)`` once per batch so that every row is keyed by content:
(request, position, the request's token at that position), docs/FORMAT.md. The same function is
called by the launcher plugin's scheduler patch and by the CPU harness (sglang_cpu.py).

A request is one ``Req`` object: it keeps its name from its first batch to its last. The name is
its ``rid``; clients may reuse a rid once a request finished, so a later ``Req`` under a rid already
named is ``rid#2``, then ``rid#3`` (the first free one): two requests never share a trace name, and
the same sequence of requests names the same way in every run.

Where each tensor comes from (SGLang 0.5.23):

- ``target.layer.{i}``: SGLang defers the residual add (a layer's forward returns the MLP branch), so
  the stream is read where SGLang itself reads it for aux capture: the residual the attention boundary
  wrote on entering layer i+1 (``forward_batch.residual_stream.residual`` as ``self_attn`` starts),
  and for the last layer the residual the final norm returns. Read only: nothing the model computes
  or packs for the draft changes.
- ``target.aux``: ``LogitsProcessorOutput.hidden_states`` of the target (what the draft is handed).
- draft depth 0 (draft extend) and depth d >= 1 (``EagleDraftWorker.draft_forward``, topk = 1): a
  depth-0 row at position t is fed x[t+1] and keyed (rid, t, x[t]); chain rows carry the key of the
  request's last depth-0 row (its anchor); ``draft.input_ids`` holds what was fed.
- ``draft.token_target``: the target-vocab tokens ``draft_forward`` returns (``hot_token_id`` applied
  by SGLang), one column per depth.

Rows whose token the scheduler does not know yet (verify rows of draft tokens) are left out: keying a
speculative token would teach the trace a token the request may never have. Hooks never raise into
SGLang: a failure is logged once and recording stops while the server keeps running.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tracediff.record.host import is_torch_tensor
from tracediff.record.launch import LaunchConfig, RecorderFactory, RequestGate, when_imported

if TYPE_CHECKING:  # the plugin is imported in every process of a launch: torch loads only when SGLang runs
    from tracediff.record.recorder import Recorder

logger = logging.getLogger("tracediff")

SUPPORTED_SGLANG = ("0.5.23",)
SPEC_ARGS = {"algorithm": "speculative_algorithm", "num_steps": "speculative_num_steps",
             "topk": "speculative_eagle_topk", "num_draft_tokens": "speculative_num_draft_tokens"}
SERVER_ARGS = ("attention_backend", "dtype", "device", "tp_size", "page_size", "disable_cuda_graph",
               "disable_overlap_schedule", "speculative_draft_window_size")
IDLE_BATCHES = 4096  # a Req held strongly (no weak reference) is forgotten after this many idle batches


class SglangInternalsError(RuntimeError):
    """An SGLang internal the recording reads is missing or changed: recording would give wrong
    tensors, so nothing is recorded."""


def sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "not installed"


# ---- the version guard ------------------------------------------------------------------------------


def _params(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _require(ok: bool, internal: str) -> None:
    if not ok:
        supported = ", ".join(SUPPORTED_SGLANG)
        raise SglangInternalsError(f"sglang {sglang_version()}: {internal} is missing or changed "
                                   f"(tracediff records SGLang {supported}); nothing is recorded")


def _has_fields(cls: type, names: Sequence[str], label: str) -> None:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for name in names:
        _require(name in fields, f"{label}.{name}")


def check_internals(target: Any = None, draft: Any = None, worker: Any = None) -> None:
    """Every SGLang internal the recording reads, checked before anything is attached; raises
    SglangInternalsError naming the first one missing or changed, and the installed version."""
    from sglang.srt.layers.layer_boundary.residual.stream import ResidualStream
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    _has_fields(ForwardBatch, ("forward_mode", "batch_size", "input_ids", "positions", "extend_seq_lens_cpu",
                               "spec_info", "residual_stream"), "ForwardBatch")
    _require(callable(getattr(ForwardMode, "is_extend", None)), "ForwardMode.is_extend")
    _require(callable(getattr(ForwardMode, "is_idle", None)), "ForwardMode.is_idle")
    _has_fields(LogitsProcessorOutput, ("next_token_logits", "hidden_states"), "LogitsProcessorOutput")
    _require("residual" in getattr(ResidualStream, "__slots__", ()), "ResidualStream.residual")
    _require({"rid", "origin_input_ids"} <= set(_params(Req.__init__)), "Req(rid, origin_input_ids)")
    _has_fields(ScheduleBatch, ("reqs",), "ScheduleBatch")
    if target is not None:
        _check_target(target)
    if draft is not None:
        _check_draft(draft)
        from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

        _require(_params(getattr(EagleDraftWorker, "draft_forward", None))[:2] == ["self", "forward_batch"],
                 "EagleDraftWorker.draft_forward(self, forward_batch)")
    if worker is not None:
        for name in ("hot_token_id", "topk", "speculative_num_steps"):
            _require(hasattr(worker, name), f"EagleDraftWorker.{name}")


def _model_forward(module: Any, label: str) -> None:
    _require(_params(module.forward)[:3] == ["input_ids", "positions", "forward_batch"],
             f"{label}.forward(input_ids, positions, forward_batch)")


def _check_target(target: Any) -> None:
    name = type(target).__name__
    model: Any = getattr(target, "model", None)
    for attr in ("embed_tokens", "layers", "norm", "layers_to_capture"):
        _require(hasattr(model, attr), f"{name}.model.{attr}")
    _model_forward(model, f"{name}.model")
    for attr in ("logits_processor", "set_eagle3_layers_to_capture", "capture_aux_hidden_states"):
        _require(hasattr(target, attr), f"{name}.{attr}")
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, "self_attn", None)
        takes = set(_params(attn.forward)) if attn is not None else set()
        _require({"positions", "hidden_states", "forward_batch"} <= takes,
                 f"{name}.model.layers[{i}].self_attn.forward(positions, hidden_states, forward_batch)")


def _check_draft(draft: Any) -> None:
    name = type(draft).__name__
    model: Any = getattr(draft, "model", None)
    for attr in ("embed_tokens", "fc", "layers"):
        _require(hasattr(model, attr), f"{name}.model.{attr}")
    _model_forward(model, f"{name}.model")
    for attr in ("logits_processor", "hot_token_id", "config"):
        _require(hasattr(draft, attr), f"{name}.{attr}")


# ---- row keys -----------------------------------------------------------------------------------------


@dataclass
class _Request:
    """What the scheduler knows of one request (one ``Req`` object): its name in the trace, whether
    it is recorded, and its tokens so far (prompt + output)."""

    name: str
    recorded: bool
    tokens: np.ndarray
    req: Callable[[], Any]  # the Req it tracks (a weak reference where the object allows one)
    declared: int = 0  # tokens already handed to the recorder's token table
    anchor: int | None = None  # position of its last depth-0 draft row (chain rows carry its key)
    seen: int = 0  # the batch it was last in

    def kept(self, step: int) -> bool:
        """Whether to keep tracking it: its Req lives (held weakly), or was seen lately (held strongly)."""
        if isinstance(self.req, weakref.ref):
            return self.req() is not None
        return step - self.seen < IDLE_BATCHES


def _reference(req: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(req)
    except TypeError:  # a stand-in without weak references (a namedtuple): held until idle
        return lambda: req


@dataclass
class _Rows:
    """Row keys of one model forward: one entry per row of the forward, in batch order."""

    step: int
    depth: int
    request: np.ndarray  # object
    position: np.ndarray
    token: np.ndarray
    keep: np.ndarray  # admitted request and known token
    last: np.ndarray  # the row index of each request's last row
    _memo: dict = dataclasses.field(default_factory=dict)

    def select(self, n: int) -> tuple[np.ndarray, dict] | None:
        """(rows of a tensor with ``n`` rows to keep, their keys), or None when ``n`` fits neither
        every row of the forward nor one row per request. Keys are the same objects for every
        tensor of the forward, so the recorder learns them once."""
        kind = "all" if n == len(self.keep) else "last" if n == len(self.last) else None
        if kind is None:
            return None
        if kind not in self._memo:
            rows = np.arange(n) if kind == "all" else self.last
            picked = np.flatnonzero(self.keep[rows])
            at = rows[picked]
            self._memo[kind] = (picked, dict(request=self.request[at], positions=self.position[at],
                                             token_ids=self.token[at]))
        return self._memo[kind]


class _Failed(Exception):
    """Raised inside a hook to stop recording with a reason (caught by the hook guard)."""


class Installation:
    """Hooks on one SGLang target and/or draft (and draft worker) feeding one recorder."""

    def __init__(self, rec: Recorder, target: Any, draft: Any, worker: Any, server_args: Any,
                 logits_topk: int | None, gate: RequestGate) -> None:
        self.rec, self.target, self.draft, self.worker = rec, target, draft, worker
        self.server_args = server_args
        self.logits_topk = logits_topk
        self.gate = gate
        self.step = -1
        self.batch: list[_Request | None] = []  # the current batch, None for requests not recorded
        self.requests: dict[int, _Request] = {}  # by id() of the Req object
        self.names: set[str] = set()  # every name handed out (a reused rid gets the next free rid#n)
        self.reuses: dict[str, int] = {}  # rid -> the n to try first for its next rid#n
        self.rows: _Rows | None = None  # keys of the model forward running now
        self.chain: _Rows | None = None  # keys of the draft chain running now
        self.chain_depth = 0
        self.stopped: str | None = None
        self._handles: list[Any] = []
        self._restore: list[Callable[[], None]] = []
        self._warned: set[str] = set()

    # -- the scheduler side -----------------------------------------------------------------------

    def begin_batch(self, reqs: Sequence[Any]) -> None:
        """A new scheduler batch: the next step, and each request's tokens as the scheduler knows them."""
        self.step += 1
        batch: list[_Request | None] = []
        for req in reqs:
            state = self._state(req)
            state.seen = self.step
            if not state.recorded:
                batch.append(None)
                continue
            output = req.output_ids
            known = len(state.tokens) - len(req.origin_input_ids)
            if len(output) > known:
                state.tokens = np.concatenate([state.tokens, np.asarray(output[known:], dtype=np.int64)])
            batch.append(state)
        self.batch = batch
        if self.step % IDLE_BATCHES == 0:
            self.requests = {k: v for k, v in self.requests.items() if v.kept(self.step)}

    def _state(self, req: Any) -> _Request:
        """The state of this Req object; one not seen before is a new request, named and admitted
        (or refused by the request filters) once, at its first batch."""
        state = self.requests.get(id(req))
        if state is not None and state.req() is req:
            return state
        name = self._name(str(req.rid))
        origin = np.asarray(req.origin_input_ids, dtype=np.int64)
        recorded = self.gate.admit(name, origin[: len(self.gate.prefix or ())].tolist())
        state = self.requests[id(req)] = _Request(name, recorded, origin, _reference(req))
        return state

    def _name(self, rid: str) -> str:
        """``rid`` for its first request, then the first free ``rid#n`` (n >= 2) for each later one."""
        name = rid
        if name in self.names:
            n = self.reuses.get(rid, 2)
            while f"{rid}#{n}" in self.names:
                n += 1
            self.reuses[rid] = n + 1
            name = f"{rid}#{n}"
        self.names.add(name)
        return name

    def _forward_rows(self, fb: Any) -> _Rows | None:
        """Keys of every row of a target or depth-0 draft forward, from the batch context."""
        if self.chain is not None:
            self.chain_depth += 1
            return dataclasses.replace(self.chain, depth=self.chain_depth)  # the same keys at every depth
        if fb.forward_mode.is_idle() or not self.batch:
            return None
        positions = fb.positions.detach().reshape(-1).cpu().numpy().astype(np.int64)
        n, bs = len(positions), len(self.batch)
        lens = fb.extend_seq_lens_cpu if fb.forward_mode.is_extend() else None
        lens = [n // bs] * bs if lens is None else [int(k) for k in lens]
        if int(fb.batch_size) != bs or len(lens) != bs or sum(lens) != n:
            self._warn("batch", f"a forward of {fb.batch_size} requests ({n} rows) does not match the batch "
                       f"context ({bs} requests): its rows are not recorded")
            return None
        owner = np.repeat(np.arange(bs), lens)
        request = np.array([r.name if r else "" for r in self.batch], dtype=object)[owner]
        token = np.full(n, -1, dtype=np.int64)
        keep = np.zeros(n, dtype=bool)
        for i, state in enumerate(self.batch):
            if state is None:
                continue
            rows = owner == i
            known = rows & (positions >= 0) & (positions < len(state.tokens))
            token[known] = state.tokens[positions[known]]
            keep |= known
            self._declare(state)
        return _Rows(self.step, 0, request, positions, token, keep, np.cumsum(lens) - 1)

    def _declare(self, state: _Request) -> None:
        if len(state.tokens) > state.declared:
            self.rec.request_tokens(state.name, state.tokens[state.declared :], start=state.declared)
            state.declared = len(state.tokens)

    # -- logging --------------------------------------------------------------------------------

    def _log(self, name: str, tensor: Any, rows: _Rows | None, depth: int | None = None) -> None:
        if rows is None or tensor is None:
            return
        found = rows.select(int(tensor.shape[0]))
        if found is None:
            self._warn(name, f"{name}: {tensor.shape[0]} rows fit neither the forward's rows nor one per "
                       "request; not recorded")
            return
        picked, keys = found
        if not len(picked):
            return
        if len(picked) != tensor.shape[0]:
            import torch

            tensor = tensor[torch.as_tensor(picked, device=tensor.device)]
        self.rec.log(name, tensor, step=rows.step, depth=rows.depth if depth is None else depth, **keys)

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("tracediff: %s", message)

    def _guard(self, where: str, fn: Callable[..., None]) -> Callable[..., None]:
        """A hook that never raises into SGLang and returns None (changes nothing it sees)."""

        def hook(*args: Any) -> None:
            if self.stopped is not None or not self.rec.active:
                return
            try:
                fn(*args)
            except Exception as exc:
                self.fail(where, exc)

        return hook

    def fail(self, where: str, exc: BaseException) -> None:
        """Log once, stop recording (hooks off, patches undone); SGLang keeps running."""
        if self.stopped is not None:
            return
        self.stopped = f"{where}: {type(exc).__name__}: {exc}"
        logger.warning("tracediff: SGLang recording stopped (%s); the server keeps running", self.stopped)
        try:
            self.rec.update_contract(sglang_recording_stopped=self.stopped)
        finally:
            self.remove()

    def remove(self) -> None:
        """Detach every hook and undo every patch."""
        for handle in self._handles:
            handle.remove()
        for undo in self._restore:
            undo()
        self._handles, self._restore = [], []
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        _unpatch_worker()

    def _pre(self, module: Any, where: str, fn: Callable[..., None]) -> None:
        self._handles.append(module.register_forward_pre_hook(self._guard(where, fn), with_kwargs=True))

    def _post(self, module: Any, where: str, fn: Callable[..., None]) -> None:
        self._handles.append(module.register_forward_hook(self._guard(where, fn)))

    # -- target -------------------------------------------------------------------------------------

    def attach_target(self) -> None:
        target = self.target
        model = target.model
        self._pre(model, "target forward", self._target_begin)
        self._post(model, "target.final_hidden", self._target_end)
        self._post(model.embed_tokens, "target.embed",
                   lambda m, a, out: self._log("target.embed", out, self.rows))
        for k in range(1, len(model.layers)):
            self._pre(model.layers[k].self_attn, f"target.layer.{k - 1}", self._stream_entering(k))
        self._post(model.norm, f"target.layer.{len(model.layers) - 1}", self._last_layer)
        self._post(target.logits_processor, "target logits", self._target_logits)
        setter = target.set_eagle3_layers_to_capture

        def set_layers(layer_ids: list[int] | None = None) -> None:
            setter(layer_ids)
            try:
                self._aux_contract(layer_ids, configured=True)
            except Exception as exc:
                self.fail("set_eagle3_layers_to_capture", exc)

        target.set_eagle3_layers_to_capture = set_layers
        self._restore.append(lambda: target.__dict__.pop("set_eagle3_layers_to_capture", None))
        self._aux_contract(None, configured=False)

    def _target_begin(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.rows = self._forward_rows(_arg(module, args, kwargs, "forward_batch"))

    def _target_end(self, module: Any, args: tuple, out: Any) -> None:
        hidden = out[0] if isinstance(out, tuple) else out
        if is_torch_tensor(hidden):  # not on a pipeline stage that hands on proxy tensors
            self._log("target.final_hidden", hidden, self.rows)

    def _stream_entering(self, k: int) -> Callable[..., None]:
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            fb = _arg(module, args, kwargs, "forward_batch")
            if self.rows is None:
                return
            stream = fb.residual_stream
            if stream is None or stream.residual is None:
                raise _Failed(f"no residual stream written on entering layer {k}")
            self._log(f"target.layer.{k - 1}", stream.residual, self.rows)

        return hook

    def _last_layer(self, module: Any, args: tuple, out: Any) -> None:
        if self.rows is None:
            return
        if not (isinstance(out, tuple) and len(out) == 2):
            raise _Failed("the final norm did not return (normed, residual)")
        self._log(f"target.layer.{len(self.target.model.layers) - 1}", out[1], self.rows)

    def _target_logits(self, module: Any, args: tuple, out: Any) -> None:
        rows = self.rows
        if rows is None:
            return
        if self.target.capture_aux_hidden_states:
            self._log("target.aux", out.hidden_states, rows)
        logits = out.next_token_logits
        if logits is None:
            return
        if self.logits_topk is not None:
            top = logits.topk(min(self.logits_topk, logits.shape[-1]), dim=-1)
            self._log("target.logits", top.values, rows)
            self._log("target.logits_topk_ids", top.indices, rows)
        else:
            self._log("target.logits", logits, rows)
        self._log("target.token", logits.argmax(-1), rows)

    def _aux_contract(self, layer_ids: list[int] | None, configured: bool) -> None:
        """Which target states the packed aux holds, as SGLang resolved it (layers_to_capture k is
        the stream entering layer k = output of layer k-1; captured in ascending layer order)."""
        from tracediff.eagle3.capture import OUTPUT_OF_LAYER, AuxSpec

        capture = [int(k) for k in self.target.model.layers_to_capture]
        values: dict[str, Any] = {"layers_to_capture": capture}
        if capture:
            resolved = AuxSpec(tuple(k - 1 for k in capture), convention=OUTPUT_OF_LAYER, ascending=True)
            values.update({**resolved.to_dict(), "aux_layer_ids_resolved": sorted(resolved.layer_ids)})
            del values["aux_layer_ids"]
        if configured:
            values["aux_layer_ids"] = None if layer_ids is None else [int(i) for i in layer_ids]
        self.rec.update_contract(**values)

    # -- draft --------------------------------------------------------------------------------------

    def attach_draft(self) -> None:
        draft = self.draft
        model = draft.model
        self._pre(model, "draft forward", self._draft_begin)
        self._post(model, "draft.hidden", self._draft_end)
        for module, name in ((model.embed_tokens, "draft.embed"), (model.fc, "draft.fc_out")):
            self._post(module, name, lambda m, a, out, name=name: self._log(name, out, self.rows))
        self._post(draft.logits_processor, "draft logits", self._draft_logits)
        _patch_worker()

    def _draft_begin(self, module: Any, args: tuple, kwargs: dict) -> None:
        fb = _arg(module, args, kwargs, "forward_batch")
        rows = self.rows = self._forward_rows(fb)
        if rows is None:
            return
        self._log("draft.input_ids", _arg(module, args, kwargs, "input_ids"), rows)
        self._log("draft.positions", _arg(module, args, kwargs, "positions"), rows)
        hidden = fb.spec_info.hidden_states
        if rows.depth == 0 and hidden is not None and hidden.shape[-1] != module.fc.out_features:
            self._log("draft.fc_in", hidden, rows)  # the fc stage's input, before any fc norm
        if rows.depth == 0:
            for i, state in enumerate(self.batch):
                if state is not None and rows.keep[rows.last[i]]:
                    state.anchor = int(rows.position[rows.last[i]])

    def _draft_end(self, module: Any, args: tuple, out: Any) -> None:
        if self.rows is None:
            return
        if not (isinstance(out, tuple) and len(out) == 2 and len(out[1]) == 1):
            raise _Failed("the EAGLE-3 draft model did not return (hidden, [hidden for the next step])")
        self._log("draft.hidden", out[1][0], self.rows)

    def _draft_logits(self, module: Any, args: tuple, out: Any) -> None:
        logits = out.next_token_logits
        if self.rows is None or logits is None:
            return
        self._log("draft.logits", logits, self.rows)
        self._log("draft.token", logits.argmax(-1), self.rows)

    def owns(self, worker: Any) -> bool:
        """Whether a draft_forward call on ``worker`` runs this installation's draft."""
        if self.worker is not None:
            return worker is self.worker
        runner = getattr(worker, "draft_runner", None)
        return self.draft is not None and getattr(runner, "model", None) is self.draft

    def chain_begin(self, worker: Any, fb: Any) -> None:
        """Keys of a draft chain: each request's anchor row, at depths 1 .. num_steps - 1."""
        self.chain, self.chain_depth = None, 0
        if fb.forward_mode.is_idle() or not self.batch:
            return
        if int(worker.topk) != 1:
            self._warn("topk", "draft chains are recorded for topk = 1 only (a tree has no chain keys)")
            return
        if int(fb.batch_size) != len(self.batch):
            self._warn("chain", "a draft chain does not match the batch context: not recorded")
            return
        n = len(self.batch)
        position, token = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        for i, state in enumerate(self.batch):
            if state is not None and state.anchor is not None and state.anchor < len(state.tokens):
                position[i], token[i] = state.anchor, state.tokens[state.anchor]
        keep = position >= 0
        request = np.array([s.name if s else "" for s in self.batch], dtype=object)
        self.chain = _Rows(self.step, 0, request, position, token, keep, np.arange(n))

    def chain_end(self, result: Any) -> None:
        """``draft.token_target`` from the tokens draft_forward returned: column d is depth d."""
        chain, self.chain = self.chain, None
        if chain is None or result is None or result[2] is None:
            return
        tokens = result[2]
        for depth in range(tokens.shape[1]):
            self._log("draft.token_target", tokens[:, depth], chain, depth)

    # -- contract -------------------------------------------------------------------------------

    def contract(self) -> dict:
        import torch

        values: dict[str, Any] = {"source": "serving", "sglang_version": sglang_version(),
                                  "torch_version": torch.__version__, "target_logits": "full"
                                  if self.logits_topk is None else f"top{self.logits_topk} values; "
                                  "their ids in target.logits_topk_ids"}
        values.update(_parallel())
        values.update(_server_contract(self.server_args))
        if self.target is not None:
            values["dtypes"] = {"target": str(next(self.target.parameters()).dtype).replace("torch.", "")}
            values["target_num_layers"] = len(self.target.model.layers)
        if self.draft is not None:
            values.update(_draft_contract(self.draft))
        return values


_FORWARD_PARAMS: dict[type, list[str]] = {}


def _arg(module: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """A forward argument by name, passed positionally or by keyword."""
    if name in kwargs:
        return kwargs[name]
    params = _FORWARD_PARAMS.get(type(module))
    if params is None:
        params = _FORWARD_PARAMS[type(module)] = _params(module.forward)
    return args[params.index(name)]


def _sha256(tensor: Any) -> str:
    return hashlib.sha256(tensor.detach().to("cpu").contiguous().numpy().tobytes()).hexdigest()


def _draft_contract(draft: Any) -> dict:
    import torch

    config = draft.config
    eagle = getattr(config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    model = draft.model
    values: dict[str, Any] = {
        "aux_layer_ids": None if ids is None else [int(i) for i in ids],
        "draft_config": {k: getattr(config, k, None) for k in (
            "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
            "draft_vocab_size", "target_hidden_size", "rms_norm_eps", "rope_theta", "norm_output")},
        # 0.5.23 builds norm_before_fc's input_norm and fc_norm from the config: it applies what the
        # checkpoint asks for (the key's meaning in every producer's contract)
        "fc_norms_applied": hasattr(model, "input_norm") and hasattr(model, "fc_norm"),
        "draft_input_shift": 1,
        "d2t_reading": "offset",
    }
    hot = draft.hot_token_id
    if hot is not None:
        hot = hot.detach().to("cpu", torch.int64)
        values["hot_token_id_sha256"] = _sha256(hot)
        values["d2t_sha256"] = _sha256(hot - torch.arange(len(hot)))
    return values


def _server_contract(server_args: Any) -> dict:
    """Server arguments as SGLang resolved them (its rewrites show only in ``resolved_view``)."""
    if server_args is None:
        return {}
    from sglang.srt.arg_groups.model_override_base import resolved_view

    view = resolved_view(server_args)
    spec = {k: _plain(getattr(view, attr, None)) for k, attr in SPEC_ARGS.items()}
    args = {attr: _plain(getattr(view, attr, None)) for attr in SERVER_ARGS}
    name = getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", None)
    return {"speculative_args": spec, "server_args": args, "target_model": name,
            "attention_backend": args["attention_backend"]}


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _parallel() -> dict:
    """TP rank and size as SGLang holds them (the recorder writes one file per rank)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        return {"tp_rank": int(parallel.tp_rank), "tp_size": int(parallel.tp_size)}
    except Exception:  # no parallel context published (a model built outside a server)
        return {}


# ---- the draft worker patch (one wrapper for every installation) ----------------------------------------

_ACTIVE: list[Installation] = []
_worker_original: Any = None


def _patch_worker() -> None:
    """Wrap ``EagleDraftWorker.draft_forward`` once: a call on a worker that runs an installed draft
    records its chain; any other call passes straight through."""
    global _worker_original
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    if _worker_original is not None:
        return
    original = _worker_original = EagleDraftWorker.draft_forward

    def draft_forward(self: Any, forward_batch: Any) -> Any:
        mine = [i for i in _ACTIVE if i.draft is not None and i.stopped is None and i.owns(self)]
        for inst in mine:
            inst._guard("draft chain", inst.chain_begin)(self, forward_batch)
        try:
            result = original(self, forward_batch)
        except BaseException:
            for inst in mine:
                inst.chain = None
            raise
        for inst in mine:
            inst._guard("draft.token_target", inst.chain_end)(result)
        return result

    EagleDraftWorker.draft_forward = draft_forward


def _unpatch_worker() -> None:
    global _worker_original
    if _worker_original is not None and not any(i.draft is not None for i in _ACTIVE):
        from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

        EagleDraftWorker.draft_forward, _worker_original = _worker_original, None


# ---- the public API -------------------------------------------------------------------------------


def install(recorder: Recorder, *, target: Any = None, draft: Any = None, worker: Any = None,
            server_args: Any = None, logits_topk: int | None = None, requests: int | None = None,
            match_prefix: Sequence[int] | None = None) -> Installation:
    """Record SGLang's target (``LlamaForCausalLM``), EAGLE-3 draft (``LlamaForCausalLMEagle3``) and
    draft worker (``EagleDraftWorker`` or a stand-in running its ``draft_forward``) into ``recorder``.
    Rows are keyed from ``batch_context(reqs)``, which the scheduler side calls per batch.
    ``logits_topk``: record the target logits' top-k values (and ids) instead of the full vocab.
    ``requests`` / ``match_prefix``: record only the first N requests / those whose tokens start so.
    Raises SglangInternalsError (nothing attached) when an SGLang internal it reads is missing."""
    if target is None and draft is None:
        raise ValueError("install needs a target and/or a draft model")
    if logits_topk is not None and logits_topk < 1:
        raise ValueError(f"logits_topk must be >= 1, got {logits_topk}")
    for other in _ACTIVE:
        if any(m is not None and m in (other.target, other.draft) for m in (target, draft)):
            raise ValueError("this model is already recorded: remove() the earlier installation first")
    check_internals(target, draft, worker)
    if sglang_version() not in SUPPORTED_SGLANG:
        logger.warning("tracediff: sglang %s is not a version tracediff was tested with (%s); its internals "
                       "checked out, recording anyway", sglang_version(), ", ".join(SUPPORTED_SGLANG))
    if server_args is None:
        server_args = _published_server_args()
    gate = RequestGate(requests, None if match_prefix is None else tuple(int(t) for t in match_prefix))
    inst = Installation(recorder, target, draft, worker, server_args, logits_topk, gate)
    _ACTIVE.append(inst)
    try:
        recorder.update_contract(**inst.contract())
        if target is not None:
            inst.attach_target()
        if draft is not None:
            inst.attach_draft()
            if draft.hot_token_id is not None:
                import torch

                hot = draft.hot_token_id.detach().to("cpu", torch.int64)
                recorder.log_static("draft.d2t", hot - torch.arange(len(hot)), once=True)
    except BaseException:
        inst.remove()
        raise
    return inst


def batch_context(reqs: Sequence[Any]) -> None:
    """Called by the scheduler side once per batch, before its forward passes, with the batch's
    requests in batch order (``ScheduleBatch.reqs``: ``rid``, ``origin_input_ids``, ``output_ids``),
    the same object for a request in every batch it is in (a new object is a new request, named
    ``rid#n`` when its rid was used before). Starts the next step of every installation; never raises."""
    for inst in list(_ACTIVE):
        inst._guard("batch_context", inst.begin_batch)(reqs)


def _published_server_args() -> Any:
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # nothing published: the contract goes without server arguments
        return None


# ---- the launcher plugin ------------------------------------------------------------------------


class _Plugin:
    """Attaches ``install`` in a server process as SGLang loads its models (``tracediff record``)."""

    def __init__(self, config: LaunchConfig, factory: RecorderFactory) -> None:
        self.config, self.factory = config, factory
        self.failed = False
        self.models: set[int] = set()

    def attach(self, **models: Any) -> None:
        """install(...) on a model SGLang just loaded; failures are one warning, never raised."""
        model = next(iter(models.values()))
        if self.failed or id(model) in self.models:
            return
        self.models.add(id(model))
        try:
            rank = _parallel()
            rec = self.factory(rank.get("tp_rank"), rank.get("tp_size"), source="serving")
            if rec.active:
                install(rec, requests=self.config.requests, match_prefix=self.config.match_prefix, **models)
        except Exception as exc:
            self.failed = True
            logger.warning("tracediff: not recording SGLang (%s: %s); the server runs as usual",
                           type(exc).__name__, exc)

    def patch_loader(self, cls: Any, role: str) -> None:
        original = cls.load_weights

        def load_weights(model: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(model, *args, **kwargs)
            self.attach(**{role: model})
            return result

        cls.load_weights = load_weights

    def patch_scheduler(self, module: Any) -> None:
        """Each batch the scheduler runs starts with ``batch_context(batch.reqs)``."""
        original = module.Scheduler.run_batch

        def run_batch(scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            batch_context(getattr(batch, "reqs", None) or ())
            return original(scheduler, batch, *args, **kwargs)

        module.Scheduler.run_batch = run_batch


def at_startup(config: LaunchConfig, recorder: RecorderFactory) -> None:
    """In every process: once SGLang's Llama / EAGLE-3 model modules are imported, record each model
    as it finishes loading its weights; rows are keyed from the batches ``Scheduler.run_batch`` runs."""
    try:
        plugin = _Plugin(config, recorder)
        when_imported("sglang.srt.models.llama",
                      lambda m: plugin.patch_loader(m.LlamaForCausalLM, "target"))
        when_imported("sglang.srt.models.llama_eagle3",
                      lambda m: plugin.patch_loader(m.LlamaForCausalLMEagle3, "draft"))
        when_imported("sglang.srt.managers.scheduler", plugin.patch_scheduler)
    except Exception as exc:
        logger.warning("tracediff: the SGLang plugin did not start (%s: %s); nothing is recorded",
                       type(exc).__name__, exc)


__all__ = ["SUPPORTED_SGLANG", "Installation", "SglangInternalsError", "at_startup", "batch_context",
           "check_internals", "install"]

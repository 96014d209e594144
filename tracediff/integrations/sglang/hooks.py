"""The hooks: ``install`` attaches to SGLang's target, draft and draft worker; ``batch_context``
(called by the scheduler side once per batch) keys the rows of the forwards that follow."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tracediff.eagle3 import names as tn
from tracediff.eagle3.conventions import READING_KEYS, aux_state_keys, layer_of
from tracediff.integrations.sglang.facts import draft_contract, server_contract, tp_ranks
from tracediff.integrations.sglang.guard import (
    SUPPORTED_SGLANG,
    SglangInternalsError,
    check_internals,
    parameter_names,
    sglang_version,
)
from tracediff.integrations.sglang.keys import IDLE_BATCHES, Request, Rows, reference
from tracediff.integrations.sglang.models import BOUNDARY, TargetLayout, target_layout
from tracediff.integrations.slot_probe import SlotProbe
from tracediff.integrations.target_summary import target_identity
from tracediff.record.copies import is_torch_tensor
from tracediff.record.plugin import RequestGate

if TYPE_CHECKING:  # the plugin is imported in every process of a launch: torch loads only when SGLang runs
    from tracediff.record.recorder import Recorder

logger = logging.getLogger("tracediff")


class _Failed(Exception):
    """Raised inside a hook to stop recording with a reason (caught by the hook guard)."""


class Installation:
    """Hooks on one SGLang target and/or draft (and draft worker) feeding one recorder."""

    def __init__(self, rec: Recorder, target: TargetLayout | None, draft: Any, worker: Any, server_args: Any,
                 logits_topk: int | None, gate: RequestGate) -> None:
        self.rec, self.draft, self.worker = rec, draft, worker
        self.target: Any = None if target is None else target.model
        self.layout = target
        self.server_args = server_args
        self.logits_topk = logits_topk
        self.gate = gate
        self.step = -1
        self.batch: list[Request | None] = []  # the current batch, None for requests not recorded
        self.requests: dict[int, Request] = {}  # by id() of the Req object
        self.names: set[str] = set()  # every name handed out (a reused rid gets the next free rid#n)
        self.reuses: dict[str, int] = {}  # rid -> the n to try first for its next rid#n
        self.rows: Rows | None = None  # keys of the model forward running now
        self.chain: Rows | None = None  # keys of the draft chain running now
        self.chain_depth = 0
        self.stopped: str | None = None
        self._handles: list[Any] = []
        self._restore: list[Callable[[], None]] = []
        self._warned: set[str] = set()
        self.probe = SlotProbe()

    # -- the scheduler side -----------------------------------------------------------------------

    def begin_batch(self, reqs: Sequence[Any]) -> None:
        """A new scheduler batch: the next step, and each request's tokens as the scheduler knows them."""
        self.step += 1
        batch: list[Request | None] = []
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

    def _state(self, req: Any) -> Request:
        """The state of this Req object; one not seen before is a new request, named and admitted
        (or refused by the request filters) once, at its first batch."""
        state = self.requests.get(id(req))
        if state is not None and state.req() is req:
            return state
        name = self._name(str(req.rid))
        origin = np.asarray(req.origin_input_ids, dtype=np.int64)
        recorded = self.gate.admit(name, origin[: len(self.gate.prefix or ())].tolist())
        state = self.requests[id(req)] = Request(name, recorded, origin, reference(req))
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

    def _forward_rows(self, fb: Any) -> Rows | None:
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
        return Rows(self.step, 0, request, positions, token, keep, np.cumsum(lens) - 1)

    def _declare(self, state: Request) -> None:
        if len(state.tokens) > state.declared:
            self.rec.request_tokens(state.name, state.tokens[state.declared :], start=state.declared)
            state.declared = len(state.tokens)

    # -- logging --------------------------------------------------------------------------------

    def _log(self, name: str, tensor: Any, rows: Rows | None, depth: int | None = None) -> None:
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
            self.rec.update_contract(sglang_recording_stopped=self.stopped)  # read by traces' older readers
            self.rec.stop_producer(PRODUCER, self.stopped)
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
        """Hooks on the target's text body (tracediff/integrations/sglang/models.py): the residual
        stream entering each layer (``target.embed`` for layer 0, ``target.layer.{k-1}`` for layer k),
        the stream after the last layer, the logits and the aux the logits processor hands the draft."""
        layout = self.layout
        assert layout is not None  # attached only for a target
        body, layers = layout.body, layout.layers
        self._pre(body, "target forward", self._target_begin)
        self._post(body, tn.TARGET_FINAL_HIDDEN, self._target_end)
        if layout.pattern == BOUNDARY:
            for k, layer in enumerate(layers):
                self._wrap_prepare(k, layer.attn_boundary)
                self._post(layer, f"target layer {k}", self._branch(k, boundary=True))
            self._post(body.norm, f"target.layer.{len(layers) - 1}", self._last_layer)
        else:
            self._pre(layers[0], tn.TARGET_EMBED, self._classic_entry)
            for k, layer in enumerate(layers):
                self._post(layer, f"target.layer.{k}", self._branch(k, boundary=False))
        self._post(layout.logits_processor, "target logits", self._target_logits)
        model = layout.model
        setter = model.set_eagle3_layers_to_capture

        def set_layers(layer_ids: list[int] | None = None) -> None:
            setter(layer_ids)
            try:
                self._aux_contract(layer_ids, configured=True)
            except Exception as exc:
                self.fail("set_eagle3_layers_to_capture", exc)

        model.set_eagle3_layers_to_capture = set_layers
        self._restore.append(lambda: model.__dict__.pop("set_eagle3_layers_to_capture", None))
        self._aux_contract(None, configured=False)

    def _target_begin(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.rows = self._forward_rows(_arg(module, args, kwargs, "forward_batch"))
        self.probe.begin()

    def _target_end(self, module: Any, args: tuple, out: Any) -> None:
        hidden = out[0] if isinstance(out, tuple) else out
        if is_torch_tensor(hidden):  # not on a pipeline stage that hands on proxy tensors
            self._log(tn.TARGET_FINAL_HIDDEN, hidden, self.rows)

    def _stream(self, k: int, stream: Any) -> None:
        """The residual stream entering layer k (k = number of layers: after the last one)."""
        if self.rows is None:
            return
        name = tn.TARGET_EMBED if k == 0 else f"target.layer.{k - 1}"
        self._log(name, stream, self.rows)
        self.probe.keep(name, stream)

    def _wrap_prepare(self, k: int, boundary: Any) -> None:
        """Boundary layers: the stream is complete once layer k's attention boundary has prepared
        it (``forward_batch.residual_stream.residual``), where SGLang itself captures aux states."""
        original = boundary.prepare
        read = self._guard(f"target stream entering layer {k}", lambda fb: self._entering(k, fb))

        def prepare(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            read(kwargs["forward_batch"] if "forward_batch" in kwargs else args[1])
            return out

        try:
            boundary.prepare = prepare
        except AttributeError:
            raise SglangInternalsError(f"{type(boundary).__name__}.prepare cannot be wrapped") from None
        self._restore.append(lambda: boundary.__dict__.pop("prepare", None))

    def _entering(self, k: int, fb: Any) -> None:
        if self.rows is None:
            return
        stream = fb.residual_stream
        if stream is None or stream.residual is None:
            raise _Failed(f"no residual stream written on entering layer {k}")
        self._stream(k, stream.residual)

    def _classic_entry(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Classic layers: what enters layer 0 is the embedding output (scaled where the family scales it)."""
        self._stream(0, _arg(module, args, kwargs, "hidden_states"))

    def _branch(self, k: int, boundary: bool) -> Callable[..., None]:
        """A layer's output: its branch (kept to tell a branch capture from a stream one); for classic
        layers also the stream after it, branch + residual."""

        def hook(module: Any, args: tuple, out: Any) -> None:
            if self.rows is None:
                return
            branch = out[0] if isinstance(out, tuple) else out
            if is_torch_tensor(branch):
                self.probe.keep(f"target.layer.{k}.branch", branch)
            if boundary:
                return
            if not (isinstance(out, tuple) and len(out) == 2 and is_torch_tensor(out[1])):
                raise _Failed(f"layer {k} did not return (hidden_states, residual)")
            self._stream(k + 1, out[0] + out[1])

        return hook

    def _last_layer(self, module: Any, args: tuple, out: Any) -> None:
        if self.rows is None:
            return
        if not (isinstance(out, tuple) and len(out) == 2):
            raise _Failed("the final norm did not return (normed, residual)")
        assert self.layout is not None
        self._stream(len(self.layout.layers), out[1])

    def _target_logits(self, module: Any, args: tuple, out: Any) -> None:
        rows = self.rows
        if rows is None:
            return
        aux = out.hidden_states
        if is_torch_tensor(aux):
            self._log(tn.TARGET_AUX, aux, rows)
            measured = self.probe.measure(aux, len(rows.keep), len(rows.last))
            if measured is not None:
                self.rec.update_contract(**measured_contract(measured))
        logits = out.next_token_logits
        if logits is None:
            return
        if self.logits_topk is not None:
            top = logits.topk(min(self.logits_topk, logits.shape[-1]), dim=-1)
            self._log(tn.TARGET_LOGITS, top.values, rows)
            self._log("target.logits_topk_ids", top.indices, rows)
        else:
            self._log(tn.TARGET_LOGITS, logits, rows)
        self._log(tn.TARGET_TOKEN, logits.argmax(-1), rows)

    def _aux_contract(self, layer_ids: list[int] | None, configured: bool) -> None:
        """What SGLang's setter set: ``layers_to_capture`` and the boundaries it asks to capture
        (``aux_capture_set``: the list, or the per-layer flags where the family sets them; boundary k
        is the stream entering layer k = output of layer k-1). What the aux really holds is measured
        at the next forward that hands one on (``measured_contract``); until then the measured keys
        are null, so a trace whose forward never got that far claims no capture."""
        layout = self.layout
        assert layout is not None
        capture = layout.capture_layers()
        values: dict[str, Any] = {"layers_to_capture": [int(k) for k in layout.body.layers_to_capture],
                                  "aux_capture_set": capture, **dict.fromkeys(MEASURED)}
        if capture:
            self.probe.expect()
        if configured:
            values["aux_layer_ids"] = None if layer_ids is None else [int(i) for i in layer_ids]
        self.rec.update_contract(**values)

    # -- draft --------------------------------------------------------------------------------------

    def attach_draft(self) -> None:
        draft = self.draft
        model = draft.model
        self._pre(model, "draft forward", self._draft_begin)
        self._post(model, tn.DRAFT_HIDDEN, self._draft_end)
        for module, name in ((model.embed_tokens, tn.DRAFT_EMBED), (model.fc, tn.DRAFT_FC_OUT)):
            self._post(module, name, lambda m, a, out, name=name: self._log(name, out, self.rows))
        self._post(draft.logits_processor, "draft logits", self._draft_logits)
        _patch_worker()

    def _draft_begin(self, module: Any, args: tuple, kwargs: dict) -> None:
        fb = _arg(module, args, kwargs, "forward_batch")
        rows = self.rows = self._forward_rows(fb)
        if rows is None:
            return
        self._log(tn.DRAFT_INPUT_IDS, _arg(module, args, kwargs, "input_ids"), rows)
        self._log(tn.DRAFT_POSITIONS, _arg(module, args, kwargs, "positions"), rows)
        hidden = fb.spec_info.hidden_states
        if rows.depth == 0 and hidden is not None and hidden.shape[-1] != module.fc.out_features:
            self._log(tn.DRAFT_FC_IN, hidden, rows)  # the fc stage's input, before any fc norm
        if rows.depth == 0:
            for i, state in enumerate(self.batch):
                if state is not None and rows.keep[rows.last[i]]:
                    state.anchor = int(rows.position[rows.last[i]])

    def _draft_end(self, module: Any, args: tuple, out: Any) -> None:
        if self.rows is None:
            return
        if not (isinstance(out, tuple) and len(out) == 2 and len(out[1]) == 1):
            raise _Failed("the EAGLE-3 draft model did not return (hidden, [hidden for the next step])")
        self._log(tn.DRAFT_HIDDEN, out[1][0], self.rows)

    def _draft_logits(self, module: Any, args: tuple, out: Any) -> None:
        logits = out.next_token_logits
        if self.rows is None or logits is None:
            return
        self._log(tn.DRAFT_LOGITS, logits, self.rows)
        self._log(tn.DRAFT_TOKEN, logits.argmax(-1), self.rows)

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
        self.chain = Rows(self.step, 0, request, position, token, keep, np.arange(n))

    def chain_end(self, result: Any) -> None:
        """``draft.token_target`` from the tokens draft_forward returned: column d is depth d."""
        chain, self.chain = self.chain, None
        if chain is None or result is None or result[2] is None:
            return
        tokens = result[2]
        for depth in range(tokens.shape[1]):
            self._log(tn.DRAFT_TOKEN_TARGET, tokens[:, depth], chain, depth)

    # -- contract -------------------------------------------------------------------------------

    def contract(self) -> dict:
        import torch

        values: dict[str, Any] = {"source": "serving", "sglang_version": sglang_version(),
                                  "torch_version": torch.__version__, "target_logits": "full"
                                  if self.logits_topk is None else f"top{self.logits_topk} values; "
                                  "their ids in target.logits_topk_ids"}
        values.update(tp_ranks())
        values.update(server_contract(self.server_args))
        if self.layout is not None:
            dtype = next(self.layout.model.parameters()).dtype
            values["dtypes"] = {"target": str(dtype).replace("torch.", "")}
            values.update(self.layout.contract())
            values.update(target_identity(self.target))
        if self.draft is not None:
            values.update(draft_contract(self.draft))
        return values


MEASURED = ("aux_slot_states", "aux_capture_layers", "aux_sources", "aux_layer_ids_resolved", *READING_KEYS)


def measured_contract(states: list[str | None]) -> dict[str, Any]:
    """What the aux was measured to hold (``aux_slot_states``); where every slot is a known state,
    the boundaries that captured them (``layers_to_capture`` may name one the forward never
    reaches: llama's k = L) and what follows from the states (``aux_state_keys``)."""
    values: dict[str, Any] = {"aux_slot_states": states}
    if states and all(state is not None for state in states):
        known = [str(state) for state in states]
        values.update(aux_state_keys(known), aux_capture_layers=[layer_of(s) + 1 for s in known])
    return values


_FORWARD_PARAMS: dict[type, list[str]] = {}


def _arg(module: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """A forward argument by name, passed positionally or by keyword."""
    if name in kwargs:
        return kwargs[name]
    params = _FORWARD_PARAMS.get(type(module))
    if params is None:
        params = _FORWARD_PARAMS[type(module)] = parameter_names(module.forward)
    return args[params.index(name)]


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
            inst._guard(tn.DRAFT_TOKEN_TARGET, inst.chain_end)(result)
        return result

    EagleDraftWorker.draft_forward = draft_forward


def _unpatch_worker() -> None:
    global _worker_original
    if _worker_original is not None and not any(i.draft is not None for i in _ACTIVE):
        from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

        EagleDraftWorker.draft_forward, _worker_original = _worker_original, None


# ---- the public API -------------------------------------------------------------------------------


PRODUCER = "sglang"  # as the trace's ``producers`` names it
# what every target / draft forward records (a trace holding none of one is missing it: compare says so)
TARGET_ATTACHED = (tn.TARGET_EMBED, tn.TARGET_FINAL_HIDDEN)
DRAFT_ATTACHED = (tn.DRAFT_INPUT_IDS, tn.DRAFT_POSITIONS, tn.DRAFT_HIDDEN)


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
    check_internals(draft, worker)
    layout = None if target is None else target_layout(target)
    if sglang_version() not in SUPPORTED_SGLANG:
        logger.warning("tracediff: sglang %s is not a version tracediff was tested with (%s); its internals "
                       "checked out, recording anyway", sglang_version(), ", ".join(SUPPORTED_SGLANG))
    if server_args is None:
        server_args = published_server_args()
    gate = RequestGate(requests, None if match_prefix is None else tuple(int(t) for t in match_prefix))
    inst = Installation(recorder, layout, draft, worker, server_args, logits_topk, gate)
    _ACTIVE.append(inst)
    try:
        recorder.update_contract(**inst.contract())
        if target is not None:
            inst.attach_target()
            recorder.attach_producer(PRODUCER, TARGET_ATTACHED)
        if draft is not None:
            inst.attach_draft()
            recorder.attach_producer(PRODUCER, DRAFT_ATTACHED)
            if draft.hot_token_id is not None:
                import torch

                hot = draft.hot_token_id.detach().to("cpu", torch.int64)
                recorder.log_static(tn.DRAFT_D2T, hot - torch.arange(len(hot)), once=True)
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


def published_server_args() -> Any:
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # nothing published: the contract goes without server arguments
        return None

"""The hooks ``install`` puts on one vLLM model runner: target, draft, verify, and the step around them.

Each engine step is ``runner.execute_model`` (the target forward, its logits) then
``runner.sample_tokens`` (sampling or the rejection sampler's verify, the draft's proposal, then the
bookkeeping that commits the step's tokens). Hooks copy what they see (a clone, on the tensor's own
device) with the rows' positions and fed tokens; when ``sample_tokens`` returns, the step's rows are
keyed against each request's committed text (steps.py) and logged. Forwards outside a step (vLLM's
warm-up, profiling and dummy runs) are never recorded.

Where each tensor comes from (vLLM 0.32, V1 runner; ``runner.model`` is the target's outer class, whose
inner model is compiled by ``@support_torch_compile`` and bypasses module hooks):

- ``target.embed`` / ``target.layer.{k}``: the input of layer 0 / the stream after layer k
  (``hidden + residual`` of its output), eager mode only (in a compiled region a hook would be traced
  into the graph: the contract says they were not recorded, and why);
- ``target.aux``: the aux states the target returns (``(hidden, [aux])``), concatenated; what each slot
  holds is measured against the layer streams (``aux_slot_states``) where those are recorded;
- ``target.final_hidden``, ``target.logits`` / ``target.token`` (``compute_logits``: the sampled rows);
- ``draft.fc_in`` / ``draft.fc_out``: ``combine_hidden_states``' input and output (depth 0);
- ``draft.input_ids``, ``draft.positions``, ``draft.hidden`` (the pre-norm output fed to the next depth):
  the draft's forward, depth 0 over every row (the first pass), then one row per request per depth;
- ``draft.logits`` / ``draft.token`` (draft vocab, before vLLM maps them to the target vocab),
  ``draft.token_target`` (what ``propose`` returned, column d = depth d), ``draft.d2t`` (static);
- ``verify.accept_len``: accepted drafts per request per verify (the rejection sampler), keyed at the
  anchor of the chain it verified.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tracediff.eagle3 import names as tn
from tracediff.eagle3.conventions import aux_state_keys, layer_of
from tracediff.integrations.slot_probe import SlotProbe
from tracediff.integrations.vllm.facts import PRODUCER, run_facts
from tracediff.integrations.vllm.guard import SUPPORTED_VLLM, check_runner, supported, vllm_version
from tracediff.integrations.vllm.steps import (
    ANCHOR,
    DRAFT0,
    LOGITS,
    TARGET,
    VERIFY,
    ClientText,
    StepRows,
    anchors_of,
)
from tracediff.record.plugin import RequestGate

if TYPE_CHECKING:
    from tracediff.record.recorder import Recorder
    from tracediff.record.rowkeys import LogRowKeys

logger = logging.getLogger("tracediff")

# what every target / draft step records (a trace holding none of one is missing it: compare says so)
TARGET_ATTACHED = (tn.TARGET_AUX, tn.TARGET_FINAL_HIDDEN, tn.TARGET_TOKEN)
LAYERS_ATTACHED = (tn.TARGET_EMBED, "target.layer.*")
DRAFT_ATTACHED = (tn.DRAFT_FC_IN, tn.DRAFT_INPUT_IDS, tn.DRAFT_POSITIONS, tn.DRAFT_HIDDEN,
                  tn.DRAFT_TOKEN_TARGET, tn.VERIFY_ACCEPT_LEN)
ALSO_RECORDED = (tn.TARGET_LOGITS, tn.TARGET_TOKEN, tn.DRAFT_FC_OUT, tn.DRAFT_LOGITS, tn.DRAFT_TOKEN,
                 tn.DRAFT_D2T)


def recordable(runner: Any) -> list[str]:
    """Every name the hooks may record on this runner (its layers counted)."""
    layers = [f"target.layer.{k}" for k in range(len(runner.model.model.layers))]
    return [*TARGET_ATTACHED, *DRAFT_ATTACHED, *ALSO_RECORDED, tn.TARGET_EMBED, *layers]


@dataclass
class Kept:
    """One tensor a hook saw this step, waiting for its rows' keys."""

    name: str
    tensor: Any
    rows: str  # which row set of the step it is cut along (steps.py)
    depth: int = 0


class Installation:
    """Hooks on one vLLM model runner feeding one recorder (module docstring)."""

    def __init__(self, rec: Recorder, runner: Any, gate: RequestGate) -> None:
        self.rec, self.runner, self.gate = rec, runner, gate
        self.step = -1
        self.in_step = False
        self.rows: StepRows | None = None
        self.kept: list[Kept] = []
        self.layer_states: dict[int, Any] = {}
        self.spec_drafts: dict[str, int] = {}  # this step: drafts scheduled per request
        self.depth = -1  # the draft forward running now (-1: none this step)
        self.last_anchor: dict[str, tuple[int, int]] = {}
        self.declared: dict[str, int] = {}
        self.text_of: dict[str, tuple[Any, ClientText]] = {}  # per request: vLLM's state, its text
        self.admitted: dict[str, bool] = {}
        self.stopped: str | None = None
        self.eager = True
        self.probe = SlotProbe()
        self._handles: list[Any] = []
        self._restore: list[Callable[[], None]] = []
        self._warned: set[str] = set()

    # -- guards -----------------------------------------------------------------------------------

    def wants(self, name: str) -> bool:
        return self.rec.filter.keep_name(name)

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("tracediff: %s", message)

    def _guard(self, where: str, fn: Callable[..., None]) -> Callable[..., None]:
        """A hook that never raises into vLLM and returns None (changes nothing it sees)."""

        def hook(*args: Any, **kwargs: Any) -> None:
            if self.stopped is not None or not self.rec.active:
                return
            try:
                fn(*args, **kwargs)
            except Exception as exc:
                self.fail(where, exc)

        return hook

    def fail(self, where: str, exc: BaseException | str) -> None:
        """Log once, stop recording (hooks off, patches undone); vLLM keeps running."""
        if self.stopped is not None:
            return
        self.stopped = f"{where}: {exc}" if isinstance(exc, str) else f"{where}: {type(exc).__name__}: {exc}"
        logger.warning("tracediff: vLLM recording stopped (%s); the server keeps running", self.stopped)
        try:
            self.rec.stop_producer(PRODUCER, self.stopped, step=max(self.step - 1, 0))
        finally:
            self.remove()

    def remove(self) -> None:
        """Detach every hook and undo every patch."""
        for handle in self._handles:
            handle.remove()
        for undo in reversed(self._restore):
            undo()
        self._handles, self._restore, self.kept = [], [], []
        if self in _ACTIVE:  # the runner may be recorded again
            _ACTIVE.remove(self)

    def _post(self, module: Any, where: str, fn: Callable[..., None], kwargs: bool = False) -> None:
        self._handles.append(module.register_forward_hook(self._guard(where, fn), with_kwargs=kwargs))

    def _pre(self, module: Any, where: str, fn: Callable[..., None]) -> None:
        self._handles.append(module.register_forward_pre_hook(self._guard(where, fn)))

    def _wrap(self, owner: Any, attr: str, before: Callable[..., None] | None = None,
              after: Callable[..., None] | None = None) -> None:
        """Replace ``owner.attr`` (an instance attribute shadowing the method) by a call of the original
        with ``before(*args, **kwargs)`` and ``after(result, *args, **kwargs)`` around it, guarded."""
        original = getattr(owner, attr)
        pre = None if before is None else self._guard(f"before {attr}", before)
        post = None if after is None else self._guard(f"after {attr}", after)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if pre is not None:
                pre(*args, **kwargs)
            result = original(*args, **kwargs)
            if post is not None:
                post(result, *args, **kwargs)
            return result

        owner.__dict__[attr] = wrapper
        self._restore.append(lambda: owner.__dict__.pop(attr, None))

    def keep(self, name: str, tensor: Any, rows: str, depth: int = 0, count: int | None = None,
             buffer: bool = False) -> None:
        """Hold ``tensor`` (its first ``count`` rows) until the step's end. Model outputs are new
        tensors every forward and are held as they are; a view of one of vLLM's persistent input
        buffers (``buffer``: the draft's token ids and positions, rewritten at every draft step) is
        copied."""
        if tensor is None or not self.wants(name):
            return
        t = tensor.detach()
        if count is not None:
            t = t[:count]
        self.kept.append(Kept(name, t.clone() if buffer else t, rows, depth))

    # -- the step ---------------------------------------------------------------------------------

    def attach_step(self) -> None:
        self._wrap(self.runner, "execute_model", before=self.begin_step)
        self._wrap(self.runner, "sample_tokens", after=self.end_step)

    def begin_step(self, scheduler_output: Any = None, *args: Any, **kwargs: Any) -> None:
        self.step += 1
        self.in_step, self.rows, self.kept, self.depth = True, None, [], -1
        self.layer_states = {}
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        self.spec_drafts = {str(r): len(ids) for r, ids in spec.items() if ids}
        for name in getattr(scheduler_output, "finished_req_ids", None) or ():
            self.forget(str(name))

    def forget(self, name: str) -> None:
        """A finished request: what is held for it goes (a server runs for months of requests)."""
        for held in (self.text_of, self.declared, self.admitted, self.last_anchor):
            held.pop(name, None)
        self.gate.forget(name)

    def end_step(self, result: Any, *args: Any, **kwargs: Any) -> None:
        """The step's tokens are committed: key and log what the hooks kept."""
        if not self.in_step:
            return
        self.in_step = False
        rows, kept, self.kept = self.rows, self.kept, []
        if rows is None:
            return
        text = self.texts(rows.requests)
        keys = rows.resolve(text, self.last_anchor)
        # per row set: its keys, checked once, and the index of its kept rows (None: the first n)
        checked: dict[str, tuple[LogRowKeys, Any]] = {}
        for item in kept:
            found = keys.get(item.rows)
            if found is None:
                self._warn(f"rows {item.name}", f"{item.name}: its rows did not match the step's "
                           f"({item.rows}); not recorded")
                continue
            if not len(found.index):
                continue
            if item.rows not in checked:
                checked[item.rows] = (self.rec.row_keys(found.token, positions=found.position,
                                                        request=found.request, step=self.step),
                                      None if _all_rows(found.index) else _index(found.index))
            row_keys, index = checked[item.rows]
            tensor = item.tensor
            tensor = tensor[: len(found.index)] if index is None else tensor[index.to(tensor.device)]
            self.rec.log(item.name, tensor, step=self.step, depth=item.depth, keys=row_keys)
        if ANCHOR in keys:
            drafted = [r for r in rows.requests if r in text]
            self.last_anchor = {**{r: a for r, a in self.last_anchor.items() if r not in drafted},
                                **anchors_of(keys[ANCHOR], drafted)}

    def texts(self, batch: list[str]) -> dict[str, np.ndarray]:
        """Each recorded request's committed tokens as its client receives them; new tokens are
        declared to the recorder (its token table)."""
        out: dict[str, np.ndarray] = {}
        for name in batch:
            state = self.runner.requests.get(name)
            if state is None:
                continue
            text = self.client_text(name, state)
            if text is None:
                continue
            out[name] = tokens = text.extend(state.output_token_ids)
            done = self.declared.get(name, 0)
            if len(tokens) > done:
                self.rec.request_tokens(name, tokens[done:], start=done)
                self.declared[name] = len(tokens)
        return out

    def client_text(self, name: str, state: Any) -> ClientText | None:
        """The request's text as it grows (None: a request the gate does not record), made anew
        when vLLM holds a new state for it (a preempted request resumed)."""
        held = self.text_of.get(name)
        if held is not None and held[0] is state:
            return held[1]
        prompt = list(getattr(state, "prompt_token_ids", None) or [])
        if name not in self.admitted:
            self.admitted[name] = self.gate.admit(name, prompt[: len(self.gate.prefix or ())])
        if not self.admitted[name]:
            return None
        params = getattr(state, "sampling_params", None)
        if (getattr(params, "stop", None) or getattr(params, "repetition_detection", None)) and \
                "text past a stop" not in self._warned:
            self._warn("text past a stop", "requests with stop strings or repetition detection: vLLM's "
                       "frontend ends them, after the worker generated past that end; their recorded text "
                       "may run a few tokens longer than the client's (the trace's contract says so)")
            self.rec.update_contract(texts_past_frontend_stops=(
                "requests ended by stop strings or repetition detection (vLLM's frontend ends them) hold "
                "the tokens the worker generated before it heard: their texts may run a few tokens past "
                "the client's"))
        text = ClientText(prompt, max_tokens=getattr(params, "max_tokens", None),
                          eos=getattr(params, "eos_token_id", None),
                          stop_ids=getattr(params, "stop_token_ids", None),
                          max_model_len=getattr(self.runner.vllm_config.model_config, "max_model_len", None))
        self.text_of[name] = (state, text)
        return text

    # -- target -----------------------------------------------------------------------------------

    def attach_target(self) -> None:
        model = self.runner.model
        self._post(model, "target forward", self.target_forward, kwargs=True)
        mode = getattr(self.runner.vllm_config.compilation_config, "mode", 0)
        self.eager = int(getattr(mode, "value", mode) or 0) == 0
        layers = list(model.model.layers)
        if self.eager:  # the streams: recorded, and what the aux slots are measured against
            self._pre(layers[0], tn.TARGET_EMBED, self.layer_input)
            for k, layer in enumerate(layers):
                self._post(layer, f"target.layer.{k}", self.layer_output(k))
        self._wrap(model, "compute_logits", after=self.target_logits)
        sampler = getattr(self.runner, "rejection_sampler", None)
        if sampler is not None:
            self._post(sampler, "verify", self.verified)

    def layer_input(self, module: Any, args: tuple) -> None:
        if self.in_step and len(args) >= 2 and (self.probe.wanted or self.wants(tn.TARGET_EMBED)):
            self.layer_states[-1] = args[1]

    def layer_output(self, k: int) -> Callable[..., None]:
        """The stream after layer k, kept while it is recorded or the aux slots are still measured
        (a filtered-out layer then costs its hook's call only)."""
        name = f"target.layer.{k}"

        def hook(module: Any, args: tuple, out: Any) -> None:
            if self.in_step and isinstance(out, tuple) and len(out) == 2 and \
                    (self.probe.wanted or self.wants(name)):
                hidden, residual = out
                self.layer_states[k] = hidden if residual is None else hidden + residual

        return hook

    def target_forward(self, module: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if not self.in_step:
            return
        runner = self.runner
        batch = [str(r) for r in runner.input_batch.req_ids if r is not None]
        starts = np.asarray(runner.query_start_loc.cpu[: len(batch) + 1].numpy(), dtype=np.int64)
        n = int(starts[-1]) if len(starts) else 0
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if input_ids is None or positions is None or positions.dim() != 1:
            self._warn("target inputs", "a target forward without token ids or 1-D positions: not recorded")
            return
        self.rows = StepRows(batch, starts, positions[:n].detach().cpu().numpy().astype(np.int64),
                             input_ids[:n].detach().cpu().numpy().astype(np.int64))
        self.rows.logits_rows = _logits_rows(starts, [self.spec_drafts.get(r, 0) for r in batch])
        hidden, aux = out if isinstance(out, tuple) else (out, None)
        self.keep(tn.TARGET_FINAL_HIDDEN, hidden, TARGET, count=n)
        streams = self.layer_states
        for k, state in sorted(streams.items()):
            self.keep(tn.TARGET_EMBED if k == -1 else f"target.layer.{k}", state, TARGET, count=n)
        if aux:
            import torch

            packed = torch.cat([a[:n] for a in aux], dim=-1)
            self.keep(tn.TARGET_AUX, packed, TARGET)
            self.measure(aux, n)
        self.layer_states = {}

    def measure(self, aux: list, n: int) -> None:
        """What each aux slot holds, once: matched against the layer streams of the same forward."""
        if not self.probe.wanted or not self.layer_states or not n:
            return
        for k, state in self.layer_states.items():
            self.probe.keep(tn.TARGET_EMBED if k == -1 else f"target.layer.{k}", state[:n])
        import torch

        states = self.probe.measure(torch.cat([a[:n] for a in aux], dim=-1), n, n)
        if states is None:
            return
        values: dict[str, Any] = {"aux_slot_states": states}
        if all(s is not None for s in states):
            known = [str(s) for s in states]
            values.update(aux_state_keys(known), aux_capture_layers=[layer_of(s) + 1 for s in known])
        self.rec.update_contract(**values)

    def target_logits(self, logits: Any, *args: Any, **kwargs: Any) -> None:
        rows = self.rows
        if not self.in_step or rows is None or logits is None:
            return
        if rows.logits_rows is None or len(rows.logits_rows) != logits.shape[0]:
            self._warn("logits rows", f"target logits of {logits.shape[0]} rows fit no row set of the step: "
                       "not recorded")
            rows.logits_rows = None
            return
        self.keep(tn.TARGET_LOGITS, logits, LOGITS)
        if self.wants(tn.TARGET_TOKEN):
            self.keep(tn.TARGET_TOKEN, logits.argmax(-1), LOGITS)

    def verified(self, module: Any, args: tuple, out: Any) -> None:
        rows = self.rows
        sampled = getattr(out, "sampled_token_ids", None)
        if not self.in_step or rows is None or sampled is None:
            return
        valid = (sampled >= 0).sum(-1).cpu().numpy()
        rows.accepted = {r: int(valid[b]) - 1 for b, r in enumerate(rows.requests)
                         if r in self.spec_drafts and b < len(valid)}
        if self.wants(tn.VERIFY_ACCEPT_LEN) and rows.accepted:
            import torch

            accepted = [rows.accepted.get(r, -1) for r in rows.requests]
            self.kept.append(Kept(tn.VERIFY_ACCEPT_LEN, torch.tensor(accepted, dtype=torch.int64), VERIFY))

    # -- draft ------------------------------------------------------------------------------------

    def attach_draft(self) -> None:
        drafter = self.runner.drafter
        draft = drafter.model
        self._wrap(drafter, "propose", before=self.propose_begin, after=self.proposed)
        self._wrap(drafter, "set_inputs_first_pass", after=self.first_pass)
        self._wrap(draft, "combine_hidden_states", after=self.combined)
        self._post(draft, "draft forward", self.draft_forward, kwargs=True)
        self._post(draft.logits_processor, "draft logits", self.draft_logits)
        d2t = getattr(draft, "draft_id_to_target_id", None)
        if d2t is not None:
            self.rec.log_static(tn.DRAFT_D2T, d2t.detach().to("cpu").long(), once=True)

    def propose_begin(self, *args: Any, **kwargs: Any) -> None:
        self.depth = -1

    def first_pass(self, result: Any, *args: Any, **kwargs: Any) -> None:
        rows = self.rows
        if not self.in_step or rows is None or not isinstance(result, tuple) or len(result) < 2:
            return
        anchors = result[1]
        if anchors is not None and hasattr(anchors, "detach"):
            rows.anchors = anchors.detach().cpu().numpy().astype(np.int64)[: len(rows.requests)]

    def combined(self, result: Any, hidden_states: Any = None, *args: Any, **kwargs: Any) -> None:
        if not self.in_step or self.rows is None:
            return
        n = len(self.rows.position)
        fc_in = hidden_states if hidden_states is not None else kwargs.get("hidden_states")
        if fc_in is None or fc_in.shape[0] < n or result.shape[0] < n:
            self._warn("fc rows", "the draft's fc ran over other rows than the target: not recorded")
            return
        self.keep(tn.DRAFT_FC_IN, fc_in, TARGET, count=n, buffer=True)
        self.keep(tn.DRAFT_FC_OUT, result, TARGET, count=n)

    def draft_forward(self, module: Any, args: tuple, kwargs: dict, out: Any) -> None:
        rows = self.rows
        if not self.in_step or rows is None:
            return
        self.depth += 1
        depth = self.depth
        ids, positions = kwargs.get("input_ids"), kwargs.get("positions")
        if ids is None or positions is None:
            ids, positions = (args + (None, None))[:2]
        prenorm = out[1] if isinstance(out, tuple) and len(out) == 2 else None
        if depth == 0:
            n = len(rows.position)
            if ids is None or positions is None or ids.shape[0] < n:
                self._warn("first pass", "the draft's first pass ran over other rows than the target: its "
                           "rows are not recorded")
                return
            rows.draft_position = positions[:n].detach().cpu().numpy().astype(np.int64)
            rows.draft_fed = ids[:n].detach().cpu().numpy().astype(np.int64)
            self.keep(tn.DRAFT_INPUT_IDS, ids, DRAFT0, count=n, buffer=True)
            self.keep(tn.DRAFT_POSITIONS, positions, DRAFT0, count=n, buffer=True)
            self.keep(tn.DRAFT_HIDDEN, prenorm, DRAFT0, count=n)
            return
        b = len(rows.requests)
        self.keep(tn.DRAFT_INPUT_IDS, ids, ANCHOR, depth, count=b, buffer=True)
        self.keep(tn.DRAFT_POSITIONS, positions, ANCHOR, depth, count=b, buffer=True)
        self.keep(tn.DRAFT_HIDDEN, prenorm, ANCHOR, depth, count=b)

    def draft_logits(self, module: Any, args: tuple, out: Any) -> None:
        rows = self.rows
        if not self.in_step or rows is None or self.depth < 0 or out is None:
            return
        b = len(rows.requests)
        if out.shape[0] < b:
            return
        self.keep(tn.DRAFT_LOGITS, out, ANCHOR, self.depth, count=b)
        if self.wants(tn.DRAFT_TOKEN):
            self.keep(tn.DRAFT_TOKEN, out[:b].argmax(-1), ANCHOR, self.depth)

    def proposed(self, result: Any, *args: Any, **kwargs: Any) -> None:
        rows = self.rows
        if not self.in_step or rows is None or result is None or result.dim() != 2:
            return
        for depth in range(result.shape[1]):
            self.keep(tn.DRAFT_TOKEN_TARGET, result[:, depth], ANCHOR, depth, count=len(rows.requests))

    # -- contract ---------------------------------------------------------------------------------

    def contract(self) -> dict[str, Any]:
        values = run_facts(self.runner)
        layers = self.eager
        values["target_layers_recorded"] = layers
        if not layers:
            values["target_layers_not_recorded"] = ("the target's layers run inside vLLM's compiled region, "
                                                    "where hooks are traced into the graph: serve with "
                                                    "--enforce-eager to record target.embed / target.layer.*")
        values["aux_slot_states"] = None
        return values


def _all_rows(index: np.ndarray) -> bool:
    """Whether a row set keeps every row of its tensors, in order (no gather needed)."""
    return bool(index[0] == 0 and index[-1] == len(index) - 1 and (len(index) < 3 or
                                                                   (np.diff(index) == 1).all()))


def _index(index: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))


def _logits_rows(starts: np.ndarray, drafts: list[int]) -> np.ndarray:
    """The target rows vLLM computes logits at: each request's last 1 + (its drafts) rows."""
    ends = starts[1:]
    return np.concatenate([np.arange(e - 1 - d, e) for e, d in zip(ends.tolist(), drafts)]).astype(np.int64) \
        if len(drafts) else np.zeros(0, dtype=np.int64)


_ACTIVE: list[Installation] = []


def install(recorder: Recorder, runner: Any, *, requests: int | None = None,
            match_prefix: Any = None) -> Installation:
    """Record one vLLM model runner (``CPUModelRunner`` / ``GPUModelRunner``, loaded: its target, EAGLE-3
    drafter and rejection sampler exist) into ``recorder``. ``requests`` / ``match_prefix``: record
    only the first N requests / those whose tokens start so. Raises ``VllmInternalsError`` (nothing
    attached) when a vLLM internal it reads is missing; a vLLM version tracediff does not know is
    recorded with a warning only when its internals check out."""
    if any(inst.runner is runner for inst in _ACTIVE):
        raise ValueError("this runner is already recorded: remove() the earlier installation first")
    check_runner(runner)
    if getattr(runner, "use_async_scheduling", False):
        raise ValueError("vLLM runs with async scheduling: a step's tokens are committed after the next "
                         "step starts, so rows cannot be keyed by their text; serve with "
                         "--no-async-scheduling to record")
    version = vllm_version()
    if not supported(version):
        logger.warning("tracediff: vllm %s is not a version tracediff was tested with (%s); its internals "
                       "checked out, recording anyway", version, ", ".join(SUPPORTED_VLLM))
    gate = RequestGate(requests, None if match_prefix is None else tuple(int(t) for t in match_prefix))
    inst = Installation(recorder, runner, gate)
    if not any(recorder.filter.keep_name(name) for name in recordable(runner)):
        logger.warning("tracediff: the names / exclude given leave none of the tensors vLLM's hooks record "
                       "(target.*, draft.*, verify.accept_len): nothing is attached, the trace holds the "
                       "run's facts only")
        recorder.update_contract(**run_facts(runner))
        _ACTIVE.append(inst)
        return inst
    try:
        inst.attach_step()
        inst.attach_target()
        recorder.attach_producer(PRODUCER, TARGET_ATTACHED + (LAYERS_ATTACHED if inst.eager else ()))
        drafter = getattr(runner, "drafter", None)
        if drafter is not None and getattr(drafter, "method", None) == "eagle3":
            inst.attach_draft()
            recorder.attach_producer(PRODUCER, DRAFT_ATTACHED)
        inst.probe.expect()
        recorder.update_contract(**inst.contract())
    except BaseException:
        inst.remove()
        raise
    _ACTIVE.append(inst)
    return inst

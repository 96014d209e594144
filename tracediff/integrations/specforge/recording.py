"""``install(recorder, eagle3_model)``: record a real SpecForge ``OnlineEagle3Model``'s training
forwards under canonical names (the hooks, the row keys, what each TTT step is fed).

The package docstring says how SpecForge lays rows out and how rows are keyed.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracediff.eagle3 import names as tn
from tracediff.eagle3.canonical import log_vocab_map
from tracediff.integrations.specforge.facts import AuxReading, aux_spec, contract, host
from tracediff.integrations.specforge.guard import check_supported
from tracediff.integrations.specforge.patches import BatchNote, local, patches
from tracediff.integrations.target_summary import target_identity
from tracediff.record.recorder import Recorder

logger = logging.getLogger("tracediff")

_RECORDING = "_tracediff_recording"  # a hooked model's attribute: its Recording


@dataclass
class _Pass:
    """One forward being recorded."""

    step: int
    requests: list[str]
    x: np.ndarray  # [B, L] token ids, unshifted
    real: np.ndarray  # [B, L] attention mask as bool
    keep: list[int] | None = None  # the batch rows recorded (None: all)
    depth: int = 0
    roped: set[int] = field(default_factory=set)

    def rows(self, depth: int) -> np.ndarray:
        """Positions of draft rows at ``depth``: t where row t and the token it is fed are real."""
        length = self.x.shape[1]
        fed = np.zeros_like(self.real)
        fed[:, : max(0, length - 1 - depth)] = self.real[:, 1 + depth :]
        return np.where(self.real & fed, np.arange(length), -1)

    def target_rows(self) -> np.ndarray:
        """Positions of target rows whose logits the step holds (all real ones but position 0)."""
        at = np.arange(self.x.shape[1])
        return np.where(self.real & (at >= 1), at, -1)


class Recording:
    """What ``install`` attached; ``remove()`` detaches it. Never raises into training: an error in
    the recording path is logged once and stops recording."""

    def __init__(self, recorder: Recorder, model: Any, sample_ids: Callable[[int, int], str] | None,
                 aux: AuxReading | None, admit: Callable[[str, Sequence[int]], bool] | None) -> None:
        if _RECORDING in model.__dict__:
            raise ValueError("this OnlineEagle3Model is already recorded (remove() that recording first)")
        self.recorder = recorder
        self.admit = admit
        self.model = model
        self.draft = model.draft_model
        self.sample_ids = sample_ids
        self.aux = aux
        self.forwards = 0  # forwards recorded
        self.failed = False
        self._pass: _Pass | None = None
        self._pending: BatchNote | None = None
        self._warned_keys = False
        self._contract_done = False
        self._signature = inspect.signature(type(model).forward)
        self._handles = [
            model.register_forward_pre_hook(self._begin, with_kwargs=True),
            model.register_forward_hook(self._end, with_kwargs=True, always_call=True),
            self.draft.fc.register_forward_hook(self._fc),
            self.draft.embed_tokens.register_forward_hook(self._embed),
            self.draft.midlayer.register_forward_hook(self._hidden),
            self.draft.lm_head.register_forward_hook(self._logits),
        ]
        make_adapter = model._make_adapter
        model._make_adapter = lambda: self._adapter(make_adapter())
        model.__dict__[_RECORDING] = self
        patches.acquire()

    @property
    def active(self) -> bool:
        return not self.failed and self.recorder.active

    def next_batch(self, input_ids: Any, *, sample_ids: Sequence[str] | None = None,
                   step: int | None = None) -> None:
        """For loops that call the model themselves: the ids (before SpecForge's shift) of the batch
        the next forward trains on, its sample ids and step."""
        self._pending = BatchNote(input_ids, sample_ids, step)

    def remove(self) -> None:
        """Detach every hook and patch (the recorder stays open: its owner closes it)."""
        if self._handles:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self.model.__dict__.pop("_make_adapter", None)
            self.model.__dict__.pop(_RECORDING, None)
            patches.release()
        self._stop_pass()

    # ---- hooks: each guarded, none changes what SpecForge computes ----------------------------

    def _begin(self, model: Any, args: tuple, kwargs: dict) -> None:
        self._stop_pass()
        note, self._pending = self._pending or getattr(local, "batch", None), None
        if not self.active:
            return
        try:
            bound = self._signature.bind(model, *args, **kwargs).arguments
            self._pass = self._start(bound, note)
            if self._pass is not None:
                local.rope = self._rope
                self._log_inputs(bound)
        except Exception as exc:
            self._fail(exc)

    def _end(self, model: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if self._pass is not None:
            self.forwards += 1
        self._stop_pass()

    def _fc(self, module: Any, args: tuple, output: Any) -> None:
        self._guarded(lambda p: self._log(tn.DRAFT_FC_OUT, output, p.rows(0), 0))

    def _embed(self, module: Any, args: tuple, output: Any) -> None:
        self._guarded(lambda p: self._log(tn.DRAFT_EMBED, output, p.rows(p.depth), p.depth))

    def _hidden(self, module: Any, args: tuple, output: Any) -> None:
        self._guarded(lambda p: self._log(tn.DRAFT_HIDDEN, output, p.rows(p.depth), p.depth))

    def _logits(self, module: Any, args: tuple, output: Any) -> None:
        def log(p: _Pass) -> None:
            rows, token = p.rows(p.depth), output.argmax(-1)
            self._log(tn.DRAFT_LOGITS, output, rows, p.depth)
            self._log(tn.DRAFT_TOKEN, token, rows, p.depth)
            self._log(tn.DRAFT_TOKEN_TARGET, token + self.draft.d2t[token], rows, p.depth)

        self._guarded(log)

    def _adapter(self, adapter: Any) -> Any:
        step_view = adapter.step_view

        def recorded_step_view(**kwargs: Any) -> Any:
            state = step_view(**kwargs)
            self._guarded(lambda p: self._step_state(p, kwargs["idx"], state))
            return state

        adapter.step_view = recorded_step_view
        return adapter

    def _rope(self, position_ids: Any) -> None:
        def log(p: _Pass) -> None:
            if p.depth not in p.roped and position_ids.dim() == 2:
                p.roped.add(p.depth)
                positions = position_ids.expand(len(p.requests), -1)
                self._log(tn.DRAFT_POSITIONS, positions, p.rows(p.depth), p.depth)

        self._guarded(log)

    # ---- recording -------------------------------------------------------------------------

    def _start(self, bound: dict, note: BatchNote | None) -> _Pass | None:
        """The pass's row keys, or None (warned once) when x[0] cannot be known."""
        shifted = host(bound["input_ids"])
        x = host(note.input_ids) if note is not None and note.input_ids is not None else None
        if x is None or x.shape != shifted.shape or not np.array_equal(x[:, 1:], shifted[:, :-1]):
            if not self._warned_keys:
                self._warned_keys = True
                logger.warning("tracediff: a SpecForge forward ran without its unshifted input_ids (not "
                               "through Eagle3TrainStrategy, and no handle.next_batch(...)): not recorded")
            return None
        mask = bound.get("attention_mask")
        real = np.ones(x.shape, bool) if mask is None else host(mask).astype(bool)
        n = self.forwards
        ids = note.sample_ids if note is not None else None
        if self.sample_ids is not None:
            requests = [str(self.sample_ids(n, b)) for b in range(len(x))]
        elif ids is not None and len(ids) == len(x):
            requests = [str(s) for s in ids]
        else:
            requests = [f"batch{n}.row{b}" for b in range(len(x))]
        step = note.step if note is not None and note.step is not None else n
        keep = None
        if self.admit is not None:
            keep = [b for b in range(len(x)) if self.admit(requests[b], x[b, : _length(real[b])].tolist())]
        return _Pass(step=int(step), requests=requests, x=x, real=real, keep=keep)

    def _log_inputs(self, bound: dict) -> None:
        p = self._pass
        assert p is not None
        if not self._contract_done:
            self._contract_done = True
            log_vocab_map(self.recorder, self.draft.d2t, self.draft.t2d)
            self.recorder.update_contract(**contract(self.model, self.aux))
        for b in range(len(p.x)) if p.keep is None else p.keep:
            self.recorder.request_tokens(p.requests[b], p.x[b, : _length(p.real[b])])
        self._log(tn.DRAFT_FC_IN, bound["hidden_states"], p.rows(0), 0)

    def _step_state(self, p: _Pass, idx: int, state: Any) -> None:
        """A TTT step's view: what it embeds, its loss mask, and (step 0) the target's tokens."""
        p.depth = idx
        rows = p.rows(idx)
        self._log(tn.DRAFT_INPUT_IDS, state.input_ids, rows, idx)
        self._log(tn.TRAIN_LOSS_MASK, state.loss_mask.reshape(state.input_ids.shape), rows, idx)
        if idx == 0:  # row t holds position t+1's token: moved to row t+1, keyed as a target row
            tokens = state.target_token_ids
            at = tokens.new_zeros(tokens.shape)
            at[:, 1:] = tokens[:, :-1]
            self._log(tn.TARGET_TOKEN, at, p.target_rows(), 0)

    def _log(self, name: str, tensor: Any, positions: np.ndarray, depth: int) -> None:
        """[B, L, ...] rows of the batch rows kept, with their keys."""
        p = self._pass
        assert p is not None
        tensor, requests, x = tensor.detach(), p.requests, p.x
        if p.keep is not None:
            if not p.keep:
                return
            tensor, requests, x, positions = tensor[p.keep], [requests[b] for b in p.keep], x[p.keep], \
                positions[p.keep]
        self.recorder.log(name, tensor, step=p.step, request=requests, positions=positions, token_ids=x,
                          depth=depth)

    def _guarded(self, body: Callable[[_Pass], None]) -> None:
        p = self._pass
        if p is None or not self.active:
            return
        try:
            body(p)
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        if not self.failed:
            self.failed = True
            logger.warning("tracediff: SpecForge recording stopped (%s: %s); training continues",
                           type(exc).__name__, exc)
            self.recorder.stop_producer(PRODUCER, f"{type(exc).__name__}: {exc}", step=self.forwards)
        self._stop_pass()

    def _stop_pass(self) -> None:
        self._pass = None
        if getattr(local, "rope", None) == self._rope:
            local.rope = None


PRODUCER = "specforge"  # as the trace's ``producers`` names it
# what every training forward records (a trace holding none of one is missing it: compare says so)
ATTACHED = (tn.DRAFT_FC_IN, tn.DRAFT_INPUT_IDS, tn.DRAFT_HIDDEN, tn.DRAFT_LOGITS)


def install(recorder: Recorder, eagle3_model: Any, *, sample_ids: Callable[[int, int], str] | None = None,
            aux_layer_ids: Sequence[int] | None = None, target_num_layers: int | None = None,
            admit: Callable[[str, Sequence[int]], bool] | None = None, target: Any = None) -> Recording:
    """Record every forward of ``eagle3_model`` (SpecForge's ``OnlineEagle3Model``, or a DDP/FSDP
    wrapper of one). ``sample_ids(n, b)``: the request id of batch row b of recorded forward n.
    The aux layer ids go into the contract as SpecForge resolves them: ``aux_layer_ids``, else what
    SpecForge's resolver returned in this process (run override, draft config or target default;
    seen by the launcher plugin), else the draft config's ``eagle_config``, else SpecForge's default
    for ``target_num_layers``. ``admit(request, tokens)`` decides once per sample whether it is
    recorded (the launcher's --requests / --match-prefix). Raises ``SpecForgeUnsupported`` (one
    line) when this SpecForge lacks an internal the recorder needs. ``target``: the target model
    the features come from, which the contract then identifies: SGLang's class (as SpecForge 0.2.0
    captures: the ids are read as that family's capture reads them) or an HF model (its
    ``hidden_states[i+1]``: the output of layer i); see contract.read_ids."""
    model = check_supported(eagle3_model)
    identity = target_identity(target) if target is not None else {}
    layers = target_num_layers or (identity.get("target_config") or {}).get("num_hidden_layers")
    aux = aux_spec(model.draft_model.config, aux_layer_ids, layers, target)
    recording = Recording(recorder, model, sample_ids, aux, admit)
    recorder.attach_producer(PRODUCER, ATTACHED)
    if identity:
        recorder.update_contract(**identity)
    return recording


def _length(real: np.ndarray) -> int:
    """A right-padded row's length: its real tokens up to the first padding."""
    return len(real) if real.all() else int(real.argmin())


__all__ = ["Recording", "install"]

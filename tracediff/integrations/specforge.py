"""Recording SpecForge 0.2.0's EAGLE-3 training: ``install(recorder, eagle3_model)`` on a real
``OnlineEagle3Model``, or ``tracediff record --out train.h5 -- python train.py ...`` with this
module as a launcher plugin (``at_startup``), which installs on every ``OnlineEagle3Model`` built.

Per forward (one training step) and TTT step ``depth`` it logs the canonical names of
docs/FORMAT.md. How SpecForge lays rows out (read from its code, checked by the tests):

- Its step (``Eagle3TrainStrategy.forward_loss`` -> ``TargetHead.preprocess``) shifts ``input_ids``
  and the target left by one before ``OnlineEagle3Model.forward``: row t holds aux(t), embeds x[t+1],
  and the target logits of position t+1. ``loss_mask`` is not shifted.
- TTT step d shifts ids, loss mask and position mask left d times more (zeros come in): row t
  embeds x[t+1+d], counts by loss_mask[t+d], and learns the target's token at position t+1+d.
- RoPE: every attention backend rotates at ``position_ids + lck``, lck = the number of earlier TTT
  steps, so row t runs at position t + d. ``draft.positions`` holds the ids SpecForge passed to
  ``apply_rotary_pos_emb``, caught at the call.

Row keys: row t of a sample carries (request, t, x[t]) at every depth (the anchor's key); rows on
padding, and rows fed a token past the sample's end (t+1+d >= its length: SpecForge embeds the
zeros it shifted in), get position -1. ``target.token`` is logged as target rows: row p holds the
target's argmax at position p (p >= 1; position 0's logits are shifted out before the step).

The forward sees x shifted, so x[0] comes from the step: while a recording is installed,
``Eagle3TrainStrategy.forward_loss`` notes its batch (unshifted ids, ``sample_ids``, the trainer's
``global_step``) for the forward it runs. A custom loop calling the model itself says
``handle.next_batch(input_ids)``; a forward with neither is not recorded (warned once). Requests
are the ``sample_ids`` callable's ids, else SpecForge's ``TrainBatch.sample_ids``, else
``batch{n}.row{b}`` (n counts this handle's recorded forwards, b the batch row).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from tracediff.eagle3.canonical import log_vocab_map
from tracediff.eagle3.capture import OUTPUT_OF_LAYER, AuxSpec
from tracediff.integrations.draft_summary import draft_config_summary
from tracediff.record.recorder import Recorder

logger = logging.getLogger("tracediff")

SUPPORTED_SPECFORGE = ("0.2.0",)
MODEL_MODULE = "specforge.algorithms.eagle3.model"
PROVIDERS_MODULE = "specforge.algorithms.model_providers"
STEP_FIELDS = ("input_ids", "position_ids", "target_token_ids", "loss_mask")
FORWARD_ARGS = ("input_ids", "attention_mask", "target", "loss_mask", "hidden_states", "position_ids")
DRAFT_MODULES = ("embed_tokens", "fc", "midlayer", "lm_head")

_local = threading.local()  # .batch: the step's note; .rope: where apply_rotary_pos_emb reports
_resolved_aux: list[int] | None = None  # ids SpecForge's resolver returned in this process
_RECORDING = "_tracediff_recording"  # a hooked model's attribute: its Recording


class SpecForgeUnsupported(RuntimeError):
    """This SpecForge lacks an internal the recorder relies on (one line: what, which version)."""


@dataclass
class _BatchNote:
    input_ids: Any  # [B, L] before SpecForge's shift
    sample_ids: Sequence[str] | None = None
    step: int | None = None


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
                 aux: tuple[AuxSpec, str] | None, admit: Callable[[str, Sequence[int]], bool] | None) -> None:
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
        self._pending: _BatchNote | None = None
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
        _patches.acquire()

    @property
    def active(self) -> bool:
        return not self.failed and self.recorder.active

    def next_batch(self, input_ids: Any, *, sample_ids: Sequence[str] | None = None,
                   step: int | None = None) -> None:
        """For loops that call the model themselves: the ids (before SpecForge's shift) of the batch
        the next forward trains on, its sample ids and step."""
        self._pending = _BatchNote(input_ids, sample_ids, step)

    def remove(self) -> None:
        """Detach every hook and patch (the recorder stays open: its owner closes it)."""
        if self._handles:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self.model.__dict__.pop("_make_adapter", None)
            self.model.__dict__.pop(_RECORDING, None)
            _patches.release()
        self._stop_pass()

    # ---- hooks: each guarded, none changes what SpecForge computes ----------------------------

    def _begin(self, model: Any, args: tuple, kwargs: dict) -> None:
        self._stop_pass()
        note, self._pending = self._pending or getattr(_local, "batch", None), None
        if not self.active:
            return
        try:
            bound = self._signature.bind(model, *args, **kwargs).arguments
            self._pass = self._start(bound, note)
            if self._pass is not None:
                _local.rope = self._rope
                self._log_inputs(bound)
        except Exception as exc:
            self._fail(exc)

    def _end(self, model: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if self._pass is not None:
            self.forwards += 1
        self._stop_pass()

    def _fc(self, module: Any, args: tuple, output: Any) -> None:
        self._guarded(lambda p: self._log("draft.fc_out", output, p.rows(0), 0))

    def _embed(self, module: Any, args: tuple, output: Any) -> None:
        self._guarded(lambda p: self._log("draft.embed", output, p.rows(p.depth), p.depth))

    def _hidden(self, module: Any, args: tuple, output: Any) -> None:
        self._guarded(lambda p: self._log("draft.hidden", output, p.rows(p.depth), p.depth))

    def _logits(self, module: Any, args: tuple, output: Any) -> None:
        def log(p: _Pass) -> None:
            rows, token = p.rows(p.depth), output.argmax(-1)
            self._log("draft.logits", output, rows, p.depth)
            self._log("draft.token", token, rows, p.depth)
            self._log("draft.token_target", token + self.draft.d2t[token], rows, p.depth)

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
                self._log("draft.positions", positions, p.rows(p.depth), p.depth)

        self._guarded(log)

    # ---- recording -------------------------------------------------------------------------

    def _start(self, bound: dict, note: _BatchNote | None) -> _Pass | None:
        """The pass's row keys, or None (warned once) when x[0] cannot be known."""
        shifted = _host(bound["input_ids"])
        x = _host(note.input_ids) if note is not None and note.input_ids is not None else None
        if x is None or x.shape != shifted.shape or not np.array_equal(x[:, 1:], shifted[:, :-1]):
            if not self._warned_keys:
                self._warned_keys = True
                logger.warning("tracediff: a SpecForge forward ran without its unshifted input_ids (not "
                               "through Eagle3TrainStrategy, and no handle.next_batch(...)): not recorded")
            return None
        mask = bound.get("attention_mask")
        real = np.ones(x.shape, bool) if mask is None else _host(mask).astype(bool)
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
            self.recorder.update_contract(**self._contract())
        for b in range(len(p.x)) if p.keep is None else p.keep:
            self.recorder.request_tokens(p.requests[b], p.x[b, : _length(p.real[b])])
        self._log("draft.fc_in", bound["hidden_states"], p.rows(0), 0)

    def _step_state(self, p: _Pass, idx: int, state: Any) -> None:
        """A TTT step's view: what it embeds, its loss mask, and (step 0) the target's tokens."""
        p.depth = idx
        rows = p.rows(idx)
        self._log("draft.input_ids", state.input_ids, rows, idx)
        self._log("train.loss_mask", state.loss_mask.reshape(state.input_ids.shape), rows, idx)
        if idx == 0:  # row t holds position t+1's token: moved to row t+1, keyed as a target row
            tokens = state.target_token_ids
            at = tokens.new_zeros(tokens.shape)
            at[:, 1:] = tokens[:, :-1]
            self._log("target.token", at, p.target_rows(), 0)

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

    def _contract(self) -> dict:
        from importlib.metadata import version

        config = self.draft.config
        contract: dict[str, Any] = {
            "source": "training", "producer_integration": "specforge",
            "ttt_length": int(self.model.length), "attention_backend": str(self.model.attention_backend),
            "d2t_sha256": hashlib.sha256(_host(self.draft.d2t).tobytes()).hexdigest(),
            "draft_config": draft_config_summary(config),
            "d2t_reading": "offset", "draft_input_shift": 1, "draft_position_offset": 0,
            # SpecForge applies fc_norm and has no norm_before_fc: a config asking for it trains without
            "fc_norms_applied": not getattr(config, "norm_before_fc", False),
            "versions": {name: _version(version, name) for name in ("specforge", "torch", "transformers",
                                                                    "tracediff")},
        }
        if self.aux is not None:
            spec, where = self.aux
            contract.update(spec.to_dict(), aux_layer_ids_from=where)
        return contract

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
        self._stop_pass()

    def _stop_pass(self) -> None:
        self._pass = None
        if getattr(_local, "rope", None) == self._rope:
            _local.rope = None


def install(recorder: Recorder, eagle3_model: Any, *, sample_ids: Callable[[int, int], str] | None = None,
            aux_layer_ids: Sequence[int] | None = None, target_num_layers: int | None = None,
            admit: Callable[[str, Sequence[int]], bool] | None = None) -> Recording:
    """Record every forward of ``eagle3_model`` (SpecForge's ``OnlineEagle3Model``, or a DDP/FSDP
    wrapper of one). ``sample_ids(n, b)``: the request id of batch row b of recorded forward n.
    The aux layer ids go into the contract as SpecForge resolves them: ``aux_layer_ids``, else what
    SpecForge's resolver returned in this process (run override, draft config or target default;
    seen by the launcher plugin), else the draft config's ``eagle_config``, else SpecForge's default
    for ``target_num_layers``. ``admit(request, tokens)`` decides once per sample whether it is
    recorded (the launcher's --requests / --match-prefix). Raises ``SpecForgeUnsupported`` (one
    line) when this SpecForge lacks an internal the recorder needs."""
    model = check_supported(eagle3_model)
    aux = _aux(model.draft_model.config, aux_layer_ids, target_num_layers)
    return Recording(recorder, model, sample_ids, aux, admit)


def check_supported(eagle3_model: Any) -> Any:
    """The ``OnlineEagle3Model`` to hook; ``SpecForgeUnsupported`` naming what is missing."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("specforge")
    except PackageNotFoundError:
        raise SpecForgeUnsupported("specforge is not installed") from None
    where = f"SpecForge {found} (tracediff supports {', '.join(SUPPORTED_SPECFORGE)})"

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise SpecForgeUnsupported(f"{where} lacks {what}, which the recorder needs")

    try:
        model_module = importlib.import_module(MODEL_MODULE)
        adapters = importlib.import_module("specforge.core.eagle3_adapters")
        llama = importlib.import_module("specforge.modeling.draft.llama3_eagle")
        strategies = importlib.import_module("specforge.training.strategies.base")
    except ImportError as exc:
        raise SpecForgeUnsupported(f"{where}: cannot import {exc.name}") from None
    cls: Any = getattr(model_module, "OnlineEagle3Model", None)
    need(cls is not None, f"{MODEL_MODULE}.OnlineEagle3Model")
    model = eagle3_model if isinstance(eagle3_model, cls) else getattr(eagle3_model, "module", None)
    if not isinstance(model, cls):
        raise SpecForgeUnsupported(f"{type(eagle3_model).__name__} is not SpecForge's OnlineEagle3Model")
    params = inspect.signature(type(model).forward).parameters
    need(all(arg in params for arg in FORWARD_ARGS), f"OnlineEagle3Model.forward({', '.join(FORWARD_ARGS)})")
    need(callable(getattr(model, "_make_adapter", None)), "OnlineEagle3Model._make_adapter")
    need(all(hasattr(model, a) for a in ("draft_model", "length", "attention_backend")),
         "OnlineEagle3Model.draft_model / .length / .attention_backend")
    fields = getattr(getattr(adapters, "StepState", None), "__dataclass_fields__", {})
    need(all(f in fields for f in STEP_FIELDS), f"StepState fields {', '.join(STEP_FIELDS)}")
    need(callable(getattr(llama, "apply_rotary_pos_emb", None)), "llama3_eagle.apply_rotary_pos_emb")
    strategy = getattr(strategies, "Eagle3TrainStrategy", None)
    need(callable(getattr(strategy, "forward_loss", None)), "Eagle3TrainStrategy.forward_loss")
    draft = model.draft_model
    need(all(hasattr(draft, m) for m in (*DRAFT_MODULES, "d2t", "t2d", "config")),
         f"draft modules {', '.join(DRAFT_MODULES)} and d2t/t2d buffers")
    if model.attention_backend == "usp":
        raise SpecForgeUnsupported(f"{where}: attention_backend 'usp' (sequence parallel) is not supported")
    return model


def at_startup(config: Any, recorder: Callable[..., Recorder]) -> None:
    """Launcher plugin: install on every ``OnlineEagle3Model`` once SpecForge's model module is
    imported (nothing is imported here). Never raises: a problem is one warning."""
    try:
        from tracediff.record.launch import RequestGate, when_imported

        gate = RequestGate.of(config)
        admit = gate.admit if gate.active else None
        when_imported(MODEL_MODULE, lambda module: _attach_on_construction(module, recorder, admit))
        when_imported(PROVIDERS_MODULE, _note_aux_resolution)
    except Exception as exc:
        logger.warning("tracediff: the SpecForge plugin did not attach: %s: %s", type(exc).__name__, exc)


def _attach_on_construction(module: ModuleType, recorder: Callable[..., Recorder],
                            admit: Callable[[str, Sequence[int]], bool] | None) -> None:
    cls = module.OnlineEagle3Model
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            install(recorder(source="training"), self, admit=admit)
        except Exception as exc:
            logger.warning("tracediff: not recording this SpecForge model: %s", exc)

    cls.__init__ = __init__


def _note_aux_resolution(module: Any) -> None:
    """Keep the ids SpecForge's own resolver returns (run override, draft config or target default)."""
    original = module.resolve_eagle_capture_layers

    def resolve_eagle_capture_layers(*args: Any, **kwargs: Any) -> Any:
        global _resolved_aux
        layers = original(*args, **kwargs)
        _resolved_aux = list(layers)
        return layers

    module.resolve_eagle_capture_layers = resolve_eagle_capture_layers


def _aux(config: Any, explicit: Sequence[int] | None, num_layers: int | None) -> tuple[AuxSpec, str] | None:
    """SpecForge's aux ids (output of decoder layer i; its SGLang capture packs them ascending),
    and where they came from."""
    eagle = getattr(config, "eagle_config", None) or {}
    found: list[tuple[Any, str]] = [(explicit, "argument"), (_resolved_aux, "specforge_resolver"),
                                    (eagle.get("eagle_aux_hidden_state_layer_ids"), "draft_config")]
    if num_layers is not None:
        found.append(([1, num_layers // 2 - 1, num_layers - 4], "target_default"))
    for ids, where in found:
        if ids is not None:
            return AuxSpec(tuple(int(i) for i in ids), convention=OUTPUT_OF_LAYER, ascending=True), where
    return None


def _length(real: np.ndarray) -> int:
    """A right-padded row's length: its real tokens up to the first padding."""
    return len(real) if real.all() else int(real.argmin())


def _host(tensor: Any) -> np.ndarray:
    return tensor.detach().cpu().numpy()


def _version(version: Callable[[str], str], name: str) -> str | None:
    try:
        return version(name)
    except Exception:
        return None


class _ProcessPatches:
    """SpecForge functions wrapped while any recording is installed: the step notes its batch, and
    RoPE reports the positions it rotates at. Both only observe, and only for this thread."""

    def __init__(self) -> None:
        self.count = 0
        self.saved: list[tuple[Any, str, Any]] = []

    def acquire(self) -> None:
        self.count += 1
        if self.count == 1:
            llama = importlib.import_module("specforge.modeling.draft.llama3_eagle")
            strategy = importlib.import_module("specforge.training.strategies.base").Eagle3TrainStrategy
            self._wrap(llama, "apply_rotary_pos_emb", _rope_reporting)
            self._wrap(strategy, "forward_loss", _batch_noting)

    def release(self) -> None:
        self.count -= 1
        if self.count == 0:
            for owner, name, original in reversed(self.saved):
                setattr(owner, name, original)
            self.saved = []

    def _wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = owner.__dict__[name]
        self.saved.append((owner, name, original))
        setattr(owner, name, make(original))


def _rope_reporting(original: Any) -> Any:
    def apply_rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, position_ids: Any, *args: Any,
                             **kwargs: Any) -> Any:
        report = getattr(_local, "rope", None)
        if report is not None:
            report(position_ids)
        return original(q, k, cos, sin, position_ids, *args, **kwargs)

    return apply_rotary_pos_emb


def _batch_noting(original: Any) -> Any:
    def forward_loss(self: Any, batch: Any, ctx: Any = None) -> Any:
        saved = getattr(_local, "batch", None)
        try:
            _local.batch = _BatchNote(batch.tensors.get("input_ids"), list(batch.sample_ids),
                                      getattr(ctx, "global_step", None))
        except Exception:  # a batch of another shape: recorded without a note (warned at the forward)
            _local.batch = None
        try:
            return original(self, batch, ctx)
        finally:
            _local.batch = saved

    return forward_loss


_patches = _ProcessPatches()


__all__ = ["Recording", "SpecForgeUnsupported", "at_startup", "check_supported", "install"]

"""``tracediff.replay``: everything the ``replay`` command does, as one library call returning a typed
``ReplayReport`` (eagle3/replay.py computes it; this is what a user asks for, from paths).

It reads the options (which fc input: the recorded ``draft.fc_in``, or aux rebuilt from recorded layers
as ``--aux`` says), loads the draft as the chosen engine reads its config, replays every recorded
request, and with ``out`` writes the replayed draft tensors as a trace. Bad input raises ``InputError``
naming the file or option and the problem, before any long work.

    >>> import tracediff as td                                                       # doctest: +SKIP
    >>> report = td.replay("traces/eagle3/serving.h5", "traces/eagle3/draft")        # doctest: +SKIP
    >>> report.expected_accept_len                                                   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracediff.eagle3 import names as tn
from tracediff.errors import InputError
from tracediff.integrations.registry import PRODUCERS

if TYPE_CHECKING:  # torch: loaded by the call, not by ``tracediff --help``
    from tracediff.eagle3.capture import AuxSpec
    from tracediff.eagle3.replay import ReplayReport

AUX_READERS = {p.name: p.reads_aux for p in PRODUCERS if p.reads_aux}  # --aux-convention PRODUCER


def replay(trace: str | Path, draft: str | Path, *, target: str | Path | None = None,
           out: str | Path | None = None, aux: str | None = None, aux_convention: str = "output_of_layer",
           d2t: str = "offset", engine: str | None = None, depths: int | None = None, force: bool = False,
           progress: Callable[[int, int], None] | None = None, verify: bool = True) -> ReplayReport:
    """Replay draft checkpoint ``draft`` on trace ``trace``'s recorded target tensors.

    ``target``: the target checkpoint (shared embeddings and lm_head, its config for
    ``aux_convention``); ``aux``: rebuild the fc input from these target layers (``"embed,3,31"``,
    read under ``aux_convention``: ``output_of_layer``, ``input_to_layer``, or a producer's name, whose
    reading of a draft's aux ids is used); ``d2t``: ``offset`` or ``direct``; ``engine``: whose reading
    of the draft config to compute (default: the trace's); ``depths``: draft depths to unroll; ``out``:
    write the replayed tensors there (``force``: replace a regular file that is none of the inputs);
    ``progress(done, total)`` hears rows replayed; ``verify`` false reads without checking checksums.
    Raises ``InputError``."""
    from tracediff.eagle3.checkpoint import load_draft, target_embedding, target_tensor
    from tracediff.eagle3.draft_summary import draft_config_summary
    from tracediff.eagle3.readings import READINGS, engine_choice
    from tracediff.eagle3.replay import replay as replay_trace
    from tracediff.eagle3.vocab import DIRECT, OFFSET
    from tracediff.record.recorder import record
    from tracediff.trace.output import check_output, check_trace_suffix, staged_output
    from tracediff.trace.reader import open_trace

    trace, draft = Path(trace), Path(draft)
    target = None if target is None else Path(target)
    spec, ids = _aux_option(aux, aux_convention)
    if engine is not None and engine not in READINGS:
        raise InputError("--engine", f"unknown engine {engine!r}: one of {', '.join(READINGS)}")
    if d2t not in (OFFSET, DIRECT):
        raise InputError("--d2t", f"unknown d2t reading {d2t!r}: {OFFSET} or {DIRECT}")
    inputs = [trace, *checkpoint_files(draft), *(checkpoint_files(target) if target else [])]
    if out is not None:
        out = Path(out)
        check_trace_suffix(out)
        check_output(out, inputs, force)  # before the replay: it may be long
    with open_trace(trace, verify=verify) as opened, (staged_output(out, inputs, force) if out is not None
                                       else contextlib.nullcontext()) as staged:
        if ids is not None:
            spec = serving_aux(aux_convention, opened.contract, ids, target, trace)
        chosen = engine_choice(opened.engine, engine)
        model = load_draft(draft, target_embed=target_embedding(target) if target else None,
                           reading=chosen.reading,
                           target_head=target_tensor(target, "lm_head") if target else None)
        if tn.TARGET_TOKEN not in opened.names():
            raise InputError(trace, f"replay needs recorded {tn.TARGET_TOKEN}")
        if spec is None and tn.DRAFT_FC_IN not in opened.names():
            raise InputError(trace, f"replay needs recorded {tn.DRAFT_FC_IN} (or pass --aux)")
        contract = {"draft": str(draft), "aux": spec.to_dict() if spec else "recorded draft.fc_in",
                    "d2t_reading": d2t, "replayed_trace": str(trace), "draft_engine": chosen.reading.engine,
                    "draft_config": draft_config_summary(model.config.raw)}
        rec = record(staged, source="replay", meta=contract) if staged else None
        try:
            return replay_trace(opened, model, depths, spec, d2t, rec, chosen, progress)
        finally:
            if rec is not None:
                rec.close()


def _aux_option(aux: str | None, convention: str) -> tuple[AuxSpec | None, list[int] | None]:
    """``--aux`` read under ``--aux-convention``: an AuxSpec, or a producer's draft ids (resolved
    against the trace's target once it is open)."""
    from tracediff.eagle3.capture import parse_aux

    by_family = convention in AUX_READERS
    try:
        if not aux:
            return None, None
        return (None, [int(i) for i in aux.split(",")]) if by_family else (parse_aux(aux, convention), None)
    except ValueError as exc:
        raise InputError("--aux", f"--aux-convention {convention} takes a draft's ids, got {aux!r}"
                         if by_family else str(exc)) from None


def checkpoint_files(checkpoint: Path) -> list[Path]:
    """A checkpoint directory and the files in it (an output may be none of them), or the file."""
    try:
        return [checkpoint, *checkpoint.iterdir()] if checkpoint.is_dir() else [checkpoint]
    except OSError:
        return [checkpoint]


def serving_aux(producer: str, contract: dict, ids: list[int], target: Path | None, trace: Path) -> Any:
    """``--aux-convention PRODUCER``: the AuxSpec the producer feeds for ``ids`` on the trace's target."""
    from tracediff.eagle3.config import read_json_object

    config = None
    if target is not None:
        try:
            config = read_json_object(target / "config.json")  # a regular file, of a config's size
        except (OSError, ValueError) as exc:
            raise InputError(target / "config.json", f"cannot read the target's config ({exc})") from None
    try:
        spec = AUX_READERS[producer](contract, config, ids)
    except ValueError as exc:
        raise InputError("--aux", str(exc)) from None
    if spec is None:
        raise InputError(trace, f"--aux-convention {producer} needs the target's architecture and layer "
                         "count: the trace's contract states neither; pass --target DIR (its config.json)")
    return spec

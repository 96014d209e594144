"""Engines that compute the draft config differently: one side's draft ran in one engine (SGLang,
vLLM, SpecForge: ``Trace.engine``), the other's in another, and the draft config the contracts state
holds a key the two compute differently (tracediff/eagle3/readings.py: ``norm_output``,
``norm_before_fc``, vLLM's ``norm_before_residual``, ...).
A draft tensor diverging downstream of the inputs is then, first of all, that reading."""

from __future__ import annotations

from tracediff.diff.diagnose.evidence import Context
from tracediff.diff.findings import Diagnosis, EngineReadingEvidence
from tracediff.eagle3.config import DraftConfig
from tracediff.eagle3.names import DRAFT_D2T, DRAFT_FC_IN, DRAFT_INPUT_IDS, DRAFT_POSITIONS, DRAFT_T2D
from tracediff.eagle3.readings import READ_KEYS, READINGS, differences

DRAFT_INPUTS = (DRAFT_FC_IN, DRAFT_INPUT_IDS, DRAFT_POSITIONS, DRAFT_D2T, DRAFT_T2D)


def engine_readings(ctx: Context) -> list[Diagnosis]:
    first = ctx.first
    if first is None or not first.name.startswith("draft.") or first.name in DRAFT_INPUTS:
        return []
    engines = ctx.traces.map(lambda t: t.engine)
    if engines.a not in READINGS or engines.b not in READINGS or engines.a == engines.b:
        return []
    stated_by = (_stated(t.contract) for t in (ctx.traces.a, ctx.traces.b))
    both = [c for c in stated_by if isinstance(c, dict)]
    if len(both) == 2 and any(k in both[0] and k in both[1] and both[0][k] != both[1][k] for k in READ_KEYS):
        return []  # the configs differ where the readings read them: a config difference (``config``)
    stated = {**both[-1], **both[0]} if both else None  # a key one side alone states (vLLM's) kept
    try:
        config = DraftConfig.from_dict(stated) if isinstance(stated, dict) else None
    except ValueError:
        config = None
    found = [] if config is None or config.problems() else differences(config, engines.a, engines.b)
    if not found:
        return []
    a, b = READINGS[engines.a].label, READINGS[engines.b].label
    labels = ctx.labels
    evidence = EngineReadingEvidence(tensor=first.name, engine_a=a, engine_b=b, keys=[d.key for d in found],
                                     readings=[d.text for d in found])
    text = (f"{labels.a}'s draft ran in {a}, {labels.b}'s in {b}, which compute this draft config "
            f"differently: {'; and '.join(d.text for d in found)}; {first.name} diverges downstream of it "
            f"(`tracediff replay --engine {engines.a}|{engines.b}` computes the draft either way)")
    return [Diagnosis("engine_reading", text, evidence)]


def _stated(contract: dict) -> dict | None:
    """The draft config a contract states, with the ``norm_before_residual`` the vLLM producer states
    beside it (the draft config summary has no such key; only vLLM reads it)."""
    config = contract.get("draft_config")
    if not isinstance(config, dict):
        return None
    residual = contract.get("norm_before_residual")
    return config if residual is None or "norm_before_residual" in config else \
        {**config, "norm_before_residual": residual}

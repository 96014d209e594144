"""Engines that compute the draft config differently: one side's draft ran in SGLang, the other's
in SpecForge (``Trace.engine``), and the draft config the contracts state holds a key the two
compute differently (tracediff/eagle3/readings.py: ``norm_output``, ``norm_before_fc``, ...).
A draft tensor diverging downstream of the inputs is then, first of all, that reading."""

from __future__ import annotations

from tracediff.diff.diagnose.evidence import Context
from tracediff.diff.findings import Diagnosis, EngineReadingEvidence
from tracediff.eagle3.config import DraftConfig
from tracediff.eagle3.readings import READ_KEYS, READINGS, differences

DRAFT_INPUTS = ("draft.fc_in", "draft.input_ids", "draft.positions", "draft.d2t", "draft.t2d")


def engine_readings(ctx: Context) -> list[Diagnosis]:
    first = ctx.first
    if first is None or not first.name.startswith("draft.") or first.name in DRAFT_INPUTS:
        return []
    engines = ctx.traces.map(lambda t: t.engine)
    if engines.a not in READINGS or engines.b not in READINGS or engines.a == engines.b:
        return []
    stated_by = (t.contract.get("draft_config") for t in (ctx.traces.a, ctx.traces.b))
    both = [c for c in stated_by if isinstance(c, dict)]
    if len(both) == 2 and any(both[0].get(k) != both[1].get(k) for k in READ_KEYS):
        return []  # the configs differ where the readings read them: a config difference (``config``)
    stated = both[0] if both else None
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

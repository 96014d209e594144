"""The run contracts of two traces: which stated values differ, key by key (nested configs and
server arguments flattened to ``draft_config.rope_theta``), which canonical tensors each difference
can change (``CAUSES``), and whether the traces can be compared at all (different targets,
tokenizers or vocabularies make every row meaningless).

A target is what defines it, not what it is called: its config's architecture and sizes
(``target_config``, ``target_num_layers``) and a fingerprint of its input embedding
(``target_embedding_sha256``). Targets differ when a fact both sides state differs; a
``target_model`` name or path that differs is a note, never a reason (``--same-target`` overrides
the facts too, for the rare real case)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase

import numpy as np

from tracediff.diff.align import Prefixes
from tracediff.diff.pair import Pair
from tracediff.diff.results import ContractDiff, ContractEntry
from tracediff.eagle3 import names as tn
from tracediff.trace.reader import Trace

# Contract keys that, when both sides state them and they differ, make the traces incomparable.
IDENTITY = {"tokenizer_sha256": "tokenizers", "vocab_size": "vocab sizes",
            "target_vocab_size": "target vocab sizes"}
# Keys (and nested keys under them) whose difference means another target model.
TARGET_FACTS = ("target_config", "target_embedding_sha256", "target_num_layers")
TARGET_NAME = "target_model"  # a name or a path: a note when it differs
TARGETS_DIFFER = "different target models"  # how the verdict's reason starts

# Canonical tensors in data-flow order, by stage (for the table below).
TARGET_ALL = ("target.*",)
AUX = (tn.TARGET_AUX, tn.DRAFT_FC_IN, tn.DRAFT_FC_OUT)
DRAFT_AFTER_FC = (tn.DRAFT_FC_OUT, tn.DRAFT_HIDDEN, tn.DRAFT_LOGITS, tn.DRAFT_TOKEN, tn.DRAFT_TOKEN_TARGET,
                  "verify.*")
DRAFT_AFTER_ATTENTION = (tn.DRAFT_HIDDEN, tn.DRAFT_LOGITS, tn.DRAFT_TOKEN, tn.DRAFT_TOKEN_TARGET, "verify.*")
DRAFT_TOKENS = (tn.DRAFT_LOGITS, tn.DRAFT_TOKEN, tn.DRAFT_TOKEN_TARGET, tn.DRAFT_D2T, tn.DRAFT_T2D,
                "verify.*")
EVERY = ("*",)


@dataclass(frozen=True)
class Cause:
    """One row of the config-cause table: contract keys (a pattern over the flattened key's last
    part) and the canonical tensors a difference in them can change, for a draft-config key
    (``draft``) and for any other key (``other``: a target or run-wide setting). ``profile`` is the
    error profile the difference leaves on the first tensor it changes: ``grows_with_position``
    (row 0 of depth 0 untouched, error growing with position: a rotation by another angle per
    position), ``from_position_0`` (every row, from the first), or empty (none in particular)."""

    effect: str
    keys: tuple[str, ...]
    draft: tuple[str, ...]
    other: tuple[str, ...]
    profile: str = ""
    what: str = ""

    def tensors(self, key: str) -> tuple[str, ...]:
        return self.draft if key.startswith("draft_config.") else self.other

    def changes(self, key: str, tensor: str) -> bool:
        """Whether a difference in ``key`` can change canonical tensor ``tensor``."""
        return any(fnmatchcase(tensor, pattern) for pattern in self.tensors(key))


CAUSES: tuple[Cause, ...] = (
    Cause("rope", ("rope_theta", "rope_scaling", "rope_scaling.*", "rope_parameters", "rope_parameters.*",
                   "rope_type", "partial_rotary_factor", "max_position_embeddings"),
          DRAFT_AFTER_ATTENTION, EVERY, "grows_with_position",
          "the rotary positions, hence the draft's attention and everything after it"),
    Cause("positions", ("draft_position_offset",), (tn.DRAFT_POSITIONS, *DRAFT_AFTER_ATTENTION),
          (tn.DRAFT_POSITIONS, *DRAFT_AFTER_ATTENTION), "",
          "the draft's rotary positions and everything after them"),
    Cause("norm", ("rms_norm_eps", "layer_norm_eps", "norm_eps", "norm_output", "norm_before_fc", "fc_norm",
                   "fc_norms_applied", "norm_before_residual"),
          DRAFT_AFTER_FC, EVERY, "from_position_0", "the normed tensors and everything after them"),
    Cause("vocab", ("vocab_size", "draft_vocab_size", "d2t_sha256", "hot_token_id_sha256", "d2t_reading",
                    "target_logits"),
          DRAFT_TOKENS, (tn.TARGET_LOGITS, tn.TARGET_TOKEN, *DRAFT_TOKENS), "", "the logits and tokens"),
    Cause("aux", ("aux_layer_ids", "aux_layer_ids_resolved", "aux_layer_convention", "aux_sources",
                  "layers_to_capture", "aux_capture_set", "aux_capture_layers", "aux_slot_states",
                  "aux_embed_slot", "aux_ascending", "aux_layer_reading", "eagle_aux_hidden_state_layer_ids",
                  "eagle_config.*", "hidden_size", "target_hidden_size"),
          AUX + DRAFT_AFTER_FC, AUX + DRAFT_AFTER_FC, "", "the aux states and the fc input"),
    Cause("sizes", ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                    "hidden_act", "num_hidden_layers"),
          DRAFT_AFTER_ATTENTION, TARGET_ALL, "", "the layer's shapes and what it computes"),
    Cause("input", ("draft_input_shift",), (tn.DRAFT_INPUT_IDS, tn.DRAFT_EMBED, *DRAFT_AFTER_ATTENTION),
          EVERY, "", "the tokens the draft embeds"),
    Cause("precision", ("dtype", "dtypes", "dtypes.*", "torch_dtype", "kv_cache_dtype", "quantization",
                        "device", "tp_size"),
          EVERY, EVERY, "", "precision only"),
    Cause("none", ("attention_backend", "*_backend", "disable_*", "enable_*", "*cuda_graph*", "*overlap*",
                   "page_size", "tp_rank", "*_version", "versions", "versions.*", "producer*", "draft_engine",
                   "source",
                   "row_keys", "*recording_stopped", "target_model", "target_model_class", "target_family",
                   "target_layer_pattern", "log_*", "speculative_*", "num_steps",
                   "topk", "num_draft_tokens", "algorithm", "ttt_length", "aux_layer_ids_from"),
          (), (), "", "no tensor by itself"),
)
UNKNOWN = Cause("unknown", (), EVERY, EVERY, "", "what the config-cause table does not say")


def cause_of(key: str) -> Cause:
    """The table row of flattened contract key ``key`` (matched on its last part first, then on
    the part under the top-level key), or ``UNKNOWN``."""
    parts = key.split(".")
    for tail in (parts[-1], ".".join(parts[1:]), key):
        for cause in CAUSES:
            if any(fnmatchcase(tail, pattern) for pattern in cause.keys):
                return cause
    return UNKNOWN


def causes_table() -> str:
    """docs/REPORT.md's config-cause table, generated from ``CAUSES`` (checked by a test)."""
    rows = ["| effect | contract keys | can change (draft_config keys) | can change (other keys) | profile |",
            "|---|---|---|---|---|"]
    for c in CAUSES:
        def shown(tensors: tuple[str, ...]) -> str:
            return ", ".join(f"`{t}`" for t in tensors) or "nothing"
        rows.append(f"| {c.effect}: {c.what} | {', '.join(f'`{k}`' for k in c.keys)} | {shown(c.draft)} | "
                    f"{shown(c.other)} | {c.profile or '-'} |")
    return "\n".join(rows)


AGREEING = ("aux_sources",)  # resolved facts whose agreement makes differences upstream of them moot
# what aux_sources is resolved from: the ids, and how a producer read them (restatements of the states)
AUX_READING = ("aux_layer_ids", "layers_to_capture", "aux_capture_set", "aux_capture_layers",
               "aux_layer_ids_resolved", "eagle_aux_hidden_state_layer_ids", "aux_layer_convention",
               "aux_embed_slot", "aux_ascending", "aux_layer_reading")


def contract_diff(traces: Pair[Trace]) -> ContractDiff:
    """Keys whose values differ, flattened where both sides state a nested object (``draft_config.
    rope_theta``), apart from keys only one side states (kept whole at the level they differ); and
    the ``AGREEING`` facts both sides state alike."""
    diff = ContractDiff()
    for entry, side in _walk(traces.a.contract, traces.b.contract, ""):
        if side == "a":
            diff.only_a[entry.key] = entry.a
        elif side == "b":
            diff.only_b[entry.key] = entry.b
        else:
            diff.differing.append(entry)
    for key in AGREEING:
        a, b = traces.a.contract.get(key), traces.b.contract.get(key)
        if a is not None and a == b:
            diff.agreeing[key] = a
    return diff


def _walk(a: dict, b: dict, prefix: str) -> Iterator[tuple[ContractEntry, str]]:
    """(entry, "a" | "b" | "both") for every key that differs, depth first in sorted key order. A
    key stated as null states nothing (a reading that does not apply, a fact not known): it is no
    difference from any value, and no key a side states."""
    a, b = ({k: v for k, v in side.items() if v is not None} for side in (a, b))
    for key in sorted(a.keys() | b.keys(), key=str):
        name = f"{prefix}{key}"
        if key not in b:
            yield ContractEntry(name, a[key], None), "a"
        elif key not in a:
            yield ContractEntry(name, None, b[key]), "b"
        elif isinstance(a[key], dict) and isinstance(b[key], dict):
            yield from _walk(a[key], b[key], f"{name}.")
        elif a[key] != b[key]:
            yield ContractEntry(name, a[key], b[key]), "both"


def is_target_fact(key: str) -> bool:
    return any(key == fact or key.startswith(f"{fact}.") for fact in TARGET_FACTS)


def target_differences(diff: ContractDiff) -> list[ContractEntry]:
    """The target facts both sides state with different values."""
    return [e for e in diff.differing if is_target_fact(e.key)]


def name_only(diff: ContractDiff) -> bool:
    """The targets' names differ, and no fact both sides state does."""
    return any(e.key == TARGET_NAME for e in diff.differing) and not target_differences(diff)


def ignoring_target(diff: ContractDiff) -> ContractDiff:
    """``diff`` without its target facts: what the verdict reads when the user declared the targets
    the same (``--same-target``)."""
    return ContractDiff([e for e in diff.differing if not is_target_fact(e.key)], diff.only_a, diff.only_b)


def incomparable(diff: ContractDiff, prefixes: Pair[Prefixes]) -> list[str]:
    """Why no row of one trace can stand for a row of the other, one line each (empty when they can)."""
    reasons = [f"the contracts name different {IDENTITY[e.key]}: a {e.a!r}, b {e.b!r}"
               for e in diff.differing if e.key in IDENTITY]
    targets = target_differences(diff)
    if targets:
        facts = "; ".join(f"{e.key} a {e.a!r}, b {e.b!r}" for e in targets)
        reasons.insert(0, f"{TARGETS_DIFFER}: {facts} (--same-target if they are the same model)")
    if not shares_tokens(prefixes):
        reasons.append("the traces share no token prefix: their requests' tokens differ from the start")
    return reasons


def shares_tokens(prefixes: Pair[Prefixes]) -> bool:
    """Whether some request of one side starts like a request of the other (even by one token: a
    shared BOS token gives a few comparable rows, and a coverage that says how few). True when a
    side knows no tokens."""
    if not len(prefixes.a.ids) or not len(prefixes.b.ids):
        return True
    return bool(np.isin(prefixes.a.ids, prefixes.b.ids).any())


def describe_entry(entry: ContractEntry, diff: ContractDiff, declared_same: bool = False) -> str:
    """What a differing key can change, for the contract section (``rope: can change the rotary
    positions: ...``); a target name that differs says it is a name only, a target fact that the
    user declared the same target (``declared_same``) says so."""
    if entry.key == TARGET_NAME and name_only(diff):
        return "a name or a path only: no target fact the sides both state differs"
    if is_target_fact(entry.key):
        return "the target itself" + (" (declared the same target: --same-target)" if declared_same else "")
    cause = cause_of(entry.key)
    if moot(entry.key, diff):
        from tracediff.eagle3.conventions import labels

        fed = labels(diff.agreeing["aux_sources"])
        return f"{cause.effect}: both sides read them as the same states {fed}: nothing fed differs"
    return f"{cause.effect}: changes {cause.what}"


def moot(key: str, diff: ContractDiff) -> bool:
    """Whether differing key ``key`` only says how a side read what both sides state alike: aux ids
    or their reading (``AUX_READING``) where both sides state the same ``aux_sources``."""
    return key.rsplit(".", 1)[-1] in AUX_READING and "aux_sources" in diff.agreeing

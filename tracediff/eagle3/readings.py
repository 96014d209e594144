"""How each engine reads a draft's config.json: the keys two engines honour differently.
``READINGS`` is the table (one ``Reading`` per engine release); ``Reading.numerics(config)`` the
draft computation it implies; ``differences(config)`` the keys on which the engines part.

Read from the engines' own model code (kept true by tests that run SGLang's and SpecForge's real
draft classes on the same weights):

- ``norm_output``. SGLang 0.5.23 (``LlamaModel.forward`` of ``llama_eagle3.py``): absent means
  false; logits always come from the final norm; true hands the *normed* hidden state to the next
  draft step (false: the pre-norm one). SpecForge 0.2.0 (``LlamaForCausalLMEagle3``): absent means
  true; the next depth always gets the pre-norm hidden state; false takes the logits from the
  un-normed one. So ``norm_output: true`` serves differently from depth 1 on, and ``false``
  trains differently at every depth; absent, the two agree.
- ``norm_before_fc`` (top level or in ``eagle_config``): SGLang normalises the concatenated fc
  input; SpecForge has no such norm and ignores the key.
- ``fc_norm`` (SGLang also ``use_aux_norm``): a norm per aux chunk before fc, in both.
- RoPE: both read ``rope_parameters.rope_theta`` when the config has ``rope_parameters`` (as
  transformers 5 loads every config), else ``rope_theta``, default 10000.
- Embedding: SGLang embeds with the target's embedding whenever the draft's hidden size is the
  target's (``set_embed``), whatever the checkpoint holds; SpecForge with the checkpoint's.
- lm_head: SGLang ties it to the embedding under ``tie_word_embeddings``, and takes the target's
  whole lm_head when the config names no ``draft_vocab_size``; SpecForge always uses the
  checkpoint's (``draft_vocab_size`` defaults to the vocab size).
- ``d2t``: offsets in both (``target = draft + d2t[draft]``; SGLang's ``hot_token_id``).

vLLM 0.32 (``vllm/model_executor/models/llama_eagle3.py``, ``v1/spec_decode/llm_base_proposer.py``;
kept true by a test that runs vLLM's own engine on the same weights):

- ``norm_output`` as SGLang: absent means false; logits always from the final norm (the proposer
  samples ``compute_logits`` of the normed state); true hands the normed state to the next depth.
- ``norm_before_residual`` (only vLLM reads it): true feeds the attention's residual the normed
  hidden state (``hidden_norm(h)``) instead of ``h``. A plain config without the key is false; a
  speculators-format config (``speculators_model_type: eagle3``) defaults it to true
  (``vllm/transformers_utils/configs/speculators/algos.py``; ``speculators_config`` flattens one).
- ``norm_before_fc`` (``eagle_config`` first, then top level) and ``fc_norm`` (top level; not
  ``use_aux_norm``): both applied in ``combine_hidden_states``.
- RoPE: the config's ``rope_parameters`` (transformers 5), as the other two.
- Embedding: the checkpoint's ``embed_tokens`` when it has one (shared with the target only where
  it is bit for bit the target's); without one, the target's.
- lm_head: the checkpoint's, sized ``draft_vocab_size`` (absent: the vocab size); the target's only
  when the checkpoint has none. ``tie_word_embeddings`` is not read.
- ``d2t``: offsets (``compute_logits`` scatters the draft logits to ``arange + d2t`` and leaves the
  rest of the target vocab at -inf); ``t2d`` is not read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

from tracediff.eagle3.config import DraftConfig
from tracediff.eagle3.versions import SGLANG_VERSION, SPECFORGE_VERSION, VLLM_VERSION, minor
from tracediff.eagle3.vocab import OFFSET

SGLANG = "sglang"
SPECFORGE = "specforge"
VLLM = "vllm"
NAMES = {SGLANG: "SGLang", SPECFORGE: "SpecForge", VLLM: "vLLM"}
DRAFT, TARGET, EMBEDDING = "draft", "target", "embedding"  # where an embedding / lm_head comes from


@dataclass(frozen=True)
class Reading:
    """One engine release's reading of a draft config (the rules in the module docstring)."""

    engine: str
    version: str
    norm_output_default: bool
    norm_output_true_normalises_next_hidden: bool  # SGLang: the next depth gets the normed state
    norm_output_false_skips_logits_norm: bool  # SpecForge: logits from the un-normed state
    reads_norm_before_fc: bool
    fc_norm_keys: tuple[str, ...]
    embeds_with_target: bool  # the target's embedding when the hidden sizes agree
    lm_head_from_target_without_draft_vocab: bool
    ties_lm_head_to_embedding: bool  # honours tie_word_embeddings
    reads_norm_before_residual: bool = False  # vLLM: the config's norm_before_residual (absent: false)

    @property
    def label(self) -> str:
        return f"{NAMES[self.engine]} {self.version}"

    def numerics(self, config: DraftConfig) -> Numerics:
        raw = config.raw
        norm_output = self.norm_output_default if config.norm_output is None else config.norm_output
        fc_norm = config.fc_norm or any(bool(raw.get(key, False)) for key in self.fc_norm_keys)
        shares_embedding = config.target_hidden_size in (None, config.hidden_size)
        tied = self.ties_lm_head_to_embedding and bool(raw.get("tie_word_embeddings", False))
        head = EMBEDDING if tied else TARGET if (
            self.lm_head_from_target_without_draft_vocab and config.draft_vocab_size is None) else DRAFT
        return Numerics(
            next_hidden_normed=norm_output and self.norm_output_true_normalises_next_hidden,
            logits_normed=norm_output or not self.norm_output_false_skips_logits_norm,
            norm_before_fc=config.norm_before_fc and self.reads_norm_before_fc,
            fc_norm=fc_norm,
            rope_theta=config.rope_theta,
            embedding=TARGET if self.embeds_with_target and shares_embedding else DRAFT,
            lm_head=head,
            d2t_reading=OFFSET,
            norm_before_residual=self.reads_norm_before_residual and bool(raw.get("norm_before_residual",
                                                                                 False)),
        )


class Numerics(NamedTuple):
    """The draft computation one engine makes of one config."""

    next_hidden_normed: bool  # the hidden state a depth hands to the next is the final norm's output
    logits_normed: bool  # logits = lm_head(norm(h)) (else lm_head(h))
    norm_before_fc: bool  # one norm over the concatenated fc input
    fc_norm: bool  # a norm per aux chunk before fc
    rope_theta: float
    embedding: str  # DRAFT (the checkpoint's, else the target's) or TARGET (the target's when given)
    lm_head: str  # DRAFT, TARGET (the target's whole lm_head) or EMBEDDING (tied)
    d2t_reading: str
    norm_before_residual: bool = False  # the attention's residual is hidden_norm(h), not h

    @property
    def forward(self) -> tuple:
        """What the draft's forward computes differently (embedding and lm_head are weights the loader
        places; d2t is the vocab map's)."""
        return (self.next_hidden_normed, self.logits_normed, self.norm_before_fc, self.fc_norm,
                self.rope_theta, self.norm_before_residual)


READINGS: dict[str, Reading] = {
    SGLANG: Reading(SGLANG, SGLANG_VERSION, norm_output_default=False,
                    norm_output_true_normalises_next_hidden=True,
                    norm_output_false_skips_logits_norm=False, reads_norm_before_fc=True,
                    fc_norm_keys=("fc_norm", "use_aux_norm"), embeds_with_target=True,
                    lm_head_from_target_without_draft_vocab=True, ties_lm_head_to_embedding=True),
    SPECFORGE: Reading(SPECFORGE, SPECFORGE_VERSION, norm_output_default=True,
                       norm_output_true_normalises_next_hidden=False,
                       norm_output_false_skips_logits_norm=True, reads_norm_before_fc=False,
                       fc_norm_keys=("fc_norm",), embeds_with_target=False,
                       lm_head_from_target_without_draft_vocab=False, ties_lm_head_to_embedding=False),
    VLLM: Reading(VLLM, minor(VLLM_VERSION), norm_output_default=False,
                  norm_output_true_normalises_next_hidden=True,
                  norm_output_false_skips_logits_norm=False, reads_norm_before_fc=True,
                  fc_norm_keys=("fc_norm",), embeds_with_target=False,
                  lm_head_from_target_without_draft_vocab=False, ties_lm_head_to_embedding=False,
                  reads_norm_before_residual=True),
}

# What each Numerics value means, in words (``differences`` quotes them).
PHRASES: dict[str, dict[object, str]] = {
    "next_hidden_normed": {True: "hands the normed hidden state to the next draft depth",
                           False: "hands the pre-norm hidden state to the next draft depth"},
    "logits_normed": {True: "takes logits from the normed hidden state",
                      False: "takes logits from the un-normed hidden state"},
    "norm_before_fc": {True: "normalises the concatenated fc input",
                       False: "feeds fc its input un-normalised"},
    "fc_norm": {True: "normalises each aux chunk before fc", False: "skips the per-chunk fc norms"},
    "embedding": {TARGET: "embeds with the target's embedding",
                  DRAFT: "embeds with the checkpoint's embedding"},
    "lm_head": {DRAFT: "uses the checkpoint's lm_head", TARGET: "uses the target's whole lm_head",
                EMBEDDING: "ties lm_head to the embedding"},
    "norm_before_residual": {True: "adds the attention output to the normed hidden state (hidden_norm)",
                             False: "adds the attention output to the un-normed hidden state"},
}
# What to do when the engines part on a config key: make the config say one computation.
FIXES = {
    "norm_output": "drop norm_output from config.json unless the draft was trained for that engine's "
                   "reading; `tracediff replay --engine sglang|specforge` measures both",
    "norm_before_fc": "SpecForge trains without this norm: drop the key, or train with a trainer that "
                      "applies it",
    "use_aux_norm": "name the per-chunk norms fc_norm (SpecForge does not read use_aux_norm)",
    "fc_norm": "name the per-chunk norms fc_norm (SpecForge does not read use_aux_norm)",
    "embed_tokens.weight": "SGLang embeds with the target's embedding: export the draft without "
                           "embed_tokens, or with the target's",
    "draft_vocab_size": "set draft_vocab_size in config.json (SGLang then uses the checkpoint's lm_head)",
    "tie_word_embeddings": "set tie_word_embeddings false (SGLang ties lm_head to the embedding; SpecForge "
                           "trains the checkpoint's lm_head)",
    "norm_before_residual": "only vLLM reads norm_before_residual (a speculators-format config defaults it "
                            "to true): keep it only for a draft trained that way, and serve it on vLLM",
}
# The config keys the readings read (a side's stated draft config must agree on them for a
# difference of engines, not of configs, to be the cause).
READ_KEYS = ("norm_output", "norm_before_fc", "fc_norm", "use_aux_norm", "tie_word_embeddings",
             "draft_vocab_size", "norm_before_residual")
KEYS = {"next_hidden_normed": "norm_output", "logits_normed": "norm_output",
        "norm_before_fc": "norm_before_fc",
        "fc_norm": "fc_norm", "embedding": "embed_tokens.weight", "lm_head": "draft_vocab_size",
        "rope_theta": "rope_theta", "d2t_reading": "d2t", "norm_before_residual": "norm_before_residual"}


class ReadingDifference(NamedTuple):
    """A draft computation two engines make differently of one config."""

    key: str  # the config key (or weight) behind it
    field: str  # the Numerics field
    text: str  # "norm_output true: SGLang 0.5.23 hands ...; SpecForge 0.2.0 hands ..."


def differences(config: DraftConfig, a: str = SGLANG, b: str = SPECFORGE,
                checkpoint_has_embedding: bool = False) -> list[ReadingDifference]:
    """Where engines ``a`` and ``b`` compute this config's draft differently. The embedding counts
    only when the checkpoint holds its own (else both embed with the target's)."""
    ra, rb = READINGS[a], READINGS[b]
    na, nb = ra.numerics(config), rb.numerics(config)
    out = []
    for name in Numerics._fields:
        va, vb = getattr(na, name), getattr(nb, name)
        if va == vb or (name == "embedding" and not checkpoint_has_embedding):
            continue
        key = KEYS[name]
        if name == "fc_norm":
            key = next((k for k in (*ra.fc_norm_keys, *rb.fc_norm_keys) if config.raw.get(k)), key)
        if name == "lm_head" and EMBEDDING in (va, vb):
            key = "tie_word_embeddings"
        said = key if "." in key else f"{key} {_stated(config.raw, key)}"
        words = PHRASES.get(name, {})
        text = (f"{said}: {ra.label} {words.get(va, f'uses {va}')}; "
                f"{rb.label} {words.get(vb, f'uses {vb}')}")
        out.append(ReadingDifference(key, name, text))
    return out


def _stated(raw: dict, key: str) -> str:
    """A config key's value as JSON (also from ``eagle_config``), or "absent"."""
    found = raw.get("eagle_config")
    eagle: dict = found if isinstance(found, dict) else {}
    where = raw if key in raw else eagle if key in eagle else None
    return "absent" if where is None else json.dumps(where[key])


SPECULATORS_ARCHITECTURES = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}


def speculators_config(raw: dict) -> dict:
    """A speculators-format EAGLE-3 config.json (``speculators_model_type`` "eagle3", the layer's
    config under ``transformer_layer_config``) as the flat config vLLM 0.32 builds from it
    (``SpeculatorsConfig``, ``update_eagle3``): its defaults written out, ``norm_before_residual``
    true among them, and the aux ids at the top level (where only vLLM reads them). Any other config
    is returned as given. ValueError for a layer config of a model type vLLM has no EAGLE-3 draft of."""
    if not isinstance(raw, dict) or raw.get("speculators_model_type") != "eagle3":
        return raw
    layer = raw.get("transformer_layer_config")
    flat = dict(layer) if isinstance(layer, dict) else {}
    flat["draft_vocab_size"] = raw.get("draft_vocab_size")
    if raw.get("target_hidden_size") is not None:
        flat["target_hidden_size"] = raw["target_hidden_size"]
    for key, default in (("norm_before_residual", True), ("norm_before_fc", False), ("fc_norm", False),
                         ("norm_output", False)):
        flat[key] = raw.get(key, default)
    model_type = flat.get("model_type", "llama")
    if model_type not in SPECULATORS_ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r}: vLLM 0.32 has no EAGLE-3 draft of it")
    flat["architectures"] = [SPECULATORS_ARCHITECTURES[model_type]]
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        flat["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
    return flat


class EngineChoice(NamedTuple):
    """The reading a replay computes the draft with, and why that one."""

    reading: Reading
    reason: str


def engine_choice(produced_by: str | None, asked: str | None = None) -> EngineChoice:
    """``asked`` (``--engine``); else the engine that produced the trace (``Trace.engine``: a
    serving trace is computed as SGLang computes it, one whose contract says ``draft_engine``
    "vllm" as vLLM does, a SpecForge training trace as SpecForge does); else SpecForge's reading (a
    trace that names no engine: the trainer's reading)."""
    if asked is not None:
        if asked not in READINGS:
            raise ValueError(f"unknown engine {asked!r}: one of {', '.join(READINGS)}")
        return EngineChoice(READINGS[asked], "--engine")
    if produced_by in READINGS:
        return EngineChoice(READINGS[produced_by], "the engine that recorded the trace")
    return EngineChoice(READINGS[SPECFORGE], "the trace names no engine: the trainer's reading")

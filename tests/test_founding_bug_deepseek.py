"""The founding bug on a tiny DeepSeek-V3 / Kimi-K2.5-style target (MLA, MoE, a dense first layer),
with the real code on both sides: SpecForge trains the draft on [embed, layer 1, layer 3], SGLang's
DeepSeek target and EAGLE-3 draft serve it, and compare names the slots with DeepSeek's convention.

Training: HF transformers' DeepSeek-V3 gives the features (SpecForge's output-of-layer ids
``[-1, 1, 3]``, -1 the embedding), one real SpecForge step (``OnlineEagle3Model``, TTT, its loss and
optimizer) on them, recorded through the SpecForge integration. Serving: the same weights through
SGLang's ``DeepseekV3ForCausalLM`` and ``LlamaForCausalLMEagle3``, which read the ids from the
exported draft config; recorded through the SGLang integration. DeepSeek adds SGLang's +1 only when
the first id is 1: ``[2, 4, 5]`` captures the streams entering layers 2, 4, 5, i.e. the outputs of
layers 1, 3, 4 (on a Llama target the same ids would be layers 2, 4, 5), so every slot moved one
place, as in the real case ([embed, 3, 31] trained, [3, 31, 59] served). ``[0, 2, 4]`` is what
matches training on DeepSeek: the embedding, then layers 1 and 3.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import tracediff as td
from testbed.sglang_cpu import sglang_missing

REASON = sglang_missing() or (None if importlib.util.find_spec("specforge") else "specforge is not installed")
if REASON:
    pytest.skip(REASON, allow_module_level=True)

import torch  # noqa: E402

from testbed.sglang_cpu import CpuServer, tiny_checkpoint  # noqa: E402
from testbed.sglang_families import family_bed  # noqa: E402
from testbed.sglang_family_configs import LAYERS  # noqa: E402

pytestmark = pytest.mark.slow

FAMILY = "deepseek_v2"
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 301, 12], [60, 61, 9, 400, 33, 8, 150]]
NEW_TOKENS, NUM_STEPS, TTT_LENGTH = 6, 3, 3
TRAINING_IDS = (-1, 1, 3)  # SpecForge: [embed, layer 1, layer 3]
SHIFTED_IDS = (2, 4, 5)  # SGLang's DeepSeek: [layer 1, layer 3, layer 4]
MATCHING_IDS = (0, 2, 4)  # SGLang's DeepSeek: [embed, layer 1, layer 3]
DRAFT_INPUT = ("target.aux", "draft.fc_in")


def serve(work: Path, serving_ids: tuple[int, ...], out: Path) -> list[list[int]]:
    """The prompts through SGLang's DeepSeek target and an EAGLE-3 draft whose exported config says
    ``serving_ids``, recorded; returns the texts served (each prompt and its output)."""
    bed = family_bed(FAMILY)
    _, _, draft_dir, draft_weights = tiny_checkpoint(work, aux_ids=serving_ids, layers=LAYERS)
    with td.record(out, source="serving") as rec:
        server = CpuServer(bed.path, {}, draft_dir, draft_weights, num_steps=NUM_STEPS, family=FAMILY,
                           recorder=rec)
        served = server.serve(PROMPTS, NEW_TOKENS)
        server.close()
    return [prompt + output for prompt, output in zip(PROMPTS, served)]


def train(work: Path, texts: list[list[int]], out: Path) -> None:
    """HF DeepSeek-V3 features of ``texts`` for TRAINING_IDS (the target's states logged with them, as
    a trainer that computes its features logs them), then one real SpecForge step from the draft's
    same initial weights, recorded through the SpecForge integration."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    from testbed.specforge_cpu import CpuTrainer, build_draft, collate, hf_sample
    from tracediff.eagle3.canonical import RowLogger
    from tracediff.eagle3.capture import run_target
    from tracediff.integrations import specforge

    target = family_bed(FAMILY).hf
    embed = target.model.embed_tokens.weight.detach()
    ids = [f"sample{i}" for i in range(len(texts))]
    _, _, draft_dir, draft_weights = tiny_checkpoint(work, aux_ids=TRAINING_IDS, layers=LAYERS)
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    model = OnlineEagle3Model(build_draft(config, weights={**draft_weights, "embed_tokens.weight": embed}),
                              length=TTT_LENGTH)
    with td.record(out, source="training") as rec:
        samples = []
        for request, text in zip(ids, texts):
            tokens = torch.tensor(text)
            samples.append(hf_sample(target, tokens, torch.ones(len(text), dtype=torch.long), TRAINING_IDS))
            states = run_target(target, tokens[None]).states  # target.embed, target.layer.i: [1, T, H]
            logger = RowLogger(rec, request, text)
            for name, value in states.items():
                logger.log(name, value[0], range(len(text)), step=0)
        handle = specforge.install(rec, model)
        CpuTrainer(model, target.lm_head.weight.detach()).step(collate(samples, sample_ids=ids))
        handle.remove()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(training, serving) trace paths per case: the shifted ids, and the ids DeepSeek matches with."""
    paths = {}
    for case, ids in (("shifted", SHIFTED_IDS), ("matching", MATCHING_IDS)):
        out = tmp_path_factory.mktemp(case)
        serving = out / "serving.h5"
        texts = serve(out / "serve", ids, serving)
        train(out / "train", texts, out / "training.h5")
        paths[case] = out / "training.h5", serving
    return paths


def test_serving_states_what_deepseek_resolved(runs) -> None:
    """The serving contract says what SGLang's DeepSeek code resolved and the aux was measured to hold."""
    with td.open_trace(runs["shifted"][1]) as serving, td.open_trace(runs["shifted"][0]) as training:
        served, trained = serving.contract, training.contract
        assert served["target_family"] == FAMILY
        assert served["target_model_class"].endswith("DeepseekV3ForCausalLM")
        assert served["aux_layer_ids"] == list(SHIFTED_IDS)
        assert served["layers_to_capture"] == [2, 4, 5]  # no +1: the first id is not 1
        assert served["aux_slot_states"] == ["target.layer.1", "target.layer.3", "target.layer.4"]
        assert trained["aux_sources"] == ["target.embed", "target.layer.1", "target.layer.3"]
        assert (trained["producer_integration"], trained["source"]) == ("specforge", "training")


def test_shifted_slots_diverge_and_are_named_with_deepseeks_convention(runs) -> None:
    report = td.compare(*runs["shifted"])
    assert report.verdict == "diverged" and report.first_divergence.name in DRAFT_INPUT
    found = {d.kind: d.message for d in report.diagnoses}
    assert "aux_layer_set" in found, found
    assert "[embed, layer 1, layer 3]" in found["aux_layer_set"]  # trained on
    assert "[layer 1, layer 3, layer 4]" in found["aux_layer_set"]  # served, as DeepSeek resolves [2, 4, 5]
    assert "deepseek_v2" in found["aux_layer_set"] and "[2, 4, 5]" in found["aux_layer_set"]  # family, ids
    assert "[layer 2, layer 4, layer 5]" not in " ".join(found.values())  # Llama's reading of those ids


def test_ids_deepseek_resolves_to_the_training_states_match(runs) -> None:
    """The control: the same pipeline with [0, 2, 4] (embed, layers 1 and 3 on DeepSeek) finds no
    divergence in what training and serving fed the draft."""
    report = td.compare(*runs["matching"])
    assert report.first_divergence is None, report.first_divergence
    # one training step: the served chains never draft what training was fed at depth >= 1
    assert report.verdict == "incomplete" and all("no row comparable" in r for r in report.reasons)
    assert not [d for d in report.diagnoses if d.severity == "error"], report.diagnoses
    compared = {t.name: t.coverage.aligned for t in report.tensors if t.coverage is not None}
    for name in ("target.embed", "target.layer.3", "draft.fc_in", "draft.fc_out", "draft.hidden",
                 "draft.logits"):
        assert compared.get(name, 0) > 0, name  # compared row by row, not just present


"""The reference decoding loop and the TTT recorder, on tiny real models."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from testbed.loop import Conventions, SpeculativeDecoder  # noqa: E402
from testbed.train import greedy_sequences, record_ttt, ttt_pass  # noqa: E402
from tests.conftest import tiny_eagle3  # noqa: E402
from tracediff.eagle3.capture import AuxSpec, run_target  # noqa: E402
from tracediff.eagle3.config import DraftConfig  # noqa: E402

SPEC = AuxSpec((-1, 1, 2))  # [embed, layer 1, layer 2]


@pytest.fixture(scope="module")
def models():
    return tiny_eagle3()


PROMPT = [5, 77, 300, 12, 9, 41]


@pytest.mark.slow
def test_speculative_decoding_is_lossless(models) -> None:
    """Whatever the draft says, greedy speculative decoding yields the target's greedy tokens."""
    target, draft = models
    plain = greedy_sequences(target, torch.tensor([PROMPT]), 12)[0].tolist()
    for conv in (Conventions(SPEC), Conventions(AuxSpec((1, 2, 3)), d2t_reading="direct", position_offset=1)):
        out = SpeculativeDecoder(target, draft, conv, num_steps=3).decode("r", PROMPT, 12)
        assert out.tokens == plain
        assert all(0 <= a <= 3 for a in out.accept_lens) and out.accept_lens


@pytest.mark.slow
def test_serving_trace_holds_every_canonical_tensor(models, tmp_path) -> None:
    target, draft = models
    decoder = SpeculativeDecoder(target, draft, Conventions(SPEC, d2t_reading="direct"), num_steps=3)
    with td.record(tmp_path / "serve.h5", source="serving", meta=decoder.contract()) as rec:
        decoder.rec = rec
        out = decoder.decode("req-a", PROMPT, 10)
    with td.open_trace(tmp_path / "serve.h5") as trace:
        names = set(trace.names())
        assert {"target.embed", "target.layer.3", "target.aux", "target.token", "draft.fc_in", "draft.fc_out",
                "draft.input_ids", "draft.embed", "draft.hidden", "draft.logits", "draft.token",
                "draft.token_target", "verify.accept_len"} <= names
        assert trace.meta["contract"]["aux_sources"] == ["target.embed", "target.layer.1", "target.layer.2"]
        assert trace.meta["contract"]["speculative_args"]["num_draft_tokens"] == 4
        accept = trace.rows("verify.accept_len")
        assert accept.data.tolist() == out.accept_lens
        fc_in = trace.rows("draft.fc_in")
        assert fc_in.position.tolist() == list(range(len(fc_in)))  # every row extended once, in order
        assert (fc_in.depth == 0).all()
        deep = trace.rows("draft.token")
        assert sorted(set(deep.depth.tolist())) == [0, 1, 2]
        tok = trace.rows("draft.token", depth=1)
        mapped = trace.rows("draft.token_target", depth=1)
        assert np.array_equal(mapped.data, draft.d2t.numpy()[tok.data])  # the direct misreading, recorded
        # fc_in slots are the recorded target states named by the spec
        embed = trace.rows("target.embed")
        assert np.array_equal(fc_in.data[:, :64], embed.data)


@pytest.mark.slow
def test_training_and_serving_agree_row_for_row(models, tmp_path) -> None:
    """Same models, same spec: the TTT trace's depth-0 draft rows equal the serving trace's."""
    target, draft = models
    seqs = greedy_sequences(target, torch.tensor([PROMPT]), 8)
    with td.record(tmp_path / "train.h5", source="training") as rec:
        with torch.no_grad():
            record_ttt(rec, draft, ttt_pass(draft, target, seqs, SPEC, 3), seqs, ["s0"], step=0)
    decoder = SpeculativeDecoder(target, draft, Conventions(SPEC), num_steps=3)
    with td.record(tmp_path / "serve.h5", source="serving") as rec:
        decoder.rec = rec
        decoder.decode("r0", PROMPT, 8)
    with td.open_trace(tmp_path / "train.h5") as train, td.open_trace(tmp_path / "serve.h5") as serve:
        a, b = train.rows("draft.fc_in"), serve.rows("draft.fc_in")
        n = min(len(a), len(b))
        assert n > 5 and np.array_equal(a.token_id[:n], b.token_id[:n])
        assert np.array_equal(a.position[:n], b.position[:n])
        assert np.allclose(a.numpy()[:n], b.numpy()[:n], atol=1e-5)
        la, lb = train.rows("draft.logits", depth=0), serve.rows("draft.logits", depth=0)
        assert np.allclose(la.numpy()[:n], lb.numpy()[:n], atol=1e-4)
        depth2 = train.rows("draft.input_ids", depth=2)
        assert depth2.data.tolist() == seqs[0, 3 : 3 + len(depth2)].tolist()  # teacher forcing: x[t+1+d]


def test_wrong_aux_changes_what_the_draft_is_fed(models) -> None:
    target, _ = models
    states = run_target(target, torch.tensor([PROMPT]))
    good, bad = states.aux(SPEC), states.aux(AuxSpec((1, 2, 3)))
    assert torch.equal(good[..., 64:], bad[..., :128])  # slots shifted by one layer
    assert AuxSpec((2, 3), convention="input_to_layer", embed_slot=True).sources() == [
        "target.embed", "target.layer.1", "target.layer.2"]
    assert AuxSpec((3, 1), ascending=True).sources() == ["target.layer.1", "target.layer.3"]


def test_skipping_the_fc_norm_is_a_convention(models) -> None:
    target, _ = models
    from tests.test_eagle3_draft import random_draft

    config = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         vocab_size=512, draft_vocab_size=256, max_position_embeddings=128,
                         aux_layer_ids=(1, 2, 3), fc_norm=True)
    draft = random_draft(config)
    fc_out = {}
    for norms in (True, False):
        decoder = SpeculativeDecoder(target, draft, Conventions(SPEC, fc_norms=norms), num_steps=2)
        captured: list = []
        handle = draft.fc.register_forward_hook(lambda m, a, out, seen=captured: seen.append(out))
        decoder.decode("r", PROMPT, 3)
        handle.remove()
        fc_out[norms] = captured[0]
        assert decoder.contract()["fc_norms_applied"] is norms
    assert not torch.allclose(fc_out[True], fc_out[False], atol=1e-3)


def test_draft_position_offset_is_a_convention(models, tmp_path) -> None:
    """Chain drafts one position late (a serving bug): depth 0 unchanged, deeper logits differ."""
    target, draft = models
    logits = {}
    for offset in (0, 1):
        decoder = SpeculativeDecoder(target, draft, Conventions(SPEC, position_offset=offset), num_steps=3)
        with td.record(tmp_path / f"off{offset}.arrow", meta=decoder.contract()) as rec:
            decoder.rec = rec
            decoder.decode("r", PROMPT, 3)
        with td.open_trace(tmp_path / f"off{offset}.arrow") as trace:
            logits[offset] = [trace.rows("draft.logits", step=0, depth=d).numpy() for d in (0, 1)]
            assert trace.meta["contract"]["draft_position_offset"] == offset
    assert np.array_equal(logits[0][0], logits[1][0])
    assert not np.allclose(logits[0][1], logits[1][1], atol=1e-3)

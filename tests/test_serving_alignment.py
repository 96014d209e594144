"""A serving-shaped trace against a training-shaped one, from a real (tiny) HF Llama: a prefix-cache
hit, a left-padded batch, decode recorded every other step, a request joining mid-batch. Every
comparable row aligns and the verdict is `match`; with one fault injected, compare names the tensor
and the cause."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from tests.conftest import tiny_llama  # noqa: E402

PROMPTS = {"q0": [5, 77, 300, 12, 9, 41], "q3": [60, 61], "q2": [5, 77, 300, 400, 401, 402],
           "q1": [17, 3, 250, 88]}
DECODE = 6  # tokens generated per request
JOINS = {"q0": 0, "q3": 0, "q2": 0, "q1": 2}  # the step a request enters the batch
AUX = (0, 1, 2)  # target layers concatenated into target.aux
pytestmark = pytest.mark.slow  # a batched serving run of a real tiny Llama: ~4 s


def log_states(rec, hidden, aux, **keys) -> None:
    """target.embed, target.layer.i and target.aux from HF hidden_states ([B, T, H] each)."""
    rec.log("target.embed", hidden[0], **keys)
    for i in range(len(hidden) - 2):  # the last state is after the final norm: not a layer output
        rec.log(f"target.layer.{i}", hidden[i + 1], **keys)
    rec.log("target.aux", torch.cat([hidden[i + 1] for i in aux], dim=-1), **keys)


@torch.no_grad()
def serve(model, path, aux=AUX) -> dict[str, list[int]]:
    """Greedy decoding as a server would run it; returns every request's full token list."""
    tokens = {r: list(p) for r, p in PROMPTS.items()}
    with td.record(path, source="serving", every=2) as rec:
        # step 0: q0 and q3 prefilled as one left-padded batch
        width = max(len(PROMPTS[r]) for r in ("q0", "q3"))
        ids = torch.tensor([[0] * (width - len(PROMPTS[r])) + PROMPTS[r] for r in ("q0", "q3")])
        mask = (torch.arange(width) >= width - torch.tensor([[len(PROMPTS[r])] for r in ("q0", "q3")])).long()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = model(ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    output_hidden_states=True)
        log_states(rec, out.hidden_states, aux, step=0, token_ids=ids, attention_mask=mask,
                   request=["q0", "q3"])
        batch = {"rids": ["q0", "q3"], "cache": out.past_key_values, "mask": mask,
                 "next": out.logits[:, -1].argmax(-1), "pos": positions[:, -1] + 1}
        # step 0: q2 shares q0's first 3 tokens, which the prefix cache holds: prefill from position 3
        cached = model(torch.tensor([PROMPTS["q2"][:3]]), use_cache=True)
        out = model(torch.tensor([PROMPTS["q2"][3:]]), past_key_values=cached.past_key_values,
                    position_ids=torch.arange(3, 6)[None], use_cache=True, output_hidden_states=True)
        log_states(rec, out.hidden_states, aux, step=0, token_ids=[PROMPTS["q2"][3:]], positions=[[3, 4, 5]],
                   request="q2")
        alone = {"q2": (out.past_key_values, out.logits[0, -1].argmax(), 6)}
        for step in range(1, DECODE + JOINS["q1"] + 1):
            if step == JOINS["q1"]:  # q1 joins the running batch
                out = model(torch.tensor([PROMPTS["q1"]]), use_cache=True, output_hidden_states=True)
                log_states(rec, out.hidden_states, aux, step=step, token_ids=[PROMPTS["q1"]], request="q1")
                alone["q1"] = (out.past_key_values, out.logits[0, -1].argmax(), len(PROMPTS["q1"]))
                continue
            if len(tokens["q0"]) < len(PROMPTS["q0"]) + DECODE:
                for rid, t in zip(batch["rids"], batch["next"].tolist()):
                    tokens[rid].append(t)
                batch["mask"] = torch.cat([batch["mask"], torch.ones(2, 1, dtype=torch.long)], dim=1)
                out = model(batch["next"][:, None], attention_mask=batch["mask"],
                            position_ids=batch["pos"][:, None], past_key_values=batch["cache"],
                            use_cache=True, output_hidden_states=True)
                log_states(rec, out.hidden_states, aux, step=step, token_ids=batch["next"][:, None],
                           positions=batch["pos"][:, None], request=batch["rids"])
                batch.update(cache=out.past_key_values, next=out.logits[:, -1].argmax(-1),
                             pos=batch["pos"] + 1)
            for rid, (cache, nxt, pos) in list(alone.items()):
                if len(tokens[rid]) >= len(PROMPTS[rid]) + DECODE:
                    continue
                tokens[rid].append(int(nxt))
                out = model(nxt.view(1, 1), past_key_values=cache, position_ids=torch.tensor([[pos]]),
                            use_cache=True, output_hidden_states=True)
                log_states(rec, out.hidden_states, aux, step=step, token_ids=[[int(nxt)]], positions=[[pos]],
                           request=rid)
                alone[rid] = (out.past_key_values, out.logits[0, -1].argmax(), pos + 1)
        for rid, full in tokens.items():
            rec.request_tokens(rid, full)  # what a server knows of each request: prompt + output
    return tokens


@torch.no_grad()
def train(model, path, tokens: dict[str, list[int]]) -> None:
    """One sample at a time over the full token lists, as a training step sees them."""
    with td.record(path, source="training") as rec:
        for k, (_, full) in enumerate(sorted(tokens.items())):
            out = model(torch.tensor([full]), output_hidden_states=True)
            log_states(rec, out.hidden_states, AUX, step=k, token_ids=[full], request=f"sample{k}")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    model = tiny_llama(seed=0, layers=4)
    root = tmp_path_factory.mktemp("serving")
    tokens = serve(model, root / "serving.h5")
    train(model, root / "training.h5", tokens)
    serve(model, root / "serving_bug.h5", aux=(2, 0, 1))  # aux layers in another order
    return root


def test_every_comparable_serving_row_aligns_and_matches(traces) -> None:
    report = td.compare(traces / "training.h5", traces / "serving.h5")
    assert report.verdict == "match", report.reasons
    for t in report.tensors:
        c = t.coverage
        assert c.fraction == 1.0 and t.status == "match", (t.name, c)
        # prompt rows, and decode rows of the even steps; 4 padded rows; nothing unknown
        assert c.skipped_b == {"padding": 4}, (t.name, c.skipped_b)
        # training ran positions 0-2 of q0's prompt twice (q0 and q2), serving once (then cached):
        # both training copies are compared with serving's one
        assert c.aligned == c.rows_b - 4 + 3 and set(c.skipped_a) == {"not_recorded"}
    with td.open_trace(traces / "serving.h5") as serving:
        assert len(set(serving.request_tokens().request.tolist())) == 4


def test_one_fault_is_named_with_its_cause(traces) -> None:
    report = td.compare(traces / "training.h5", traces / "serving_bug.h5")
    assert report.verdict == "diverged" and report.first_divergence.name == "target.aux"
    assert [d.kind for d in report.diagnoses] == ["aux_order"]
    evidence = report.diagnoses[0].evidence
    assert evidence.slots_b == ["target.layer.2", "target.layer.0", "target.layer.1"]
    assert report.coverage.fraction == 1.0

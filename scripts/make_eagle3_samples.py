"""Build the EAGLE-3 sample under traces/eagle3/ from fixed seeds, on CPU, in about two minutes.

    python scripts/make_eagle3_samples.py [--out traces/eagle3]

1. target/: a tiny Llama (6 layers, hidden 64, vocab 1024) trained on a rule the draft can only
   get from the target's states (x[t+1] = perm[x[t-1]]), saved with save_pretrained (safetensors).
2. draft/: an EAGLE-3 draft trained with SpecForge-style TTT on the target's greedy text, fed
   [embed, layer 1, layer 3]; exported without embeddings (shared from the target). Its
   config.json says aux layers [1, 3, 5], as in the real-world case.
3. training.h5: the TTT pass over held-out text; serving.h5: the reference loop wired like
   training; serving_aux_bug.h5: the loop fed [layer 1, layer 3, layer 5] (the config's list).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/ and tracediff/ from this checkout

import tracediff as td  # noqa: E402
from testbed.loop import Conventions, SpeculativeDecoder  # noqa: E402
from testbed.train import depth_accuracy, greedy_sequences, record_ttt, train_draft, ttt_pass  # noqa: E402
from tracediff.eagle3.capture import AuxSpec  # noqa: E402
from tracediff.eagle3.checkpoint import save_draft  # noqa: E402
from tracediff.eagle3.config import DraftConfig  # noqa: E402
from tracediff.eagle3.draft import Eagle3Draft  # noqa: E402
from tracediff.eagle3.vocab import build_vocab_map  # noqa: E402

VOCAB, DRAFT_VOCAB, HIDDEN, LAYERS, TTT_LENGTH, NUM_STEPS = 1024, 768, 64, 6, 4, 4
TRAINING_AUX = AuxSpec((-1, 1, 3))  # [embed, layer 1, layer 3]
CONFIG_AUX = (1, 3, 5)


def rule_batch(perm: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.empty(n, length, dtype=torch.long)
    x[:, :2] = torch.randint(0, VOCAB, (n, 2), generator=gen)
    for t in range(2, length):
        x[:, t] = perm[x[:, t - 2]]
    return x


def train_target(steps: int = 400) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        x = rule_batch(perm, 32, 32, gen)
        loss = model(x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def train_eagle3(target, seqs: torch.Tensor, epochs: int = 12) -> Eagle3Draft:
    counts = np.bincount(seqs[:, 1:].reshape(-1).numpy(), minlength=VOCAB)
    d2t, t2d = build_vocab_map(counts, DRAFT_VOCAB)
    config = DraftConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=2 * HIDDEN, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB,
                         max_position_embeddings=256, aux_layer_ids=CONFIG_AUX)
    torch.manual_seed(0)
    draft = Eagle3Draft(config, embed_tokens=target.model.embed_tokens.weight.detach())
    draft.d2t.copy_(torch.from_numpy(d2t))
    draft.t2d.copy_(torch.from_numpy(t2d))
    train_draft(draft, target, list(seqs.split(16)), TRAINING_AUX, TTT_LENGTH, epochs=epochs)
    return draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "traces" / "eagle3")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same float sums on every machine
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    target = train_target()
    target.save_pretrained(out / "target")
    prompts = torch.randint(0, VOCAB, (1024 + 3, 4), generator=torch.Generator().manual_seed(1))
    seqs = greedy_sequences(target, prompts, 24)
    train_seqs, held_out = seqs[:1024], seqs[1024:]
    draft = train_eagle3(target, train_seqs)
    save_draft(draft, out / "draft", with_embeddings=False)
    figures = {}
    with torch.no_grad():
        ttt = ttt_pass(draft, target, held_out, TRAINING_AUX, TTT_LENGTH)
        figures["training_acc_per_depth"] = depth_accuracy(draft, ttt)
        contract = {"target_model": "tiny-llama-6L-64H-rule (seed 0)", **TRAINING_AUX.to_dict(),
                    "draft_config": draft.config.to_dict()}
        with td.record(out / "training.h5", source="training", meta=contract) as rec:
            record_ttt(rec, draft, ttt, held_out, [f"sample{i}" for i in range(len(held_out))], step=0)
        for name, aux in (("serving", TRAINING_AUX), ("serving_aux_bug", AuxSpec(CONFIG_AUX))):
            decoder = SpeculativeDecoder(target, draft, Conventions(aux), num_steps=NUM_STEPS)
            accepts = []
            with td.record(out / f"{name}.h5", source="serving", meta=decoder.contract()) as rec:
                decoder.rec = rec
                for i, seq in enumerate(held_out):
                    accepts += decoder.decode(f"req{i}", seq[:4].tolist(), 20).accept_lens
            figures[f"{name}_mean_accept_len"] = 1 + float(np.mean(accepts))
    (out / "figures.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()

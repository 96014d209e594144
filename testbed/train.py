"""SpecForge-style TTT on CPU for tiny models: the training side of our sample traces.

Row t of a sequence uses aux(t) and embed(x[t+1]); at depth d it predicts the target's token at
position t + 1 + d (teacher forcing: depth d is fed the true tokens x[t+1+d]). Loss weight 0.8**d.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tracediff.eagle3.canonical import RowLogger, log_vocab_map
from tracediff.eagle3.capture import AuxSpec, TargetStates, run_target
from tracediff.eagle3.draft import DepthResult, Eagle3Draft
from tracediff.record.recorder import Recorder

DEPTH_DECAY = 0.8


@torch.no_grad()
def greedy_sequences(target: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Prompts [B, P] continued greedily by the target: the text a server would produce."""
    seqs = prompts
    for _ in range(new_tokens):
        seqs = torch.cat([seqs, target(seqs).logits[:, -1:].argmax(-1)], dim=1)
    return seqs


@dataclass
class TTTPass:
    """One teacher-forced pass over a batch: what the target said, what the draft said."""

    states: TargetStates
    spec: AuxSpec
    fc_in: torch.Tensor  # [B, L-1, K*H]
    depths: list[DepthResult]  # each [B, L-1, ...]
    target_tokens: torch.Tensor  # [B, L]: the target's prediction for the next position

    def labels(self, depth: int) -> torch.Tensor:
        """Target tokens that rows 0..L-2-depth predict at ``depth``."""
        return self.target_tokens[:, 1 + depth :]

    def rows(self, depth: int) -> int:
        return self.target_tokens.shape[1] - 1 - depth


def ttt_pass(draft: Eagle3Draft, target: torch.nn.Module, seqs: torch.Tensor, spec: AuxSpec,
             length: int) -> TTTPass:
    with torch.no_grad():
        states = run_target(target, seqs)
    fc_in = states.aux(spec)[:, :-1]
    depths = draft.unroll(fc_in, seqs[:, 1:], length)
    return TTTPass(states=states, spec=spec, fc_in=fc_in, depths=depths,
                   target_tokens=states.logits.argmax(-1))


def depth_accuracy(draft: Eagle3Draft, ttt: TTTPass) -> list[float]:
    """SpecForge's training 'acc' per depth: argmax(draft) + d2t == argmax(target), valid rows only."""
    accs = []
    for depth, result in enumerate(ttt.depths):
        n = ttt.rows(depth)
        predicted = draft.to_target(result.logits[:, :n].argmax(-1))
        accs.append(float((predicted == ttt.labels(depth)).float().mean()))
    return accs


def ttt_loss(draft: Eagle3Draft, ttt: TTTPass) -> torch.Tensor:
    """Cross-entropy against the target's token in draft-vocab space; rows whose token is not in the
    draft vocab are left out; depth d weighs 0.8**d."""
    draft_index = torch.cumsum(draft.t2d.long(), 0) - 1
    total = torch.zeros((), device=draft.t2d.device)
    for depth, result in enumerate(ttt.depths):
        n = ttt.rows(depth)
        labels = ttt.labels(depth)
        keep = draft.t2d[labels]
        logits = result.logits[:, :n][keep]
        if len(logits):
            loss = torch.nn.functional.cross_entropy(logits, draft_index[labels][keep])
            total = total + DEPTH_DECAY**depth * loss
    return total


def train_draft(draft: Eagle3Draft, target: torch.nn.Module, batches: Sequence[torch.Tensor], spec: AuxSpec,
                length: int, epochs: int = 1, lr: float = 3e-3) -> list[list[float]]:
    """Train in place (embeddings frozen, as SpecForge does); returns per-step depth accuracies."""
    draft.embed_tokens.weight.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    history = []
    draft.train()
    for _ in range(epochs):
        for seqs in batches:
            ttt = ttt_pass(draft, target, seqs, spec, length)
            loss = ttt_loss(draft, ttt)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            history.append(depth_accuracy(draft, ttt))
    draft.eval()
    return history


def record_ttt(rec: Recorder, draft: Eagle3Draft, ttt: TTTPass, seqs: torch.Tensor, requests: Sequence[str],
               step: int) -> None:
    """Log one TTT pass with canonical names, one request per batch row (target rows: every position)."""
    log_vocab_map(rec, draft.d2t, draft.t2d)
    for b, request in enumerate(requests):
        logger = RowLogger(rec, request, seqs[b].tolist())
        states = TargetStates(states={k: v[b : b + 1] for k, v in ttt.states.states.items()},
                              logits=ttt.states.logits[b : b + 1])
        logger.target(states, range(seqs.shape[1]), step, states.aux(ttt.spec))
        for depth, result in enumerate(ttt.depths):
            n = ttt.rows(depth)
            sliced = DepthResult(embed=result.embed[b : b + 1, :n], hidden=result.hidden[b : b + 1, :n],
                                 logits=result.logits[b : b + 1, :n],
                                 fc_out=None if result.fc_out is None else result.fc_out[b : b + 1, :n])
            ids = seqs[b : b + 1, 1 + depth : 1 + depth + n]
            logger.draft(sliced, ids, range(n), step, depth, draft.to_target,
                         fc_in=ttt.fc_in[b : b + 1, :n] if depth == 0 else None)

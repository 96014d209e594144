"""A reference EAGLE-3 speculative decoding loop in plain torch (CPU), our stand-in for a server.

Chain drafting (topk = 1): target prefill, the draft extends its depth-0 rows and drafts
``num_steps`` tokens from the last row, the target verifies, the longest agreeing prefix plus the
target's own next token is accepted, repeat. Every convention a server can get wrong is a field
of ``Conventions``, so the same loop plays a healthy server and a misconfigured one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from tracediff.eagle3.canonical import RowLogger, log_vocab_map
from tracediff.eagle3.capture import AuxSpec, run_target
from tracediff.eagle3.draft import DraftKV, Eagle3Draft, to_target_fn
from tracediff.eagle3.vocab import OFFSET
from tracediff.integrations.target_summary import target_identity
from tracediff.record.recorder import Recorder


@dataclass(frozen=True)
class Conventions:
    """How a producer wires the draft to the target."""

    aux: AuxSpec
    d2t_reading: str = OFFSET  # "direct" is the classic misreading: target = d2t[draft]
    position_offset: int = 0  # chain drafts (depth >= 1) at RoPE position row + depth + offset (TTT: +0)
    fc_norms: bool = True  # False: the engine skips the checkpoint's norm_before_fc / fc_norm
    input_shift: int = 1  # depth-0 row t embeds token t + input_shift (0: ids not shifted left)

    def to_dict(self) -> dict:
        return {**self.aux.to_dict(), "d2t_reading": self.d2t_reading,
                "draft_position_offset": self.position_offset, "fc_norms_applied": self.fc_norms,
                "draft_input_shift": self.input_shift}


def d2t_sha256(draft: Eagle3Draft) -> str:
    return hashlib.sha256(draft.d2t.cpu().numpy().tobytes()).hexdigest()


@dataclass
class Decoded:
    request: str
    tokens: list[int]
    prompt_len: int
    accept_lens: list[int] = field(default_factory=list)

    @property
    def mean_accept(self) -> float:
        """Tokens gained per target verify: accepted drafts + the target's own token."""
        return 1 + sum(self.accept_lens) / max(1, len(self.accept_lens))


class SpeculativeDecoder:
    """Greedy EAGLE-3 decoding of one request at a time; records every canonical tensor."""

    def __init__(self, target: torch.nn.Module, draft: Eagle3Draft, conventions: Conventions,
                 num_steps: int = 4, rec: Recorder | None = None) -> None:
        self.target, self.draft, self.conv = target, draft, conventions
        self.num_steps, self.rec = num_steps, rec
        self.to_target = to_target_fn(draft, conventions.d2t_reading)
        self.step = 0

    def contract(self) -> dict:
        """What this decoder resolved, for the trace's metadata."""
        return {**self.conv.to_dict(), "draft_config": self.draft.config.to_dict(),
                "d2t_sha256": d2t_sha256(self.draft), **target_identity(self.target),
                "speculative_args": {"algorithm": "EAGLE3", "num_steps": self.num_steps, "topk": 1,
                                     "num_draft_tokens": self.num_steps + 1}}

    @torch.no_grad()
    def decode(self, request: str, prompt: list[int], max_new_tokens: int, cached: int = 0) -> Decoded:
        """``cached``: positions [0, cached) of the prompt are a prefix-cache hit (a radix cache):
        the target and the draft computed them for an earlier request, so this request's rows start
        at ``cached``. Its whole token sequence is declared, as a server knows it."""
        log_vocab_map(self.rec, self.draft.d2t, self.draft.t2d)
        x = list(prompt)
        states = run_target(self.target, torch.tensor([x]))
        x.append(int(states.logits[0, -1].argmax()))
        out = Decoded(request=request, tokens=x, prompt_len=len(prompt))
        cache, pending = DraftKV(), 0  # draft rows [pending, len(x) - 1) still need depth 0
        while len(x) - len(prompt) < max_new_tokens:
            rows = list(range(pending, len(x) - 1))
            logger = RowLogger(self.rec, request, x, first_row=cached)
            aux = states.aux(self.conv.aux)
            logger.target(states, rows, self.step, aux)
            drafts = self._draft(logger, aux, x, rows, cache)
            states = run_target(self.target, torch.tensor([x + drafts]))
            predicted = states.logits[0, len(x) - 1 :].argmax(-1).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == predicted[accepted]:
                accepted += 1
            logger.log("verify.accept_len", torch.tensor([accepted]), [rows[-1]], self.step)
            out.accept_lens.append(accepted)
            pending = len(x) - 1
            x.extend(drafts[:accepted] + [predicted[accepted]])
            self.step += 1
        del x[len(prompt) + max_new_tokens :]
        if self.rec is not None:
            self.rec.request_tokens(request, x)
        return out

    def _draft(self, logger: RowLogger, aux: torch.Tensor, x: list[int], rows: list[int],
               cache: DraftKV) -> list[int]:
        """Extend depth 0 over ``rows`` (row t: aux(t), embed(x[t+1])), then chain from the last row."""
        fc_in = aux[:, rows]
        ids = torch.tensor([[x[t + self.conv.input_shift] for t in rows]])
        positions = torch.tensor([rows])
        fc_out = self.draft.project(fc_in, norms=self.conv.fc_norms)
        result = self.draft.step(ids, fc_out, positions, cache, depth=0)
        result.fc_out = fc_out
        logger.draft(result, ids, rows, self.step, 0, self.to_target, fc_in=fc_in)
        anchor = rows[-1]
        token = int(self.to_target(result.logits[0, -1].argmax()))
        drafts, hidden = [token], result.hidden[:, -1:]
        for depth in range(1, self.num_steps):
            ids = torch.tensor([[token]])
            position = torch.tensor([[anchor + self.conv.position_offset]])
            result = self.draft.step(ids, hidden, position, cache, depth)
            logger.draft(result, ids, [anchor], self.step, depth, self.to_target,
                         rope_positions=[anchor + depth + self.conv.position_offset])
            token = int(self.to_target(result.logits[0, -1].argmax()))
            drafts.append(token)
            hidden = result.hidden
        cache.chain.clear()  # draft tokens' keys are speculative: only depth-0 keys persist
        return drafts

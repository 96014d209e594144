"""The canonical tensor names of an EAGLE-3 trace: one home, imported wherever a name is meant.

A producer records under these names and compare, replay, explain and the reports read them; any
other dotted name may be recorded too (it is compared as data, without EAGLE-3 meaning). The trace
format itself (trace/) knows no name: these are this package's vocabulary.
"""

from __future__ import annotations

TARGET_EMBED = "target.embed"
TARGET_AUX = "target.aux"
TARGET_LOGITS = "target.logits"
TARGET_FINAL_HIDDEN = "target.final_hidden"
TARGET_TOKEN = "target.token"
TRAIN_LOSS_MASK = "train.loss_mask"
DRAFT_POSITIONS = "draft.positions"
DRAFT_INPUT_IDS = "draft.input_ids"
DRAFT_EMBED = "draft.embed"
DRAFT_FC_IN = "draft.fc_in"
DRAFT_FC_OUT = "draft.fc_out"
DRAFT_HIDDEN = "draft.hidden"
DRAFT_LOGITS = "draft.logits"
DRAFT_TOKEN = "draft.token"
DRAFT_TOKEN_TARGET = "draft.token_target"
VERIFY_ACCEPT_LEN = "verify.accept_len"
DRAFT_D2T = "draft.d2t"
DRAFT_T2D = "draft.t2d"
TARGET_LAYER = "target.layer.{i}"  # the stream after decoder layer i (0-based, HF's hidden_states[i + 1])


def target_layer(i: int) -> str:
    """The name of the stream after target decoder layer ``i``."""
    return f"target.layer.{i}"


CANONICAL_NAMES: dict[str, str] = {
    TARGET_EMBED: "target embedding output (input to decoder layer 0)",
    TARGET_LAYER: "output of target decoder layer i (0-based, HF convention)",
    TARGET_AUX: "concatenated aux hidden states handed to the draft [rows, K*H]",
    TARGET_LOGITS: "target logits",
    TARGET_FINAL_HIDDEN: "the target's last hidden state, after its final norm (HF hidden_states[-1])",
    TRAIN_LOSS_MASK: "1 where a training row counts in the loss",
    TARGET_TOKEN: "token the target chose at this row",
    DRAFT_POSITIONS: "RoPE positions the draft ran at",
    DRAFT_INPUT_IDS: "token ids fed to the draft",
    DRAFT_EMBED: "draft embedding of draft.input_ids",
    DRAFT_FC_IN: "input of the draft fc layer [rows, K*H] (depth 0 only)",
    DRAFT_FC_OUT: "output of the draft fc layer [rows, Hd]",
    DRAFT_HIDDEN: "pre-norm draft output, fed to the next depth",
    DRAFT_LOGITS: "draft logits over the draft vocab",
    DRAFT_TOKEN: "draft token id (draft vocab)",
    DRAFT_TOKEN_TARGET: "draft token mapped into the target vocab",
    VERIFY_ACCEPT_LEN: "accepted draft tokens per verify step",
    DRAFT_D2T: "static: the draft's d2t offsets [Vd] (target id = draft id + d2t[draft id])",
    DRAFT_T2D: "static: the draft's t2d mask [V] (True for target ids in the draft vocab)",
}

# Draft tensors whose depth-0 row t depends on the target's states at t alone (x[0..t]); every other
# draft.* / verify.* tensor also depends on the token fed to the draft there (x[t + 1]), and every row
# at depth > 0 on its chain's fed tokens. Other names (target.*, foreign names) depend on x[0..t].
TARGET_FED_DRAFT = frozenset({DRAFT_FC_IN, DRAFT_FC_OUT, DRAFT_POSITIONS})


def reads_fed_token(name: str) -> bool:
    """Whether depth-0 rows of ``name`` depend on the token fed to the draft at their row (x[t + 1])."""
    return name.startswith(("draft.", "verify.")) and name not in TARGET_FED_DRAFT

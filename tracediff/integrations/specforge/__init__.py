"""Recording SpecForge 0.2.0's EAGLE-3 training: ``install(recorder, eagle3_model)`` on a real
``OnlineEagle3Model``, or ``tracediff record --out train.h5 -- python train.py ...`` with this
package as a launcher plugin (``at_startup``), which installs on every ``OnlineEagle3Model`` built.

Per forward (one training step) and TTT step ``depth`` it logs the canonical names of
docs/FORMAT.md. How SpecForge lays rows out (read from its code, checked by the tests):

- Its step (``Eagle3TrainStrategy.forward_loss`` -> ``TargetHead.preprocess``) shifts ``input_ids``
  and the target left by one before ``OnlineEagle3Model.forward``: row t holds aux(t), embeds x[t+1],
  and the target logits of position t+1. ``loss_mask`` is not shifted.
- TTT step d shifts ids, loss mask and position mask left d times more (zeros come in): row t
  embeds x[t+1+d], counts by loss_mask[t+d], and learns the target's token at position t+1+d.
- RoPE: every attention backend rotates at ``position_ids + lck``, lck = the number of earlier TTT
  steps, so row t runs at position t + d. ``draft.positions`` holds the ids SpecForge passed to
  ``apply_rotary_pos_emb``, caught at the call.

Row keys: row t of a sample carries (request, t, x[t]) at every depth (the anchor's key); rows on
padding, and rows fed a token past the sample's end (t+1+d >= its length: SpecForge embeds the
zeros it shifted in), get position -1. ``target.token`` is logged as target rows: row p holds the
target's argmax at position p (p >= 1; position 0's logits are shifted out before the step).

The forward sees x shifted, so x[0] comes from the step: while a recording is installed,
``Eagle3TrainStrategy.forward_loss`` notes its batch (unshifted ids, ``sample_ids``, the trainer's
``global_step``) for the forward it runs. A custom loop calling the model itself says
``handle.next_batch(input_ids)``; a forward with neither is not recorded (warned once). Requests
are the ``sample_ids`` callable's ids, else SpecForge's ``TrainBatch.sample_ids``, else
``batch{n}.row{b}`` (n counts this handle's recorded forwards, b the batch row).

Modules: ``guard`` (the version guard), ``recording`` (``install`` and its hooks), ``patches`` (the
SpecForge functions observed while recording), ``contract`` (what the trace states), ``plugin`` (the
launcher's start-up plugin), ``importer`` (``tracediff import specforge-ckpt``), ``producer`` (what
the launcher and the CLI know of SpecForge). The names below load on first use: the CLI imports
``producer`` without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracediff.integrations.specforge.guard import SpecForgeUnsupported, check_supported
    from tracediff.integrations.specforge.plugin import at_startup
    from tracediff.integrations.specforge.recording import Recording, install

_HOMES = {"Recording": "recording", "install": "recording", "SpecForgeUnsupported": "guard",
          "check_supported": "guard", "at_startup": "plugin"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = ["Recording", "SpecForgeUnsupported", "at_startup", "check_supported", "install"]

"""Recording SGLang's EAGLE-3 serving path (target, draft extend, draft chain) under canonical names.

``install(recorder, target=..., draft=..., worker=...)`` attaches to SGLang's own objects; the
scheduler side calls ``batch_context(reqs)`` once per batch so that every row is keyed by content:
(request, position, the request's token at that position), docs/FORMAT.md. The same function is
called by the launcher plugin's scheduler patch and by the CPU harness (testbed/sglang_cpu.py).

Modules: ``guard`` (the version guard), ``keys`` (row keys), ``models`` (where each family keeps what
is read), ``hooks`` (the hooks ``install`` attaches; ``..slot_probe``: what each aux slot holds), ``contract``
(what the trace states about the run), ``plugin`` (the launcher's start-up plugin), ``importer``
(``tracediff import sglang-dump``), ``producer`` (what the launcher and the CLI know of SGLang).

A request is one ``Req`` object: it keeps its name from its first batch to its last. The name is
its ``rid``; clients may reuse a rid once a request finished, so a later ``Req`` under a rid already
named is ``rid#2``, then ``rid#3`` (the first free one): two requests never share a trace name, and
the same sequence of requests names the same way in every run.

Where each tensor comes from (SGLang 0.5.23):

- ``target.embed`` / ``target.layer.{i}``: the residual stream entering layer 0 / after layer i, for
  every target family (``models.target_layout``: the text body is the module owning
  ``layers_to_capture``, VL wrappers included). "Boundary" layers (most families) defer the residual
  add, so the stream is read where SGLang itself reads it for aux capture: once layer i+1's attention
  boundary has prepared it (``forward_batch.residual_stream.residual``), and for the last layer the
  residual the final norm returns. "Classic" layers (Gemma 3) return (branch, residual): the stream is
  their sum. Read only: nothing the model computes or packs for the draft changes.
- ``target.aux``: ``LogitsProcessorOutput.hidden_states`` of the target (what the draft is handed).
  The contract states the boundaries SGLang resolved (``layers_to_capture``, or the per-layer flags
  where the family sets them: ``aux_capture_layers``) and what each slot was measured to hold at the
  first forward (``aux_slot_states``, ..slot_probe.py): a layer's branch output is named as such.
- draft depth 0 (draft extend) and depth d >= 1 (``EagleDraftWorker.draft_forward``, topk = 1): a
  depth-0 row at position t is fed x[t+1] and keyed (rid, t, x[t]); chain rows carry the key of the
  request's last depth-0 row (its anchor); ``draft.input_ids`` holds what was fed.
- ``draft.token_target``: the target-vocab tokens ``draft_forward`` returns (``hot_token_id`` applied
  by SGLang), one column per depth.

Rows whose token the scheduler does not know yet (verify rows of draft tokens) are left out: keying a
speculative token would teach the trace a token the request may never have. Hooks never raise into
SGLang: a failure is logged once and recording stops while the server keeps running.
"""

from tracediff.integrations.sglang.guard import SUPPORTED_SGLANG, SglangInternalsError, check_internals
from tracediff.lazy import lazy

# loaded on first use: the CLI and the launcher import this package (its producer) without the hooks
__getattr__ = lazy(__name__, {"Installation": ".hooks", "batch_context": ".hooks", "install": ".hooks",
                              "at_startup": ".plugin"})

__all__ = ["SUPPORTED_SGLANG", "Installation", "SglangInternalsError", "at_startup", "batch_context",
           "check_internals", "install"]

"""SGLang's own dumper output into a trace (``tracediff import sglang-dump DIR -o serve.h5``).

SGLang's dumper (``sglang/srt/debug_utils/dumper.py``, ``DUMPER_ENABLE=1 DUMPER_DIR=...``) writes one
``torch.save`` file per tensor, ``DIR/<exp_name>/step=S___rank=R___dump_index=I___name=X___<tags>.pt``,
holding ``{"value", "meta"}``. Files are loaded with ``torch.load(..., weights_only=True)`` only: one
that needs real unpickling is refused, never run.

Row keys come from the core fields its non-intrusive hooks dump with each forward (``input_ids``,
``positions`` or ``position_ids``, ``seq_lens``, ``rids``, ``req_pool_indices``); they are keys, not
records. A flat batch is cut into requests by ``seq_lens`` (request i ends at position
``seq_lens[i] - 1``: prefill and decode), named by ``rids``; such a step's rows are keyed by content
and later steps of a request extend its tokens. A step that cannot be cut so (verify, draft decode),
or that contradicts tokens already known (SGLang's draft extend feeds ids shifted by one), is keyed
under per-step requests ``<rid>@s<step>``, so that it never corrupts a request's token sequence.
Draft steps (their forward runs ``model.fc``, or only decoder layer 0) take the token keys of the
target at the same (request, position) and record their fed ids as ``draft.input_ids``. A step
without ``input_ids`` keys its rows by position only (token id -1): such rows align only by step and
position (``compare --align step``), and the trace's contract and the command say so.

Names (``trace_name``, docs/INTEGRATIONS.md has the table): the dumper's ``layer_id`` (a tag in the
file name and meta; the non-intrusive dumper sets it inside ``model.layers.{i}``) stays in the
name, so one name dumped in three layers is three tensors. Known states get canonical names
(SGLang's fused add-norm returns (normed, residual): the residual entering layer i is the output of
layer i-1, ``target.layer.{i-1}``). The non-intrusive dumper's other tensors are grouped one per
block of a decoder layer, ``sglang.[draft.]<block>[.residual|.out<k>].layer<i>``; module inputs,
the root's and ``model``'s outputs (each another dumped tensor or a key field) and modules nested
inside a block are left out and counted.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tracediff.eagle3 import names as tn
from tracediff.errors import InputError
from tracediff.integrations.importing import RECORDER_OPTIONS, check_written
from tracediff.integrations.torch_files import load_tensors, names_as_data
from tracediff.record.copies import tag_of_tensor
from tracediff.record.recorder import Recorder
from tracediff.text import safe
from tracediff.trace.output import check_outputs, staged_outputs
from tracediff.trace.storage import unwritable_suffix

PREFIX = "non_intrusive__"
# Non-intrusive path (after PREFIX) -> (canonical name in a target step, in a draft step); None:
# grouped by trace_name. Module paths are SGLang 0.5.23's LlamaForCausalLM / LlamaForCausalLMEagle3
# (and HF's lm_head). Not mapped on purpose: model.layers.{i}.output is the layer's last branch in
# SGLang (the residual add is deferred to the next layer), not target.layer.i; the draft's
# model.norm.output.1 is draft.hidden only when the draft config's norm_output is off.
NAMES: dict[str, tuple[str | None, str | None]] = {
    "model.embed_tokens.output": (tn.TARGET_EMBED, tn.DRAFT_EMBED),
    "model.norm.output": (tn.TARGET_FINAL_HIDDEN, None),
    "model.norm.output.0": (tn.TARGET_FINAL_HIDDEN, None),
    "logits_processor.output.next_token_logits": (tn.TARGET_LOGITS, tn.DRAFT_LOGITS),
    "lm_head.output": (tn.TARGET_LOGITS, tn.DRAFT_LOGITS),
    "model.fc.inputs.0": (None, tn.DRAFT_FC_IN),
    "model.fc.output": (None, tn.DRAFT_FC_OUT),
}
KEY_FIELDS = ("input_ids", "positions", "position_ids", "seq_lens", "rids", "req_pool_indices")
FILE_NAME = re.compile(r"step=(-?\d+)___rank=(\d+)___dump_index=(\d+)___name=(.+?)(?:___[^=]+=.*)?\.pt")
LAYER = re.compile(re.escape(PREFIX) + r"model\.layers\.(\d+)\.")
IN_LAYER = re.compile(r"model\.layers\.(\d+)\.(?:(\w+)\.)?(output|inputs)(?:\.(\w+))?")
TOP_MODULE = re.compile(r"model\.(\w+)\.output(?:\.(\w+))?")
LAYER_OUTPUT = re.compile(re.escape(PREFIX) + r"model\.layers\.(\d+)\.output(?:\.\d+)?")
LEFT_OUT = re.compile(r"(?:.*\.)?inputs(?:\..*)?|output(?:\..*)?|model\.output(?:\..*)?")
NO_TOKEN = -1
QUEUE_BYTES = 256 << 20  # the recorder's default bound


@dataclass
class Dump:
    """One dumper file."""

    path: Path
    step: int
    rank: int
    index: int
    name: str
    value: Any
    tags: dict[str, Any]


@dataclass
class DumpImported:
    files: int
    records: int
    steps: int
    paths: list[Path]
    steps_without_tokens: int
    skipped: int  # values that are not recordable tensors (strings, objects, unsupported dtypes)
    left_out: int = 0  # non-intrusive tensors the naming leaves out (module inputs, nested modules)


@dataclass(frozen=True)
class Naming:
    """What names one step's dumps: a draft step or not, and the target's last decoder layer when the
    step dumped the outputs of layers 0..L-1 (the final norm's residual is then target.layer.{L-1})."""

    draft: bool
    last_layer: int | None


@dataclass
class StepKeys:
    """Per-token keys of one forward, flattened; ``lead`` is the shape of its input_ids."""

    lead: tuple[int, ...]
    requests: np.ndarray
    positions: np.ndarray
    tokens: np.ndarray
    last: np.ndarray  # the last token of each request segment (for [requests, ...] tensors)


@dataclass
class Book:
    """Tokens by (request, position) from content-keyed steps, one per rank."""

    tokens: dict[tuple[str, int], int] = field(default_factory=dict)

    def agrees(self, requests: np.ndarray, positions: np.ndarray, tokens: np.ndarray) -> bool:
        known = self.tokens
        return all(known.get((r, int(p)), int(t)) == int(t) for r, p, t in zip(requests, positions, tokens))

    def learn(self, requests: np.ndarray, positions: np.ndarray, tokens: np.ndarray) -> None:
        for r, p, t in zip(requests, positions, tokens):
            self.tokens.setdefault((r, int(p)), int(t))

    def lookup(self, requests: np.ndarray, positions: np.ndarray) -> np.ndarray | None:
        found = [self.tokens.get((r, int(p))) for r, p in zip(requests, positions)]
        return None if any(t is None for t in found) else np.array(found, dtype=np.int64)


def dump_files(source: Path) -> list[Path]:
    """The dumper files of one run: under ``source`` itself or its one experiment folder."""
    if not source.is_dir():
        raise InputError(source, "no such directory")
    files = sorted(p for p in source.rglob("*.pt") if p.is_file())
    if not files:
        raise InputError(source, "holds no SGLang dumper files (step=...___name=....pt)")
    runs = sorted({str(p.parent.relative_to(source)) for p in files})
    if len(runs) > 1:
        raise InputError(source, f"holds the dumps of {len(runs)} runs ({', '.join(runs[:4])}): "
                         "import one of these folders")
    return files


def load_dump(path: Path) -> Dump:
    """One file, checked: its name, then ``{"value", "meta"}`` loaded with weights_only=True."""

    match = FILE_NAME.fullmatch(path.name)
    if match is None:
        raise InputError(path, "not an SGLang dumper file name (step=S___rank=R___dump_index=I___name=X..)")
    data = load_tensors(path, "a dump")
    if not isinstance(data, dict) or "value" not in data or not isinstance(data.get("meta"), dict):
        found = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise InputError(path, f"expected a dict with 'value' and 'meta'; found {found}")
    meta = data["meta"]
    step, rank, index, name = int(match[1]), int(match[2]), int(match[3]), match[4]
    if (meta.get("step", step), meta.get("rank", rank), meta.get("name", name)) != (step, rank, name):
        raise InputError(path, "its file name and its meta disagree on step, rank or name")
    return Dump(path, step, rank, index, name, data["value"], meta)


def naming(names: set[str]) -> Naming:
    """How a step's dumps are named, from the names it dumped."""
    draft = is_draft_step(names)
    layers = {int(m[1]) for n in names if (m := LAYER_OUTPUT.fullmatch(n))}
    full = not draft and bool(layers) and layers == set(range(max(layers, default=0) + 1))
    return Naming(draft, max(layers) if full else None)


def trace_name(dump: Dump, how: Naming) -> str | None:
    """The trace name of one dump (docs/INTEGRATIONS.md has the rules); None: left out."""
    layer = _layer_tag(dump.tags.get("layer_id"))
    if not dump.name.startswith(PREFIX):  # a hand dump: its name, and its layer when it has one
        return f"sglang.{safe(dump.name)}" + ("" if layer is None else f".layer{layer}")
    path = dump.name[len(PREFIX):]
    if mapped := NAMES.get(path, (None, None))[how.draft]:
        return mapped
    if path == "model.norm.output.1" and how.last_layer is not None:
        return f"target.layer.{how.last_layer}"
    side = "sglang.draft." if how.draft else "sglang."
    if match := IN_LAYER.fullmatch(path):
        index, block, kind, part = match.groups()
        if kind == "inputs":
            return None
        layer = int(index) if layer is None else layer
        if block is None:
            return f"{side}layer_output{_part(None, part)}.layer{layer}"
        if block == "input_layernorm" and part == "1" and not how.draft and isinstance(layer, int) and layer:
            return f"target.layer.{layer - 1}"
        return f"{side}{block}{_part(block, part)}.layer{layer}"
    if path.startswith("model.layers.") or LEFT_OUT.fullmatch(path):
        return None  # a module nested in a block, a module's inputs, the root's or model's outputs
    if match := TOP_MODULE.fullmatch(path):
        return f"{side}{match[1]}{_part(match[1], match[2])}"
    return f"sglang.{safe(path)}"


def _part(block: str | None, part: str | None) -> str:
    """The suffix of one tensor of a module's output: a norm's (normed, residual), else .out<k>."""
    if part is None or (block or "").endswith("norm") and part == "0":
        return ""
    if (block or "").endswith("norm") and part == "1":
        return ".residual"
    return f".out{part}"


def _layer_tag(value: Any) -> int | str | None:
    """The dumper's layer_id tag as a name part (None when absent)."""
    if value is None or isinstance(value, bool):
        return None
    text = str(value)
    return int(text) if text.isdigit() else re.sub(r"[^\w-]", "_", text)


def is_draft_step(names: set[str]) -> bool:
    """A draft forward runs ``model.fc`` (depth 0), or only decoder layer 0 (a one-layer draft)."""
    if any(n.startswith(PREFIX + "model.fc.") for n in names):
        return True
    layers = {int(m[1]) for n in names if (m := LAYER.match(n))}
    return layers == {0}


def _first(dumps: list[Dump], *names: str) -> Any:
    return next((d.value for d in dumps if d.name in names), None)


def _ints(value: Any) -> np.ndarray | None:
    import torch

    if (isinstance(value, torch.Tensor) and value.dim() >= 1 and value.dtype != torch.bool
            and not value.dtype.is_floating_point and not value.dtype.is_complex):
        return value.detach().reshape(-1).to(torch.int64).numpy()
    return None


def step_keys(dumps: list[Dump], step: int, book: Book, draft: bool) -> StepKeys | None:
    """Row keys of one forward from its core fields (see the module docstring); None without input_ids."""
    ids_value = _first(dumps, "input_ids")
    ids = _ints(ids_value)
    if ids is None or len(ids) == 0:  # none, or an empty batch: no tokens to key rows by
        return None
    lead = tuple(ids_value.shape)
    positions = _ints(_first(dumps, "positions", "position_ids"))
    if positions is not None and len(positions) != len(ids):  # e.g. [1, T] positions of a [B, T] batch
        fits = len(positions) > 0 and len(ids) % len(positions) == 0
        positions = np.tile(positions, len(ids) // len(positions)) if fits else None
    if positions is None:
        width = lead[-1]
        positions = np.tile(np.arange(width, dtype=np.int64), len(ids) // width)
    rids = _first(dumps, "rids")
    pool = _ints(_first(dumps, "req_pool_indices"))
    segments = _segments(positions, _ints(_first(dumps, "seq_lens")), lead[0] if len(lead) == 2 else 0)
    if segments is None:  # not a plain prefill / decode batch: cut where positions do not run on
        starts = np.flatnonzero(np.diff(positions, prepend=positions[0] - 2) != 1)
        segments = np.diff(np.append(starts, len(ids)))
        keyed_by_content = False
    else:
        keyed_by_content = True
    count, per_step = len(segments), False
    if isinstance(rids, (list, tuple)) and len(rids) == count:
        names = [safe(r) for r in rids]  # data: a lone surrogate in one is no request id
    elif pool is not None and len(pool) == count:
        names = [f"pool{int(p)}" for p in pool]
    else:  # nothing names the requests across steps: this step's rows are requests of their own
        names, per_step, keyed_by_content = [f"s{step}b{i}" for i in range(count)], True, False
    requests = np.repeat(np.array(names, dtype=object), segments)
    tokens = ids
    if draft:  # rows carry the target's token at their position; the fed ids are draft.input_ids
        known = book.lookup(requests, positions) if keyed_by_content else None
        tokens, keyed_by_content = (known, True) if known is not None else (ids, False)
    elif keyed_by_content and not book.agrees(requests, positions, ids):
        keyed_by_content = False
    if keyed_by_content and not draft:
        book.learn(requests, positions, ids)
    if not keyed_by_content and not per_step:
        requests = np.array([f"{r}@s{step}" for r in requests], dtype=object)
    return StepKeys(lead, requests, positions, tokens, np.cumsum(segments) - 1)


def _segments(positions: np.ndarray, seq_lens: np.ndarray | None, batch_rows: int) -> np.ndarray | None:
    """Tokens per request: [B, T] rows, or a flat batch cut where request i reaches seq_lens[i] - 1."""
    if batch_rows:
        return np.full(batch_rows, len(positions) // batch_rows)
    if seq_lens is None or len(seq_lens) == 0:
        return None
    sizes, start = [], 0
    for length in seq_lens:
        ends = np.flatnonzero(positions[start:] == int(length) - 1)
        if len(ends) == 0:
            return None
        sizes.append(int(ends[0]) + 1)
        start += sizes[-1]
    return np.array(sizes) if start == len(positions) else None


@names_as_data
def import_sglang_dump(source: Path, out: Path, *, queue_bytes: int = QUEUE_BYTES,
                       force: bool = False) -> DumpImported:
    """Write the dumps under ``source`` as a serving trace at ``out`` (per-rank files for several ranks).
    ``queue_bytes``: the recorder's bound; a dump larger than it is still written, alone (memory: the
    larger of the two)."""
    files = dump_files(source)
    if problem := unwritable_suffix(out):
        raise InputError(out, problem)
    if not out.parent.is_dir():
        raise InputError(out, f"output directory {out.parent} does not exist")
    dumps = [load_dump(path) for path in files]  # every file is checked before anything is written
    by_rank: dict[int, list[Dump]] = defaultdict(list)
    for dump in dumps:
        by_rank[dump.rank].append(dump)
    world = max(by_rank) + 1 if len(by_rank) > 1 else 1
    paths = [out.with_name(f"{out.stem}.rank{r}{out.suffix}") if world > 1 else out for r in sorted(by_rank)]
    check_outputs(paths, files, force)  # an existing output only with force; never a link or an input
    done = DumpImported(files=len(files), records=0, steps=0, paths=paths, steps_without_tokens=0, skipped=0)
    with staged_outputs(paths, files, force) as staging:  # no partial trace
        for rank, target in zip(sorted(by_rank), paths):
            _write_rank(by_rank[rank], staging / out.name, target, rank, world, source, done, queue_bytes)
    return done


def _write_rank(dumps: list[Dump], out: Path, target: Path, rank: int, world: int, source: Path,
                done: DumpImported, queue_bytes: int) -> None:
    """Record one rank's dumps into ``out`` (staged; the Recorder adds ``.rankN`` for several ranks:
    ``target``, the user's output, is that rank's file)."""
    steps: dict[int, list[Dump]] = defaultdict(list)
    for dump in sorted(dumps, key=lambda d: d.index):
        steps[dump.step].append(dump)
    contract = {"imported_from": "sglang-dump", "dump_dir": str(source), "name_map": "sglang_dump.trace_name"}
    options: dict[str, Any] = dict(source="serving", meta=contract, queue_bytes=queue_bytes,
                                   **RECORDER_OPTIONS)
    if world > 1:
        options.update(rank=rank, world_size=world)
    book, untokened = Book(), 0
    with Recorder(out, **options) as rec:
        rec.oversized_alone = True  # a record over queue_bytes waits for an empty queue, never refused
        for step in sorted(steps):
            group = steps[step]
            how = naming({d.name for d in group})
            draft = how.draft
            keys = step_keys(group, step, book, draft)
            untokened += keys is None
            if draft and keys is not None:
                rec.log(tn.DRAFT_INPUT_IDS, _ids_value(group), step=step, request=list(keys.requests),
                        positions=keys.positions, token_ids=keys.tokens)
            for dump in group:
                if dump.name in KEY_FIELDS:
                    continue
                name = trace_name(dump, how)
                if name is None:
                    done.left_out += 1
                    continue
                done.skipped += not _log(rec, name, dump.value, step, keys)
        rec.update_contract(row_keys="tokens" if not untokened else
                            "step_position" if untokened == len(steps) else "mixed",
                            steps_without_tokens=untokened)
    check_written(rec, target)
    done.records += rec.records_written
    done.steps += len(steps)
    done.steps_without_tokens += untokened


def _ids_value(group: list[Dump]) -> Any:
    return _first(group, "input_ids").reshape(-1)


def _log(rec: Any, name: str, value: Any, step: int, keys: StepKeys | None) -> bool:
    """One dump as rows (per token, or per request: its last token) or as a static record of its
    step; False when it is not a recordable tensor."""
    import torch

    if not isinstance(value, torch.Tensor):
        return False
    try:
        tag_of_tensor(value)
    except ValueError:
        return False
    if value.dim() == 0:
        rec.log_static(name, value, step=step)
        return True
    if keys is None:
        length = value.shape[0]
        rec.log(name, value, step=step, request=f"s{step}", positions=np.arange(length),
                token_ids=np.full(length, NO_TOKEN))
        return True
    rows = len(keys.tokens)
    if tuple(value.shape[: len(keys.lead)]) == keys.lead:
        pick = np.arange(rows)
        value = value.reshape(rows, *value.shape[len(keys.lead):])
    elif value.shape[0] == len(keys.last) and value.shape[0] != rows:
        pick = keys.last
    else:
        rec.log_static(name, value, step=step)
        return True
    rec.log(name, value, step=step, request=list(keys.requests[pick]), positions=keys.positions[pick],
            token_ids=keys.tokens[pick])
    return True


__all__ = ["NAMES", "DumpImported", "Naming", "dump_files", "import_sglang_dump", "is_draft_step",
           "load_dump", "naming", "trace_name"]

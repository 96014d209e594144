"""Device check: the recorder's CUDA path against its CPU path, bit for bit; what recording costs a GPU
forward; and the pinned copy while the stream keeps writing to the source.

Checks (each PASS, FAIL or SKIP; one line per failure, exit 1 on any):
  bitexact   a target forward and a TTT draft pass (tiny HF Llama + our EAGLE-3 draft, bf16 and fp32) logged
             with our canonical logging (testbed.train.record_ttt) to .h5 and .arrow through the device path,
             and the very same tensors copied to the CPU and logged again: record by record, every key,
             dtype and raw bit must agree
  overwrite  a large bf16 tensor logged while the stream (and a side stream) overwrites it right after
             log() returns: each record must hold the value at log time
  timing     the same forward loop without a recorder, recording, and with a filter that drops everything
             (synchronized wall time, medians of paired runs, warm-up excluded)

Usage: scripts/gpu_check.sh on the GPU machine; ``python scripts/gpu_check.py --device cpu --quick`` runs the
same code on a CPU in seconds (the CUDA-only parts reported as skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, cast

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout (PYTHONPATH-free)

from testbed.train import TTTPass, record_ttt  # noqa: E402
from tracediff.eagle3.capture import AuxSpec, TargetStates, run_target  # noqa: E402
from tracediff.eagle3.config import DraftConfig  # noqa: E402
from tracediff.eagle3.draft import Eagle3Draft  # noqa: E402
from tracediff.eagle3.vocab import build_vocab_map  # noqa: E402
from tracediff.record.recorder import Recorder  # noqa: E402
from tracediff.trace.reader import open_trace  # noqa: E402

MiB = 1 << 20
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
FORMATS = ("h5", "arrow")
CHECKS = ("bitexact", "overwrite", "timing")
MAX_LINES = 10  # failure lines printed per check; the JSON keeps the count


@dataclass(frozen=True)
class Sizes:
    """Model and run sizes: ``full`` for the GPU, ``quick`` for a CPU run that only keeps the code alive."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    draft_vocab: int
    aux_ids: tuple[int, ...]
    ttt_length: int  # draft depths unrolled (SpecForge TTT)
    batch: int
    exact_len: int  # sequence length of the bit-for-bit pass
    bench_len: int  # sequence length of the timed forward
    passes: int  # forward passes per timed sample
    reps: int  # paired timed samples (after one warm-up)
    stress_mib: int  # size of the overwrite check's tensor


PRESETS = {
    "full": Sizes(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816, vocab=8192,
                  draft_vocab=4096, aux_ids=(1, 3, 4), ttt_length=3, batch=2, exact_len=8, bench_len=256,
                  passes=3, reps=8, stress_mib=256),
    "quick": Sizes(hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128, vocab=512, draft_vocab=384,
                   aux_ids=(1, 2, 3), ttt_length=3, batch=2, exact_len=8, bench_len=16, passes=1, reps=3,
                   stress_mib=4),
}


@dataclass
class Outcome:
    """One check's result: ``problems`` are its failure lines."""

    name: str
    status: str = "pass"  # pass | fail | skip
    detail: str = ""
    problems: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)

    def fail(self, problem: str) -> None:
        self.status = "fail"
        self.problems.append(problem)


@contextlib.contextmanager
def guarded(outcome: Outcome) -> Iterator[None]:
    """An unexpected error fails the check it happened in (traceback on stderr) and lets the others run:
    one device run must tell as much as it can."""
    try:
        yield
    except Exception as exc:
        traceback.print_exc()
        outcome.fail(f"{type(exc).__name__}: {exc}")


# ---- models and the forward ------------------------------------------------------------------------------


@dataclass
class Models:
    target: torch.nn.Module | None  # None: transformers missing (or --no-target), target states synthesized
    draft: Eagle3Draft
    spec: AuxSpec
    sizes: Sizes
    device: torch.device


def build_models(sizes: Sizes, device: torch.device, dtype: torch.dtype, with_target: bool) -> Models:
    """A tiny HF Llama target (config + fixed seed, nothing downloaded) and our EAGLE-3 draft on it, built
    on the CPU (the same weights whatever the device), then moved to ``device`` in ``dtype``."""
    target = None
    embed = None
    if with_target:
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=sizes.vocab, hidden_size=sizes.hidden, intermediate_size=sizes.intermediate,
            num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads,
            num_key_value_heads=sizes.kv_heads, max_position_embeddings=max(128, sizes.bench_len),
        )
        target = transformers.LlamaForCausalLM(config).eval()
        embed = target.model.embed_tokens.weight.detach()
    torch.manual_seed(3)
    draft_config = DraftConfig(
        hidden_size=sizes.hidden, num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads,
        intermediate_size=sizes.intermediate, vocab_size=sizes.vocab, draft_vocab_size=sizes.draft_vocab,
        max_position_embeddings=max(128, sizes.bench_len), aux_layer_ids=sizes.aux_ids)
    draft = Eagle3Draft(draft_config, embed_tokens=embed)
    d2t, t2d = build_vocab_map(np.random.default_rng(0).integers(0, 100, sizes.vocab), sizes.draft_vocab)
    draft.d2t.copy_(torch.from_numpy(d2t))
    draft.t2d.copy_(torch.from_numpy(t2d))
    if target is not None:
        target = target.to(device=device, dtype=dtype)
    return Models(target=target, draft=draft.to(device=device, dtype=dtype).eval(),
                  spec=AuxSpec(sizes.aux_ids), sizes=sizes, device=device)


def token_batch(models: Models, length: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(models.sizes.vocab, (models.sizes.batch, length), generator=gen).to(models.device)


@torch.no_grad()
def forward(models: Models, seqs: torch.Tensor) -> TTTPass:
    """One teacher-forced pass: target forward (embed + every layer + logits), then the draft unrolled."""
    states = run_target(models.target, seqs) if models.target is not None else synthetic_states(models, seqs)
    fc_in = states.aux(models.spec)[:, :-1]
    depths = models.draft.unroll(fc_in, seqs[:, 1:], models.sizes.ttt_length)
    return TTTPass(states=states, spec=models.spec, fc_in=fc_in, depths=depths,
                   target_tokens=states.logits.argmax(-1))


def synthetic_states(models: Models, seqs: torch.Tensor) -> TargetStates:
    """Stand-in target states (seeded noise; the embedding is the draft's) when there is no HF target."""
    s, dtype = models.sizes, models.draft.fc.weight.dtype
    gen = torch.Generator(device="cpu").manual_seed(2)
    b, t = seqs.shape

    def noise(width: int) -> torch.Tensor:
        return torch.randn(b, t, width, generator=gen, device="cpu").to(models.device, dtype)

    states = {"target.embed": models.draft.embed_tokens(seqs)}
    states.update({f"target.layer.{i}": noise(s.hidden) for i in range(s.layers)})
    return TargetStates(states=states, logits=noise(s.vocab))


def log_pass(rec: Any, models: Models, ttt: TTTPass, seqs: torch.Tensor, step: int) -> None:
    """Our canonical logging of one pass, one request per batch row."""
    requests = [f"r{b}" for b in range(seqs.shape[0])]
    record_ttt(cast(Recorder, rec), models.draft, ttt, seqs, requests, step)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- bitexact --------------------------------------------------------------------------------------------


class Tee:
    """Stands in for the recorder: every call goes to the recorders under test, and a clone of its tensor
    (made on the device, in stream order, so the pass stays asynchronous) is kept for ``replay``."""

    def __init__(self, recorders: list[Recorder]) -> None:
        self.recorders = recorders
        self.calls: list[tuple[str, str, torch.Tensor, dict]] = []

    def log(self, name: str, tensor: torch.Tensor, **keys: Any) -> None:
        self._call("log", name, tensor, keys)

    def log_static(self, name: str, tensor: torch.Tensor, **keys: Any) -> None:
        self._call("log_static", name, tensor, keys)

    def _call(self, method: str, name: str, tensor: torch.Tensor, keys: dict) -> None:
        for rec in self.recorders:
            getattr(rec, method)(name, tensor, **keys)
        self.calls.append((method, name, tensor.detach().clone(), keys))

    def replay(self, recorders: list[Recorder], corrupt: str | None = None) -> None:
        """The same calls from CPU copies; ``corrupt`` flips the lowest bit of the first value of the first
        tensor of that name (proof that the comparison can fail)."""
        for method, name, tensor, keys in self.calls:
            host = tensor.cpu()
            if name == corrupt:
                host = flip_first_bit(host)
                corrupt = None
            for rec in recorders:
                getattr(rec, method)(name, host, **keys)


def flip_first_bit(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.clone().contiguous()
    raw = out.view(-1).view(torch.uint8)  # little-endian: byte 0 is the low byte of value 0
    raw[0] = raw[0] ^ 1
    return out


def compare_traces(got: Path, want: Path) -> tuple[int, list[str]]:
    """(records compared, one line per difference): every record's name, seq_no, step, rank, depth, dtype,
    static flag, shape, row keys and raw bytes; the token tables; the final counts."""
    problems: list[str] = []
    compared = 0
    with open_trace(got) as a, open_trace(want) as b:
        ia, ib = a.select(), b.select()
        if len(ia) != len(ib):
            problems.append(f"{len(ia)} records, the reference has {len(ib)}")
        for i, j in zip(ia.tolist(), ib.tolist()):
            x, y = a.read(i), b.read(j)
            compared += 1
            where = f"record {compared - 1} ({y.name}, step {y.step}, depth {y.depth})"
            for column in ("name", "seq_no", "step", "rank", "depth", "dtype", "static"):
                if getattr(x, column) != getattr(y, column):
                    problems.append(f"{where}: {column} {getattr(x, column)!r} != {getattr(y, column)!r}")
            if x.data.shape != y.data.shape:
                problems.append(f"{where}: shape {x.data.shape} != {y.data.shape}")
            for column in ("request", "position", "token_id"):
                if not np.array_equal(getattr(x, column), getattr(y, column)):
                    problems.append(f"{where}: row keys differ in {column}")
            same_layout = x.data.shape == y.data.shape and x.data.dtype == y.data.dtype
            if same_layout and x.data.tobytes() != y.data.tobytes():
                problems.append(f"{where}: {bit_difference(x.data, y.data)}")
        ta, tb = a.request_tokens(), b.request_tokens()
        columns = ("request", "position", "token_id")
        if not all(np.array_equal(getattr(ta, c), getattr(tb, c)) for c in columns):
            problems.append(f"token tables differ ({len(ta)} vs {len(tb)} entries)")
        for side, final in (("trace", a.finals[0]), ("reference", b.finals[0])):
            if not final or final.get("dropped_records") or final.get("stopped"):
                problems.append(f"{side} not closed cleanly: {final}")
    return compared, problems


def bit_difference(got: np.ndarray, want: np.ndarray) -> str:
    """How two raw arrays of one shape and storage dtype differ, as one phrase (bits in hex)."""
    unsigned = f"u{got.dtype.itemsize}"
    a, b = got.reshape(-1).view(unsigned), want.reshape(-1).view(unsigned)
    ne = a != b
    first = int(np.flatnonzero(ne)[0]) if ne.any() else 0
    width = 2 * got.dtype.itemsize
    return (f"raw bits differ in {int(ne.sum())} of {ne.size} values (first at flat index {first}: "
            f"0x{int(a[first]):0{width}x} vs 0x{int(b[first]):0{width}x})")


def check_bitexact(models: Models, dtype_name: str, formats: tuple[str, ...], traces: Path, scratch: Path,
                   corrupt: str | None) -> list[Outcome]:
    """One pass logged through the device path and again from CPU copies; the traces compared per format.

    After logging, the pass's tensors are dropped and another forward runs before the writer reads them:
    the allocator hands their memory to new work, so a copy that was not taken at log time shows."""
    outcomes = [Outcome(f"bitexact/{dtype_name}/{fmt}") for fmt in formats]
    seqs = token_batch(models, models.sizes.exact_len)
    got = {fmt: traces / f"device-{dtype_name}.{fmt}" for fmt in formats}
    want = {fmt: scratch / f"reference-{dtype_name}.{fmt}" for fmt in formats}
    meta = {"gpu_check": {"dtype": dtype_name, "device": str(models.device)}}
    device_recs = [Recorder(got[fmt], source="gpu_check", meta=meta, strict=True) for fmt in formats]
    tee = Tee(device_recs)
    log_pass(tee, models, forward(models, seqs), seqs, step=0)
    forward(models, token_batch(models, models.sizes.exact_len, seed=5))  # reuses the freed memory
    for rec in device_recs:
        rec.close()
    reference = [Recorder(want[fmt], source="gpu_check-reference", meta=meta, strict=True) for fmt in formats]
    tee.replay(reference, corrupt)
    for rec in reference:
        rec.close()
    for outcome, fmt in zip(outcomes, formats):
        with guarded(outcome):
            compared, problems = compare_traces(got[fmt], want[fmt])
            for problem in problems:
                outcome.fail(problem)
            if compared == 0:
                outcome.fail("no records compared")
            outcome.figures["records_compared"] = compared
            outcome.detail = f"{compared} records compared, device path vs CPU copies"
            if problems:  # keep the reference beside the trace, for a look afterwards
                shutil.copy(want[fmt], traces / want[fmt].name)
    return outcomes


# ---- overwrite -------------------------------------------------------------------------------------------


def check_overwrite(device: torch.device, mib: int, fmt: str, scratch: Path) -> Outcome:
    """A ``mib`` MiB bf16 tensor logged three times, negated in place right after each log() returns (the
    third time from a side stream), then zeroed: record k must hold the source's bits at log k."""
    outcome = Outcome(f"overwrite/{device.type}")
    n = mib * MiB // 2
    gen = torch.Generator(device=device).manual_seed(7)
    src = torch.randn(n, generator=gen, device=device, dtype=torch.bfloat16)
    base = src.to("cpu", copy=True).view(torch.int16).numpy().view(np.uint16)
    path = scratch / f"overwrite.{fmt}"
    rec = Recorder(path, source="gpu_check", queue_bytes=4 * mib * MiB, on_full="block", block_timeout=120,
                   strict=True)
    cuda = device.type == "cuda"
    log_ms = []
    for k in range(3):
        side = torch.cuda.Stream(device) if cuda and k == 2 else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            start = time.perf_counter()
            rec.log_static("stress.big", src)
            log_ms.append((time.perf_counter() - start) * 1e3)
            src.neg_()  # queued right behind the copy: overwrites every value
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)
    src.zero_()
    start = time.perf_counter()
    rec.close()
    drain_s = time.perf_counter() - start
    with open_trace(path) as trace:
        hits = trace.select(name="stress.big")
        if len(hits) != 3:
            outcome.fail(f"{len(hits)} records of stress.big, expected 3 (dropped {dict(rec.dropped)})")
        for k, i in enumerate(hits.tolist()):
            record = trace.read(i)
            want = base ^ np.uint16(0x8000 * (k % 2))  # negation flips the sign bit, nothing else
            if record.dtype != "bfloat16" or not np.array_equal(record.data.reshape(-1), want):
                outcome.fail(f"record {k}: {bit_difference(record.data.reshape(-1), want)} "
                             "(not the value at log time)")
    path.unlink()
    outcome.figures = {"mib": mib, "log_call_ms": log_ms, "drain_s": drain_s}
    outcome.detail = (f"3 x {mib} MiB bf16 logged, source overwritten right after each log "
                      f"({'default + side stream, pinned non-blocking copies' if cuda else 'cpu clones'}); "
                      f"log() {statistics.median(log_ms):.2f} ms, drain {drain_s:.2f} s")
    return outcome


# ---- timing ----------------------------------------------------------------------------------------------


def time_overhead(models: Models, dtype_name: str, scratch: Path) -> Outcome:
    """Wall time of ``passes`` forwards (synchronized), alone, with every pass recorded, and with a recorder
    whose filter drops everything; each rep times all three back to back (order rotating), and ratios are
    taken within a rep, so that drift cancels. The writer's drain after a sample is timed apart."""
    s = models.sizes
    outcome = Outcome(f"timing/{dtype_name}")
    seqs = token_batch(models, s.bench_len)
    kinds = ("off", "record", "filtered")

    def sample(kind: str, rep: int) -> dict:
        rec = None
        if kind != "off":
            path = scratch / f"timing-{kind}-{rep}.arrow"
            rec = Recorder(path, source="gpu_check", exclude=["*"] if kind == "filtered" else None,
                           queue_bytes=8 << 30, on_full="block", block_timeout=60)
        synchronize(models.device)
        start = time.perf_counter()
        for step in range(s.passes):
            ttt = forward(models, seqs)
            if rec is not None:
                log_pass(rec, models, ttt, seqs, step)
        synchronize(models.device)
        seconds = time.perf_counter() - start
        out: dict[str, Any] = {"s": seconds, "drain_s": 0.0, "dropped": 0, "bytes": 0, "stopped": None}
        if rec is not None:
            start = time.perf_counter()
            rec.close()
            out.update(drain_s=time.perf_counter() - start, dropped=sum(rec.dropped.values()),
                       bytes=rec.bytes_written, stopped=rec.stopped)
            path.unlink()
        return out

    for kind in kinds:  # warm-up: kernels, allocator, pinned pool, files
        sample(kind, -1)
    runs: list[dict[str, dict]] = []
    for rep in range(s.reps):
        order = kinds[rep % 3:] + kinds[: rep % 3]
        runs.append({kind: sample(kind, rep) for kind in order})

    median = statistics.median
    off = median([r["off"]["s"] for r in runs])
    figures = {
        "passes": s.passes, "reps": s.reps, "batch": s.batch, "seq": s.bench_len,
        "off_ms_per_pass": off / s.passes * 1e3,
        "record_ratio": median([r["record"]["s"] / r["off"]["s"] for r in runs]),
        "filtered_ratio": median([r["filtered"]["s"] / r["off"]["s"] for r in runs]),
        "record_ratio_min_max": [min(r["record"]["s"] / r["off"]["s"] for r in runs),
                                 max(r["record"]["s"] / r["off"]["s"] for r in runs)],
        "drain_ms": median([r["record"]["drain_s"] for r in runs]) * 1e3,
        "mb_per_pass": median([r["record"]["bytes"] for r in runs]) / s.passes / 1e6,
        "dropped": sum(r[k]["dropped"] for r in runs for k in ("record", "filtered")),
        "filtered_bytes": sum(r["filtered"]["bytes"] for r in runs),
    }
    outcome.figures = figures
    stopped = sorted({r[k]["stopped"] for r in runs for k in ("record", "filtered") if r[k]["stopped"]})
    if figures["dropped"] or figures["filtered_bytes"] or stopped:
        outcome.fail(f"dropped {figures['dropped']} records, the filter kept {figures['filtered_bytes']} "
                     f"bytes, stopped: {stopped}")
    outcome.detail = (f"record x{figures['record_ratio']:.2f}, filtered x{figures['filtered_ratio']:.2f} "
                      f"({models.device.type})")
    return outcome


# ---- the run ---------------------------------------------------------------------------------------------


def environment(device: torch.device, with_target: bool) -> dict:
    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    info["target"] = "hf-llama" if with_target and info["transformers"] else "synthetic"
    return info


def run(args: argparse.Namespace, out: Path) -> list[Outcome]:
    device = torch.device(args.device)
    sizes = PRESETS["quick" if args.quick else "full"]
    if args.stress_mib:
        sizes = Sizes(**{**asdict(sizes), "stress_mib": args.stress_mib})
    checks, formats = set(args.checks.split(",")), tuple(args.formats.split(","))
    traces = out / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        scratch = Path(tmp)
        for dtype_name in args.dtypes.split(","):
            setup = Outcome(f"models/{dtype_name}")
            with guarded(setup):
                models = build_models(sizes, device, DTYPES[dtype_name], with_target=args.target)
            if setup.status == "fail":
                outcomes.append(setup)
                continue
            if "bitexact" in checks:
                failed = Outcome(f"bitexact/{dtype_name}")
                with guarded(failed):
                    outcomes += check_bitexact(models, dtype_name, formats, traces, scratch, args.corrupt)
                outcomes.extend([failed] if failed.status == "fail" else [])
            if "timing" in checks:
                timing = Outcome(f"timing/{dtype_name}")
                with guarded(timing):
                    timing = time_overhead(models, dtype_name, scratch)
                outcomes.append(timing)
            del models
        if "overwrite" in checks:
            overwrite = Outcome(f"overwrite/{device.type}")
            with guarded(overwrite):
                overwrite = check_overwrite(device, sizes.stress_mib, formats[-1], scratch)
            outcomes.append(overwrite)
    if device.type != "cuda":
        outcomes += [Outcome(name, "skip", "cuda only") for name in
                     ("cuda/pinned-non-blocking-copies", "cuda/side-stream-overwrite", "cuda/gpu-timing")]
    return outcomes


def summary(env: dict, outcomes: list[Outcome]) -> str:
    lines = [f"gpu_check: {env['device']} ({env.get('gpu', 'no gpu')}), torch {env['torch']} (cuda "
             f"{env['cuda']}), python {env['python']}, transformers {env['transformers']}, "
             f"target {env['target']}"]
    width = max(len(o.name) for o in outcomes) + 2
    lines += [f"{o.name:<{width}}{o.status.upper():<6}{o.detail}" for o in outcomes]
    timed = [o for o in outcomes if o.name.startswith("timing/") and o.figures]
    if timed:
        lines.append("timing: ms a pass without a recorder; ratios = time with / without, median of "
                     "paired runs")
        lines.append(f"{'dtype':<10}{'off ms':>9}{'record':>9}{'filtered':>10}{'drain ms':>10}{'MB/pass':>9}"
                     f"{'dropped':>9}")
        for o in timed:
            f = o.figures
            lines.append(f"{o.name.split('/')[1]:<10}{f['off_ms_per_pass']:>9.2f}{f['record_ratio']:>9.2f}"
                         f"{f['filtered_ratio']:>10.2f}{f['drain_ms']:>10.1f}{f['mb_per_pass']:>9.1f}"
                         f"{f['dropped']:>9}")
    for o in outcomes:
        lines += [f"FAIL {o.name}: {p}" for p in o.problems[:MAX_LINES]]
        if len(o.problems) > MAX_LINES:
            lines.append(f"FAIL {o.name}: ... and {len(o.problems) - MAX_LINES} more")
    failed = sum(o.status == "fail" for o in outcomes)
    lines.append(f"gpu_check: {'FAILED: ' + str(failed) + ' check(s)' if failed else 'all checks passed'}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few reps (the CPU run)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for gpu_check.json and traces/ (default: $OUT, else a temp folder)")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of {', '.join(CHECKS)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma list of bfloat16, float32")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma list of h5, arrow")
    parser.add_argument("--stress-mib", type=int, default=0, help="overwrite check's tensor size (MiB)")
    parser.add_argument("--no-target", dest="target", action="store_false",
                        help="no HF target: synthesized target states (what happens without transformers)")
    parser.add_argument("--corrupt", metavar="NAME", default=None,
                        help="flip one bit of the first NAME tensor in the reference copy (the check "
                             "must fail)")
    args = parser.parse_args(argv)
    for option, allowed in (("checks", CHECKS), ("dtypes", tuple(DTYPES)), ("formats", FORMATS)):
        unknown = set(getattr(args, option).split(",")) - set(allowed)
        if unknown:
            parser.error(f"--{option}: unknown {', '.join(sorted(unknown))}; "
                         f"choose from {', '.join(allowed)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"error: cuda: not available to torch {torch.__version__} (built for cuda "
              f"{torch.version.cuda}); use --device cpu", file=sys.stderr)
        return 2
    if args.target:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("gpu_check: transformers is missing: no HF target; the draft runs on synthesized "
                  "target states")
            args.target = False
    out = args.out or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check-out-"))
    out.mkdir(parents=True, exist_ok=True)
    env = environment(torch.device(args.device), args.target)
    started = time.perf_counter()
    outcomes = run(args, out)
    text = summary(env, outcomes)
    print(text)
    failed = [o for o in outcomes if o.status == "fail"]
    report = {"ok": not failed, "environment": env, "quick": args.quick,
              "seconds": time.perf_counter() - started, "checks": [asdict(o) for o in outcomes],
              "failures": [f"{o.name}: {p}" for o in failed for p in o.problems]}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"gpu_check: wrote {out / 'gpu_check.json'} and {out / 'traces'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""A seeded mutation fuzzer over small real traces of both formats, and the crashers found by one.

Every command that reads traces (``show``, ``show --name``, ``compare``, ``convert``, and ``show``
of what convert wrote; on fewer mutants ``slice``, ``bundle``, ``compare --html`` and ``show A B``),
and both importers on mutated dumps (``import sglang-dump``, ``import specforge-ckpt``, then ``show``),
runs on each mutant in its own process, with one time limit and one memory
limit each. The promise checked: no signal, no hang, no traceback (stderr is empty, or exactly one
``error:`` line with exit 2), an exit code the command defines, and no input file changed.

Mutants: bit flips and byte overwrites (biased to the files' structure rather than tensor bytes),
truncations, field edits of the HDF5 datasets and attributes through h5py (HDF5's checksums stay
right, so the edits reach our reader), and rewrites of the Arrow metadata, index and batches through
pyarrow. Mutants are drawn until every kind of mutation has been applied to each format, and at least
MUTANTS of them. ``TRACEDIFF_FUZZ_SCALE=10`` runs ten times as many; ``TRACEDIFF_FUZZ_SEED`` another seed.

Each child is forked from one driver process that has imported the CLI (a fresh interpreter per
command would cost ~1 s); the driver is a subprocess, so a signal or hang never reaches pytest.
"""

from __future__ import annotations

import gc
import gzip
import hashlib
import io
import json
import os
import random
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
import traceback
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.conftest import REPO
from tests.test_readers_hostile import arrow_rewrite
from tracediff.trace.schema import Record, tokens_record
from tracediff.trace.writer import open_writer

SCALE = float(os.environ.get("TRACEDIFF_FUZZ_SCALE", "1"))
SEED = int(os.environ.get("TRACEDIFF_FUZZ_SEED", "11"))
MUTANTS = int(128 * SCALE)  # at least, both formats together; seed 11 applies every kind within 121
MAX_MUTANTS = max(4 * MUTANTS, 512)
TIMEOUT = 20.0  # seconds per command run: a normal one takes well under 1
MEMORY = 3 << 30  # bytes of address space a command may add to the driver's
OUTPUT = 64 << 20  # bytes a command may write to a file (stdout, stderr, convert's output)
PARALLEL = 2
CRASHERS = REPO / "tests" / "data" / "crashers"

INTERESTING = [0, 1, -1, 2, 7, 8, 255, 256, 0x7F, 0x80, 0x7FFF, 0x8000, 0xFFFF, 0x7FFFFFFF, -0x80000000,
               0xFFFFFFFF, 1 << 32, 10**12, (1 << 62), (1 << 63) - 1, -(1 << 63)]
JSON_TEXTS = [b"", b"{", b"[1, 2]", b"null", b'"text"', b"\xff\xfe", b'{"a": ' * 5000 + b"1" + b"}" * 5000,
              b'{"rank": "0"}', b'{"torch": [1]}', b'{"contract": 3}', b'{"s": "\\ud800"}', b"1" * 5000,
              b'{"records": -1}', b'{"closed": true, "records": 999}', b'{"dropped": {"h": "x"}}',
              b'{"mixed_records": [1]}', b"NaN", b'{"a": 1e999}']


META = {"format": "tracediff", "format_version": 2, "source": "training", "producer": "tracediff",
        "producer_version": "0.1.0", "created": "2026-01-01T00:00:00+00:00", "torch": None, "rank": 0,
        "world_size": 1, "host": {"hostname": "fuzz", "pid": 1, "python": "3.11", "platform": "linux"},
        "filters": {"names": ["*"], "exclude": [], "every": 1, "requests": None}, "contract": {}}
FINAL = {"closed": True, "records": 6, "bytes": 336, "dropped_records": 0, "dropped": {},
         "dropped_reasons": {}, "stopped": None, "contract": {}, "tokens": 2, "token_conflicts": 0,
         "token_calls_dropped": 0, "token_positions_ignored": 0, "mixed_records": []}


def fixed_trace(path: Path, compression: str | None = None) -> Path:
    """What ``write_trace`` records (two tensors over three flushes, a token table), through the
    writers with fixed metadata: the same bytes in every process, so a seed names one mutant."""
    h, g = np.arange(24, dtype=np.float32).reshape(2, 12), np.ones((2, 4), np.float16)
    keys = {"request": np.array(["r", "r"], dtype=object), "position": np.arange(2), "token_id": np.arange(2)}
    writer = open_writer(path, META, compression=compression)
    for step in range(3):
        records = [Record("h", h + step, "float32", seq_no=2 * step, step=step, **keys),
                   Record("g", g * step, "float16", seq_no=2 * step + 1, step=step, **keys)]
        writer.write(records + ([tokens_record(**keys)] if step == 0 else []))
    writer.close(FINAL)
    return path


def traces(root: Path) -> dict[str, Path]:
    """The originals, and an lz4-compressed Arrow one."""
    originals = {fmt: fixed_trace(root / f"orig.{fmt}") for fmt in ("h5", "arrow")}
    originals["arrow-lz4"] = fixed_trace(root / "orig_lz4.arrow", compression="lz4")
    return originals


# --- mutations ---------------------------------------------------------------------------------

def structure(path: Path) -> list[tuple[int, int]]:
    """Byte ranges holding the file's structure: all of it, less the unused tail of HDF5's 1 MiB
    data chunk (flips there change nothing anyone reads)."""
    size = path.stat().st_size
    if path.suffix != ".h5":
        return [(0, size)]
    with h5py.File(path, "r") as f:
        chunk, used = f["data"].id.get_chunk_info_by_coord((0,)), f["data"].shape[0]
    if chunk.byte_offset is None:
        return [(0, size)]
    return [(0, chunk.byte_offset + used), (chunk.byte_offset + chunk.size, size)]


def position(rng: random.Random, ranges: list[tuple[int, int]]) -> int:
    start, stop = rng.choice([r for r in ranges if r[1] > r[0]])
    return rng.randrange(start, stop)


def bit_flips(path: Path, rng: random.Random, ranges: list[tuple[int, int]]) -> str:
    data = bytearray(path.read_bytes())
    ranges = [(a, min(b, len(data))) for a, b in ranges]
    flips = [(position(rng, ranges), rng.randrange(8)) for _ in range(rng.choice([1, 1, 2, 4, 16]))]
    for at, bit in flips:
        data[at] ^= 1 << bit
    path.write_bytes(bytes(data))
    return f"bit flips {flips}"


def overwrite(path: Path, rng: random.Random, ranges: list[tuple[int, int]]) -> str:
    data = bytearray(path.read_bytes())
    ranges = [(a, min(b, len(data))) for a, b in ranges]
    width = rng.choice([1, 2, 4, 8])
    value = rng.choice(INTERESTING + [rng.getrandbits(8 * width)]) % (1 << (8 * width))
    at = min(position(rng, ranges) // width * width, len(data) - width)
    data[at : at + width] = value.to_bytes(width, "little")
    path.write_bytes(bytes(data))
    return f"overwrite {width} bytes at {at} with {value:#x}"


def truncate(path: Path, rng: random.Random, ranges: list[tuple[int, int]]) -> str:
    size = path.stat().st_size
    keep = rng.choice([rng.randrange(size), size - rng.randrange(1, min(size, 4096)), rng.randrange(64)])
    with open(path, "r+b") as fh:
        fh.truncate(keep)
    return f"truncate to {keep} of {size} bytes"


def h5_edit(path: Path, rng: random.Random, ranges: list[tuple[int, int]]) -> str:
    """One field edit through h5py: a dataset entry, a length, an attribute, the final metadata."""
    with h5py.File(path, "r+") as f:
        kind = rng.randrange(7)
        names = [f"records/{k}" for k in f["records"]] + [f"rows/{k}" for k in f["rows"]] + \
                ["strings/bytes", "strings/ends"]
        name = rng.choice(names)
        dset = f[name]
        if kind <= 1 and len(dset):
            i = rng.randrange(len(dset))
            info = np.iinfo(dset.dtype)
            value = rng.choice([v for v in INTERESTING if info.min <= v <= info.max])
            if dset.ndim == 2:
                dset[i, rng.randrange(dset.shape[1])] = value
            else:
                dset[i] = value
            return f"{name}[{i}] = {value}"
        if kind == 2:
            n = rng.choice([0, max(len(dset) - 1, 0), len(dset) + 1, len(dset) + 1000])
            dset.resize((n, *dset.shape[1:]))
            return f"resize {name} to {n}"
        if kind == 3:
            text = rng.choice(JSON_TEXTS)
            f.attrs.create("meta", data=text, dtype=h5py.string_dtype())
            return f"meta = {text[:40]!r}"
        if kind == 4:
            value = rng.choice(["2", 2.0, -1, 3, 1 << 40, b"x"])
            f.attrs["format_version"] = value
            return f"format_version = {value!r}"
        if kind == 5:
            text = rng.choice(JSON_TEXTS)
            f["final"].resize((len(text),))
            if text:
                f["final"][:] = np.frombuffer(text, np.uint8)
            return f"final = {text[:40]!r}"
        target = rng.choice(["data", "records/seq_no", "rows/position", "strings/ends", "final"])
        values = f[target][:]
        del f[target]
        if rng.random() < 0.5:
            f.create_dataset(target, data=values)  # contiguous
            return f"{target} made contiguous"
        return f"{target} deleted"


def arrow_edit(path: Path, rng: random.Random, ranges: list[tuple[int, int]]) -> str:
    """One rewrite through pyarrow: metadata, an index entry, a batch entry, the final metadata."""
    kind = rng.randrange(6)
    compression = "lz4" if ".lz4." in path.name else None
    if kind == 0:
        text = rng.choice(JSON_TEXTS)
        arrow_rewrite(path, meta=text, compression=compression)
        return f"meta = {text[:40]!r}"
    if kind == 1:
        version = rng.choice([b"two", b"-1", b"3", b"", b"2.0", b"99999999999"])
        arrow_rewrite(path, version=version, compression=compression)
        return f"format_version = {version!r}"
    if kind == 2:
        text = rng.choice(JSON_TEXTS)
        arrow_rewrite(path, final=text, compression=compression)
        return f"final = {text[:40]!r}"
    key = rng.choice(["name", "dtype", "shape", "static", "seq_no", "batch", "row", "request", "position",
                      "data"])
    value: object = rng.choice(INTERESTING[:12])
    if key in ("name", "dtype"):
        value = rng.choice(["", "__index__", "__final__", "__tokens__", "complex64", "h", "bfloat16",
                            "\x1b[2J"])
    elif key == "shape":
        value = rng.choice([[], [-1], [2, -3], [1 << 40, 1 << 30], [4, 12], [0, 12], [2] * 40])
    elif key == "static":
        value = rng.choice([True, False])
    elif key in ("request", "position"):
        choices = [[], ["r"] * 5, [None], ["r", "s"]] if key == "request" else [[], [1] * 7, [None]]
        value = rng.choice(choices)
    elif key == "data":
        value = rng.choice([b"", b"x" * 7, b"\0" * 10_000])

    def edit(cols: dict) -> None:
        if key in cols and len(cols[key]):
            cols[key][rng.randrange(len(cols[key]))] = value

    if kind == 3 and key in ("name", "dtype", "shape", "static", "seq_no", "batch", "row"):
        arrow_rewrite(path, index=edit, compression=compression)
        return f"index {key} = {value!r}"
    try:
        arrow_rewrite(path, batch=lambda b, cols: edit(cols) if b == 0 else None, compression=compression)
    except (ValueError, TypeError, OverflowError):  # pyarrow refuses to build it: no mutant
        return bit_flips(path, rng, ranges)
    return f"batch 0 {key} = {value!r}"


def no_footer(path: Path, rng: random.Random, ranges: list[tuple[int, int]]) -> str:
    """As a killed writer leaves it: the closing batch and footer gone, or the footer only."""
    import pyarrow as pa

    reader = pa.ipc.open_file(str(path))
    keep = reader.num_record_batches - rng.choice([0, 1, 2])
    with pa.OSFile(str(path) + ".tmp", "wb") as sink, pa.ipc.new_stream(sink, reader.schema) as out:
        for b in range(max(keep, 0)):
            batch = reader.get_batch(b)
            batch.validate(full=True)
            out.write_batch(batch)
    body = Path(str(path) + ".tmp").read_bytes()
    Path(str(path) + ".tmp").unlink()
    path.write_bytes(b"ARROW1\0\0" + body[: len(body) - rng.choice([0, 0, 8, 100])])
    return f"stream of {keep} batches without a footer"


# what mutate() says it did, by the kind of mutation; each kind is applied to both formats, except
# dataset edits and layout changes (HDF5 only) and rewrites of the index and the batches (Arrow only)
KINDS = {"bit flips": r"bit flips", "overwrite": r"overwrite", "truncate": r"truncate", "meta": r"meta =",
         "format_version": r"format_version =", "final": r"final =",
         "dataset entry": r"(records|rows|strings)/\w+\[", "resize": r"resize",
         "layout": r".* (made contiguous|deleted)$", "index": r"index ", "batch": r"batch 0 ",
         "no footer": r"stream of"}
ARROW_ONLY, H5_ONLY = {"index", "batch", "no footer"}, {"dataset entry", "resize", "layout"}


def kinds_applied(fmt: str, what: str) -> set[tuple[str, str]]:
    """(format, kind) of each mutation that ``what`` (mutate's description) says was applied."""
    return {(fmt, kind) for part in what.split("; ") if "not applied" not in part
            for kind, pattern in KINDS.items() if re.match(pattern, part)}


def mutate(path: Path, rng: random.Random, ranges: list[tuple[int, int]]) -> str:
    """Apply one or two mutations (``ranges``: the original's ``structure``); returns what was done.
    Edits through h5py and pyarrow come first: those libraries must only ever read valid files
    (what they do with others is the bug being fuzzed)."""
    raw = [bit_flips, bit_flips, overwrite, overwrite, truncate]
    edits = [h5_edit, h5_edit] if path.suffix == ".h5" else [arrow_edit, arrow_edit, no_footer]
    picked = [rng.choice(raw + edits) for _ in range(rng.choice([1, 1, 1, 2]))]
    done = []
    for op in sorted(picked, key=lambda op: op in raw):
        try:
            done.append(op(path, rng, ranges))
        except Exception as exc:  # an edit tool refused an earlier mutant: use what is there
            done.append(f"{op.__name__} not applied ({type(exc).__name__})")
    return "; ".join(done)


def commands(original: Path, mutant: Path, out: Path) -> list[tuple[str, list[str], set[int]]]:
    """(what, argv, exit codes the command defines) of every command that reads traces."""
    other = ".arrow" if mutant.suffix == ".h5" else ".h5"
    return [
        ("show", ["show", str(mutant)], {0, 2}),
        ("show --name", ["show", str(mutant), "--name", "h"], {0, 2}),
        ("compare", ["compare", str(original), str(mutant)], {0, 1, 2, 3}),
        ("convert", ["convert", str(mutant), str(out.with_suffix(other))], {0, 2}),
        ("show converted", ["show", str(out.with_suffix(other))], {0, 2}),  # runs after convert
    ]


# --- the driver: one forked child per command -------------------------------------------------

def _child(command, argv: list[str], stdout: str, stderr: str, memory: int) -> None:
    """Run one CLI command as the console entry point would; never returns."""
    code = 1
    try:
        for fd, name in ((1, stdout), (2, stderr)):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (OUTPUT, OUTPUT))
        try:
            command.main(args=argv, prog_name="tracediff")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _warm_up(command, runs: list[list[str]]) -> None:
    """Run commands on the valid originals in the driver itself, so that every child starts with
    the modules, caches and compiled kernels a first run loads (~0.4 s each otherwise)."""
    saved = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    try:
        for argv in runs:
            try:
                command.main(args=argv, prog_name="tracediff")
            except SystemExit:
                pass
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)


def _address_space() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))


def drive(plan_path: str) -> None:
    """Run every job of a plan (a JSON list), up to PARALLEL at a time; a job that names another
    in ``after`` runs once that one exited 0. Writes one result per job."""
    import typer

    from tracediff.cli import app

    plan = json.loads(Path(plan_path).read_text())
    command = typer.main.get_command(app)  # the click command the console entry point builds each run
    _warm_up(command, plan["warm_up"])
    gc.freeze()  # children then never touch (and copy) the driver's objects just to collect them
    memory = _address_space() + MEMORY
    jobs, results, running, killed = plan["jobs"], {}, {}, set()
    waiting = list(range(len(jobs)))
    while waiting or running:
        for k in list(waiting):
            if len(running) >= PARALLEL:
                break
            after = jobs[k].get("after")
            if after is not None and after not in results:
                continue
            waiting.remove(k)
            if after is not None and results[after]["code"] != 0:
                results[k] = {"skipped": True, "code": None}
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(command, jobs[k]["argv"], jobs[k]["stdout"], jobs[k]["stderr"], memory)
            running[pid] = (k, time.monotonic())
        pid, status = os.waitpid(-1, os.WNOHANG) if running else (0, 0)
        if pid == 0:
            now = time.monotonic()
            for child, (_, started) in running.items():
                if now - started > TIMEOUT and child not in killed:
                    os.kill(child, signal.SIGKILL)
                    killed.add(child)
            time.sleep(0.002)
            continue
        k, started = running.pop(pid)
        results[k] = {"code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                      "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                      "hang": pid in killed, "seconds": round(time.monotonic() - started, 3)}
    Path(plan["results"]).write_text(json.dumps([results[k] for k in range(len(jobs))]))


def run_plan(root: Path, jobs: list[dict], originals: dict[str, Path], making=None) -> list[dict]:
    """``making``: commands() or another maker of (what, argv, codes[, output]) from (original,
    mutant, out), run on the originals to warm the driver up."""
    plan, results = root / "plan.json", root / "results.json"
    warm = root / "warm"
    warm.mkdir(exist_ok=True)
    warm_up = [made[1] for kind, original in originals.items()
               for made in (making or commands)(original, original, warm / f"warm_{kind.replace('-', '_')}")]
    plan.write_text(json.dumps({"jobs": jobs, "results": str(results), "warm_up": warm_up}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHDYNAMO_DISABLE": "1"}
    budget = 120 + len(jobs) * TIMEOUT / PARALLEL / 10
    done = subprocess.run([sys.executable, __file__, "--drive", str(plan)], env=env, capture_output=True,
                          text=True, timeout=budget)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(results.read_text())


def digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def problem(job: dict, result: dict) -> str | None:
    """What a command did wrong, if anything."""
    if result.get("skipped"):
        return None
    if result["hang"]:
        return f"no exit within {TIMEOUT:.0f} s"
    if result["signal"] is not None:
        return f"killed by signal {signal.Signals(result['signal']).name}"
    code, err = result["code"], Path(job["stderr"]).read_text(errors="replace")
    if job.get("notes"):  # a command whose notes on what a selection matched go to stderr (slice)
        err = "".join(line for line in err.splitlines(keepends=True)
                      if not line.startswith("tracediff: note: "))
    lines = err.splitlines()
    if code not in job["codes"]:
        return f"exit {code} (defined: {sorted(job['codes'])}): {err[-1500:]}"
    if code == 2 and (len(lines) != 1 or not lines[0].startswith("error: ")):
        return f"exit 2 without exactly one error line: {err[-1500:]}"
    if code != 2 and err:
        return f"exit {code} with stderr: {err[-1500:]}"
    return None


@pytest.mark.slow
@pytest.mark.subprocess
def test_mutated_traces_never_crash_hang_or_traceback(tmp_path) -> None:
    originals = traces(tmp_path)
    kinds = list(originals)
    jobs, mutants = [], []
    started = time.monotonic()
    ranges = {kind: structure(path) for kind, path in originals.items()}
    every = {(fmt, kind) for fmt in ("h5", "arrow") for kind in KINDS
             if kind not in (ARROW_ONLY if fmt == "h5" else H5_ONLY)}
    applied: set[tuple[str, str]] = set()
    i = 0
    while i < MUTANTS or (applied != every and i < MAX_MUTANTS):
        kind = kinds[i % 2] if i % 10 else "arrow-lz4"  # one in ten Arrow mutants is compressed
        rng = random.Random(f"{SEED}:{i}")
        original = originals[kind]
        mutant = tmp_path / f"m{i}{'.lz4' if kind == 'arrow-lz4' else ''}{original.suffix}"
        shutil.copy(original, mutant)
        what = mutate(mutant, rng, ranges[kind])
        applied |= kinds_applied(original.suffix.lstrip("."), what)
        mutants.append((mutant, f"mutant {i} of {original.name} (seed {SEED}): {what}"))
        for name, argv, codes in commands(original, mutant, tmp_path / f"out{i}"):
            k = len(jobs)
            jobs.append({"argv": argv, "codes": sorted(codes), "what": f"{name}: {mutants[-1][1]}",
                         "stdout": str(tmp_path / f"j{k}.out"), "stderr": str(tmp_path / f"j{k}.err"),
                         **({"after": k - 1} if name == "show converted" else {})})
        i += 1
    assert applied == every, f"never applied: {sorted(every - applied)}"  # the mutation tools reach each kind
    before = {p: digest(p) for p in [*originals.values(), *(m for m, _ in mutants)]}
    made = time.monotonic() - started
    results = run_plan(tmp_path, jobs, originals)
    after = {p: digest(p) for p in before}
    failures = [f"{job['what']}\n  $ tracediff {' '.join(job['argv'])}\n  {why}"
                for job, result in zip(jobs, results) if (why := problem(job, result)) is not None]
    failures += [f"{p} changed by reading it" for p in before if before[p] != after[p]]
    ran = [r for r in results if not r.get("skipped")]
    codes = {c: sum(r["code"] == c for r in ran) for c in (0, 1, 2, 3)}
    print(f"\nfuzz: {len(mutants)} mutants, {len(ran)} commands in {time.monotonic() - started:.0f} s "
          f"({made:.0f} s making mutants); exits {codes}; slowest {max(r['seconds'] for r in ran):.1f} s")
    assert not failures, f"{len(failures)} failures (files kept in {tmp_path}):\n" + "\n".join(failures[:20])
    unapplied = [what for _, what in mutants if "not applied" in what]
    assert len(unapplied) < len(mutants) // 20, unapplied[:5]  # the mutation tools themselves work
    assert codes[2] > len(mutants) // 4 and codes[0] > len(mutants) // 4  # mutants both refused and read


def more_commands(original: Path, mutant: Path, out: Path) -> list[tuple[str, list[str], set[int], Path]]:
    """(what, argv, exit codes, the output it may write) of the other commands that read traces:
    the output exists only after an exit other than 2."""
    ext, html = mutant.suffix, out.with_name(out.name + ".html")
    return [
        ("slice", ["slice", str(mutant), "-o", str(out.with_name(out.name + "_slice" + ext)), "--names", "h"],
         {0, 2}, out.with_name(out.name + "_slice" + ext)),
        ("bundle", ["bundle", str(original), str(mutant), "-o", str(out.with_name(out.name + "_bundle"))],
         {0, 2}, out.with_name(out.name + "_bundle")),
        ("compare --html", ["compare", str(original), str(mutant), "--html", str(html)], {0, 1, 2, 3}, html),
        ("show A B", ["show", str(original), str(mutant), "--name", "h"], {0, 2}, None),
        ("show B A", ["show", str(mutant), str(original), "--name", "g"], {0, 2}, None),
    ]


MORE_MUTANTS = int(36 * SCALE)  # each runs every command of more_commands


@pytest.mark.slow
@pytest.mark.subprocess
def test_mutants_never_crash_hang_traceback_or_leave_output_in_the_other_reading_commands(tmp_path) -> None:
    """slice, bundle, compare --html and show of two traces, on mutants of both formats: the same
    promises as above, and no stray output: a refused input (exit 2) leaves none of the command's
    output, and no command leaves a hidden or temporary file beside the traces or in its output."""
    originals = traces(tmp_path)
    kinds = list(originals)
    ranges = {kind: structure(path) for kind, path in originals.items()}
    jobs, mutants, outputs = [], [], []
    for i in range(MORE_MUTANTS):
        kind = kinds[i % 3]
        rng = random.Random(f"{SEED}:more:{i}")
        original = originals[kind]
        mutant = tmp_path / f"m{i}{'.lz4' if kind == 'arrow-lz4' else ''}{original.suffix}"
        shutil.copy(original, mutant)
        what = mutate(mutant, rng, ranges[kind])
        mutants.append((mutant, f"mutant {i} of {original.name} (seed {SEED}, more): {what}"))
        (tmp_path / f"o{i}").mkdir()
        for name, argv, codes, output in more_commands(original, mutant, tmp_path / f"o{i}" / "out"):
            k = len(jobs)
            jobs.append({"argv": argv, "codes": sorted(codes), "what": f"{name}: {mutants[-1][1]}",
                         "stdout": str(tmp_path / f"j{k}.out"), "stderr": str(tmp_path / f"j{k}.err"),
                         "notes": name == "slice"})
            outputs.append(output)
    listed = set(os.listdir(tmp_path))
    before = {p: digest(p) for p in [*originals.values(), *(m for m, _ in mutants)]}
    results = run_plan(tmp_path, jobs, originals, making=more_commands)
    failures = [f"{job['what']}\n  $ tracediff {' '.join(job['argv'])}\n  {why}"
                for job, result in zip(jobs, results) if (why := problem(job, result)) is not None]
    failures += [f"{p} changed by reading it" for p in before if before[p] != digest(p)]
    for job, result, output in zip(jobs, results, outputs):
        if output is not None and result["code"] == 2 and output.exists():
            failures.append(f"{job['what']}\n  $ tracediff {' '.join(job['argv'])}\n  exit 2 left {output}")
    stray = [p for p in tmp_path.rglob("*") if p.name.startswith(".") or p.suffix in (".tmp", ".partial")]
    stray += [tmp_path / name for name in set(os.listdir(tmp_path)) - listed
              if name not in ("plan.json", "results.json", "warm") and not name.startswith("j")]
    failures += [f"stray file {p}" for p in stray]
    ran = [r for r in results if not r.get("skipped")]
    codes = {c: sum(r["code"] == c for r in ran) for c in (0, 1, 2, 3)}
    print(f"\nfuzz (more): {len(mutants)} mutants, {len(ran)} commands; exits {codes}; "
          f"slowest {max(r['seconds'] for r in ran):.1f} s")
    assert not failures, f"{len(failures)} failures (files kept in {tmp_path}):\n" + "\n".join(failures[:20])
    assert codes[2] > len(jobs) // 8 and codes[0] > len(jobs) // 8  # mutants both refused and read


# --- the importers: mutated dumps -------------------------------------------------------------

IMPORT_MUTANTS = int(60 * SCALE)  # of each importer's dump; each runs the import and, if it wrote, show
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # what a terminal acts on (a tab or newline it prints)


def torch_file(value, path: Path) -> Path:
    """``value`` as ``torch.save`` writes it (gzipped for ``.gz``, as SpecForge's ``.ckpt.gz``)."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    raw = buffer.getvalue()
    path.write_bytes(gzip.compress(raw, mtime=0) if path.name.endswith(".gz") else raw)
    return path


def sglang_dump_dir(root: Path) -> Path:
    """A prefill of two requests and a decode step as SGLang's dumper writes them (one file per
    tensor: the core fields the non-intrusive hooks dump, an embedding, logits, a hand dump)."""
    import torch

    run = root / "run0"
    run.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    steps = [{"input_ids": torch.tensor([5, 6, 7, 8, 9]), "positions": torch.tensor([0, 1, 2, 0, 1]),
              "seq_lens": torch.tensor([3, 2]), "rids": ["a", "b"]},
             {"input_ids": torch.tensor([10, 11]), "positions": torch.tensor([3, 2]),
              "seq_lens": torch.tensor([4, 3]), "rids": ["a", "b"]}]
    index = 0
    for step, fields in enumerate(steps):
        rows = len(fields["input_ids"])
        tensors = {**fields, "non_intrusive__model.embed_tokens.output": torch.randn(rows, 8, generator=g),
                   "non_intrusive__logits_processor.output.next_token_logits":
                       torch.randn(2, 16, generator=g),
                   "custom_hidden": torch.randn(rows, 4, generator=g).half()}
        for name, value in tensors.items():
            tags = {"layer_id": 1} if name == "custom_hidden" else {}
            torch_file({"value": value, "meta": {"step": step, "rank": 0, "name": name, "dump_index": index,
                                                 **tags}},
                       run / f"step={step}___rank=0___dump_index={index}___name={name}"
                             f"{'___layer_id=1' if tags else ''}.pt")
            index += 1
    return root


def specforge_dump_dir(root: Path) -> Path:
    """Two samples as SpecForge's offline capture writes them, one plain and one gzipped."""
    import torch

    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(1)
    for i, (length, suffix) in enumerate([(4, ".ckpt"), (3, ".ckpt.gz")]):
        torch_file({"input_ids": torch.arange(length) + 3 * i,
                    "loss_mask": torch.ones(length, dtype=torch.long),
                    "aux_hidden_state": torch.randn(1, length, 12, generator=g),
                    "hidden_state": torch.randn(1, length, 4, generator=g)}, root / f"data_{i}{suffix}")
    return root


def dump_dirs(root: Path) -> dict[str, Path]:
    return {"sglang": sglang_dump_dir(root / "sglang"), "specforge": specforge_dump_dir(root / "specforge")}


def _unpacked(path: Path) -> bytes:
    raw = path.read_bytes()
    return gzip.decompress(raw) if path.name.endswith(".gz") else raw


def _repacked(path: Path, raw: bytes) -> None:
    path.write_bytes(gzip.compress(raw, mtime=0) if path.name.endswith(".gz") else raw)


def zip_edit(path: Path, rng: random.Random, ranges: list[tuple[int, int]]) -> str:
    """One entry of the torch.save archive (its pickle most often) flipped, overwritten, cut or
    dropped, the archive rebuilt with right CRCs (and gzip): the damage reaches torch's unpickler."""
    with zipfile.ZipFile(io.BytesIO(_unpacked(path))) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    pickles = [k for k, (name, _) in enumerate(entries) if name.endswith("data.pkl")]
    k = rng.choice(pickles * 3 + list(range(len(entries))))
    name, data = entries[k]
    data, how = bytearray(data), rng.randrange(4)
    if how == 0 and data:
        for _ in range(rng.choice([1, 2, 4])):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == 1 and data:
        data[rng.randrange(len(data))] = rng.choice([0, 0x7F, 0x80, 0xFF, ord("("), ord("."), ord("q")])
    elif how == 2:
        del data[rng.randrange(len(data) + 1):]
    else:
        entries.pop(k)
    if how != 3:
        entries[k] = (name, bytes(data))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for entry, body in entries:
            archive.writestr(entry, body)
    _repacked(path, buffer.getvalue())
    return f"zip entry {name} {['bit flips', 'overwrite', 'cut', 'dropped'][how]}"


def odd_value(rng: random.Random, like):
    """A value a dump may hold instead of ``like``: another dtype, shape or kind, extreme numbers."""
    import torch

    choices = [torch.empty(0), torch.zeros(2, 0, 3), torch.ones(3, dtype=torch.complex64),
               torch.tensor([1 << 62]), torch.tensor(7), torch.tensor([-1, -5]), "text\x1b[2J", [1, 2],
               {"a": 1}, None, 1.5,
               torch.full((2, 2), float("nan")), torch.full((3,), float("inf"))]
    if isinstance(like, torch.Tensor) and like.numel():
        choices += [like.T if like.dim() == 2 else like[None], like.reshape(-1), like[:1],
                    like.to(torch.bfloat16), like.to(torch.bool), like.to(torch.uint8),
                    like.to(torch.float64), like.to(torch.int32),
                    like[None, None], like.flip(0), like * 1e30, like[:0], like.reshape(1, -1)]
    if isinstance(like, list):  # SGLang's rids
        choices += [like[:1], like * 2, [1, 2], ["a\udce9"] * len(like), ["\x1b[2J"] * len(like), []]
    return rng.choice(choices)


def value_edit(path: Path, rng: random.Random, ranges: list[tuple[int, int]]) -> str:
    """The file reloaded, one value or key of its dict changed to another valid object, saved again:
    a well-formed file whose content is at odds with its format."""
    import torch

    data = torch.load(io.BytesIO(_unpacked(path)), weights_only=True)
    meta = data.get("meta") if isinstance(data, dict) else None
    if isinstance(meta, dict) and rng.random() < 0.3:
        key = rng.choice(["step", "rank", "name", "layer_id", "dump_index"])
        meta[key] = rng.choice([-1, 1 << 40, "0", None, True, 1.5, "\x1b]0;PWNED\x07", "../x", 10**30])
        what = f"meta {key} = {meta[key]!r}"
    else:
        key = rng.choice([*data, "extra"]) if isinstance(data, dict) else None
        if key is not None and rng.random() < 0.15:
            data.pop(key, None)
            what = f"{key} removed"
        elif key is not None:
            data[key] = odd_value(rng, data.get(key))
            what = f"{key} = {type(data[key]).__name__} {getattr(data[key], 'dtype', '')}"
        else:
            data, what = odd_value(rng, None), "the whole value replaced"
    buffer = io.BytesIO()
    torch.save(data, buffer)
    _repacked(path, buffer.getvalue())
    return f"value edit: {what}"


def dump_mutate(folder: Path, rng: random.Random) -> str:
    """Mutate one or two files of a dump folder (raw bytes, the archive, a value), or rename one."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    done = []
    for _ in range(rng.choice([1, 1, 1, 2])):
        path = rng.choice(files)
        op = rng.choice([bit_flips, overwrite, truncate, zip_edit, zip_edit, value_edit, value_edit,
                         value_edit, "rename", "copy"])
        if op in ("rename", "copy"):
            odd = rng.choice(["\x1b[2J\x1b]0;PWNED\x07", "\x9b31m", "a\x7fb", "x\ny", " ", "/", ".gz.pt"])
            name = (path.name.replace("name=", f"name={odd}", 1) if "name=" in path.name
                    else f"data_{odd}{''.join(path.suffixes)}")
            if "/" in name or (path.parent / name).exists():
                name = f"data_0{''.join(path.suffixes)}"  # a second file of one request, or one dumper index
            target = path.parent / name
            if target.exists():
                done.append(f"{op} {path.name!r} not applied (taken)")
                continue
            (shutil.copy if op == "copy" else os.rename)(path, target)
            done.append(f"{op} {path.name!r} to {target.name!r}")
            files = sorted(p for p in folder.rglob("*") if p.is_file())
            continue
        try:
            done.append(f"{path.name}: {op(path, rng, [(0, path.stat().st_size)])}")
        except Exception as exc:  # an earlier mutation left nothing the edit tool reads
            done.append(f"{path.name}: {op.__name__} not applied ({type(exc).__name__})")
    return "; ".join(done)


# what dump_mutate says it did, by the kind of mutation: each is applied to both dumps
DUMP_KINDS = ("bit flips", "overwrite", "truncate", "zip entry", "value edit", "rename", "copy")


def import_commands(original: Path, mutant: Path,
                    out: Path) -> list[tuple[str, list[str], set[int], Path | None]]:
    """(what, argv, exit codes, the output it may write): the import of a dump, then show of what it wrote."""
    if "sglang" in mutant.name:
        trace = out.with_name(out.name + ".h5")
        command = ["import", "sglang-dump", str(mutant), "-o", str(trace)]
    else:
        trace = out.with_name(out.name + ".arrow")
        command = ["import", "specforge-ckpt", str(mutant), "-o", str(trace)]
    return [(command[1], command, {0, 2}, trace), ("show imported", ["show", str(trace)], {0, 2}, None)]


def tree_digest(folder: Path) -> dict[str, str | None]:
    return {str(p.relative_to(folder)): digest(p) for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.subprocess
def test_mutated_dumps_never_crash_hang_traceback_print_escapes_or_leave_output_in_the_importers(
        tmp_path) -> None:
    """``import sglang-dump`` and ``import specforge-ckpt`` on mutants of small real dumps (bytes
    flipped and cut, the torch.save archive damaged inside, values swapped for other dtypes, shapes
    and kinds, files renamed with terminal escapes): the promises above, a refused dump leaves no
    trace, nothing is left beside the output, no terminal control character reaches the output,
    and a trace an import wrote is one ``show`` reads."""
    originals = dump_dirs(tmp_path / "orig")
    jobs, mutants, outputs = [], [], []
    for i in range(2 * IMPORT_MUTANTS):
        kind = ("sglang", "specforge")[i % 2]
        rng = random.Random(f"{SEED}:import:{i}")
        mutant = tmp_path / f"m{i}_{kind}"
        shutil.copytree(originals[kind], mutant)
        what = dump_mutate(mutant, rng)
        mutants.append((mutant, f"mutant {i} of the {kind} dump (seed {SEED}): {what}"))
        (tmp_path / f"o{i}").mkdir()
        for name, argv, codes, output in import_commands(originals[kind], mutant, tmp_path / f"o{i}" / "out"):
            k = len(jobs)
            jobs.append({"argv": argv, "codes": sorted(codes), "what": f"{name}: {mutants[-1][1]}",
                         "stdout": str(tmp_path / f"j{k}.out"), "stderr": str(tmp_path / f"j{k}.err"),
                         **({"after": k - 1} if name == "show imported" else {})})
            outputs.append(output)
    listed = set(os.listdir(tmp_path))
    before = {m: tree_digest(m) for m in [*originals.values(), *(m for m, _ in mutants)]}
    started = time.monotonic()
    results = run_plan(tmp_path, jobs, originals, making=import_commands)
    failures = [f"{job['what']}\n  $ tracediff {' '.join(map(repr, job['argv']))}\n  {why}"
                for job, result in zip(jobs, results) if (why := problem(job, result)) is not None]
    failures += [f"{m} changed by importing it" for m in before if before[m] != tree_digest(m)]
    for job, result, output in zip(jobs, results, outputs):
        if result.get("skipped"):
            continue
        said = "".join(Path(job[f]).read_text(errors="replace") for f in ("stdout", "stderr"))
        if CONTROL.search(said):
            failures.append(f"{job['what']}\n  printed a control character: {said[-500:]!r}")
        if output is not None and result["code"] == 2 and output.exists():
            failures.append(f"{job['what']}\n  exit 2 left {output}")
    stray = [p for p in tmp_path.rglob("*") if p.name.startswith(".") or p.suffix in (".tmp", ".partial")]
    stray += [tmp_path / name for name in set(os.listdir(tmp_path)) - listed
              if name not in ("plan.json", "results.json", "warm") and not name.startswith("j")]
    failures += [f"stray file {p}" for p in stray]
    applied = {(kind, op) for (_, what), kind in zip(mutants, ("sglang", "specforge") * IMPORT_MUTANTS)
               for op in DUMP_KINDS if re.search(rf"(^|; |: ){op}[ :]", what)}
    missed = {(kind, op) for kind in ("sglang", "specforge") for op in DUMP_KINDS} - applied
    assert not missed, f"never applied: {sorted(missed)}"  # every kind of mutation reaches both dumps
    ran = [r for r, job in zip(results, jobs) if not r.get("skipped") and job["argv"][0] == "import"]
    codes = {c: sum(r["code"] == c for r in ran) for c in (0, 2)}
    print(f"\nfuzz (importers): {len(mutants)} mutants in {time.monotonic() - started:.0f} s; "
          f"import exits {codes}; slowest {max(r['seconds'] for r in ran):.1f} s")
    assert not failures, f"{len(failures)} failures (files kept in {tmp_path}):\n" + "\n".join(failures[:20])
    assert codes[2] > len(mutants) // 4 and codes[0] > len(mutants) // 8  # mutants both refused and imported


@pytest.mark.subprocess
@pytest.mark.parametrize("crasher", sorted(p.name for p in CRASHERS.iterdir() if p.suffix != ".md"))
def test_each_crasher_is_one_error_line(crasher) -> None:
    """Files that crashed (SIGSEGV, SIGABRT), exhausted memory or hung ``show``: now one line, exit 2,
    through the real console entry point, under a time and a memory limit."""
    path = CRASHERS / crasher
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
    started = time.monotonic()
    argv = [sys.executable, "-c", limit + "from tracediff.cli import main; main()", "show", str(path)]
    done = subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=60)
    assert time.monotonic() - started < 30
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(f"error: {path}: ") and done.stderr.count("\n") == 1, done.stderr[-2000:]


def test_crashers_are_all_here() -> None:
    """Every kind the issue reported: SIGSEGV (2), SIGABRT (bad_alloc, zstd), 5 GB of memory, the hang."""
    names = {p.name for p in CRASHERS.iterdir()}
    assert {"sigsegv_1.arrow", "sigsegv_2.arrow", "sigabrt_badalloc.arrow", "sigabrt_zstd.arrow",
            "5GB_rss.arrow", "hang.h5"} <= names


def test_hang_reproducer_points_at_a_corrupt_global_heap() -> None:
    """hang.h5 is a closed, empty trace whose global heap collection (the home of the ``format`` and
    ``meta`` strings) has a free-space entry of size 0: HDF5 2.0 loops on it forever."""
    data = (CRASHERS / "hang.h5").read_bytes()
    heap = data.find(b"GCOL")
    size = struct.unpack_from("<Q", data, heap + 8)[0]
    at = heap + 16
    while struct.unpack_from("<H", data, at)[0] != 0:
        at += 16 + (struct.unpack_from("<Q", data, at + 8)[0] + 7) // 8 * 8
    assert struct.unpack_from("<Q", data, at + 8)[0] == 0 and at < heap + size


if __name__ == "__main__" and sys.argv[1:2] == ["--drive"]:
    drive(sys.argv[2])

"""A seeded mutation fuzzer over small real traces of both formats, and the crashers found by one.

Every command that reads traces (``show``, ``show --name``, ``compare``, ``convert``, and ``show``
of what convert wrote; on fewer mutants ``slice``, ``bundle``, ``compare --html`` and ``show A B``)
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
import hashlib
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

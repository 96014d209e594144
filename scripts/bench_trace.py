"""Benchmark: recorder write throughput, read speed and recording overhead against this disk.

Every figure is measured in the same run as its baseline:
  disk      sequential write with fsync, cold read (page cache dropped with fadvise), memcpy
  write     the recorder writing N steps of ~2.5 MB through its queue and thread, to fsync
  read      all rows of one tensor name (cold), and one step's rows of the whole trace (cold open)
  overhead  a simulated forward (torch matmul loop, ~5 ms a step, logging ~1 MB a step):
            no recorder vs recorder on vs a recorder that filters everything out

With --verify-cost, instead (no torch needed), for each format: the cost of checking checksums,
verify vs --no-verify interleaved on the same files, each from a cold cache: reading all rows of one
name, a cold open plus one step, and a full CLI compare of the trace against a copy of it.

With --write-cost TREE, instead: this checkout's writers against those of another source tree (a
checkout of the code before a change, e.g. `git worktree add /tmp/old 049fb59`, the last commit before
checksums), run side by side in fresh processes, interleaved: the recorder writing --steps steps of
~2.5 MB to fsync (GB/s), and one writer on batches of tiny records (records/s).

With --tiny, instead, for each format side by side (a flood of tiny records, 16 bytes and one row
each): records/s one writer sustains on batches of WRITE_BATCH records; records/s a host logging
as fast as it can gets written, and how many the full queue dropped meanwhile; and the file size of
a small trace (10 KB of tensors in 10 flushes).

Usage: python scripts/bench_trace.py [--steps 2000] [--dir /tmp/bench] [--out bench.json]
       python scripts/bench_trace.py --tiny [--tiny-records 200000]
       python scripts/bench_trace.py --verify-cost [--steps 400] [--reps 3]
       python scripts/bench_trace.py --write-cost TREE [--steps 300] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import tracediff as td

MB = 1e6
ROWS = 256
# name -> row width; bfloat16 rows: 256 * (3072 + 1024 + 768) * 2 B = 2.5 MB a step
ROW_WIDTHS = {"draft.fc_in": 3 * 1024, "draft.hidden": 1024, "draft.logits": 768}


def drop_cache(path: Path) -> None:
    """Evict a file's pages so the next read comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_write_speed(path: Path, total: int) -> float:
    block = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as fh:
        for _ in range(total // block.nbytes):
            fh.write(block)
        os.fsync(fh.fileno())
    return (total // block.nbytes) * block.nbytes / (time.perf_counter() - start)


def disk_read_speed(path: Path) -> float:
    drop_cache(path)
    start = time.perf_counter()
    size = 0
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(8 << 20)
        while n := fh.readinto(buf):
            size += n
    return size / (time.perf_counter() - start)


def memcpy_speed() -> float:
    src = np.ones(256 << 20, np.uint8)
    dst = np.empty_like(src)
    start = time.perf_counter()
    for _ in range(4):
        dst[:] = src
    return 4 * src.nbytes / (time.perf_counter() - start)


def step_tensors(torch, step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {name: torch.randn(ROWS, width, generator=gen).to(torch.bfloat16)
            for name, width in ROW_WIDTHS.items()}


def record_steps(path: Path, steps: int, torch) -> tuple[float, int, int]:
    """Seconds from the first log to a closed, fsync'd file; bytes logged; records dropped."""
    pool = [step_tensors(torch, s) for s in range(8)]  # tensor creation is not what we time
    token_ids = np.arange(ROWS)
    start = time.perf_counter()
    rec = td.record(path, source="bench", on_full="block", block_timeout=60)
    logged = 0
    for step in range(steps):
        for name, x in pool[step % len(pool)].items():
            rec.log(name, x, step=step, token_ids=token_ids, request="bench")
            logged += x.nelement() * 2
    rec.close()
    return time.perf_counter() - start, logged, sum(rec.dropped.values())


def read_one_name(path: Path, name: str, verify: bool = True) -> tuple[float, int]:
    drop_cache(path)
    start = time.perf_counter()
    with td.open_trace(path, verify=verify) as trace:
        rows = trace.rows(name)
    return time.perf_counter() - start, rows.data.nbytes


def read_one_step(path: Path, step: int, verify: bool = True) -> tuple[float, float]:
    """(seconds to open cold, seconds to read every record of one step)."""
    drop_cache(path)
    start = time.perf_counter()
    with td.open_trace(path, verify=verify) as trace:
        opened = time.perf_counter()
        for name in ROW_WIDTHS:
            trace.rows(name, step=step)
        return opened - start, time.perf_counter() - opened


def overhead(torch, steps: int, reps: int, tmp: Path) -> dict[str, float]:
    """Slowdown of a step, recording ~1 MB a step or keeping nothing, against no recorder: wall time
    (what the host sees, writer thread included) and the host thread's own CPU time."""
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    w = torch.randn(256, 256)
    hidden = torch.randn(512, 1024).to(torch.bfloat16)  # 1 MB a step
    token_ids = np.arange(512)

    def forward(rec) -> tuple[float, float, float]:
        """Seconds a step: wall, host-thread CPU, and wall spent inside ``log`` calls."""
        start, cpu, in_log = time.perf_counter(), time.thread_time(), 0.0
        for step in range(steps):
            x = a
            for _ in range(18):
                x = torch.tanh(x @ w)
            if rec is not None:
                before = time.perf_counter()
                rec.log("target.aux", hidden, step=step, token_ids=token_ids)
                in_log += time.perf_counter() - before
        return (time.perf_counter() - start) / steps, (time.thread_time() - cpu) / steps, in_log / steps

    class BareCopy:
        """The floor any recorder pays: one host copy of the tensor, nothing else."""

        def log(self, name, x, **keys) -> None:
            x.clone()

    def run(kind: str, rep: int) -> tuple[float, float, float]:
        if kind == "baseline":
            return forward(None)
        if kind == "bare_copy":
            return forward(BareCopy())
        names = ["nothing.*"] if kind == "filtered" else None
        with td.record(tmp / f"{kind}{rep}.arrow", names=names) as rec:
            seconds = forward(rec)
        (tmp / f"{kind}{rep}.arrow").unlink()
        return seconds

    def compare(kind: str) -> dict[str, float]:
        """Adjacent baseline / ``kind`` runs (order flipped every rep); the ratio of each pair, so
        that slow drift of this shared VM cancels, then the median and quartiles over pairs."""
        pairs = []
        for rep in range(reps):
            order = ("baseline", kind) if rep % 2 else (kind, "baseline")
            pair = {k: run(k, rep) for k in order}
            pairs.append((pair[kind][0] / pair["baseline"][0], pair[kind][1] / pair["baseline"][1],
                          pair["baseline"][0], pair[kind][2]))
        wall = sorted(p[0] for p in pairs)
        q1, q3 = wall[len(wall) // 4], wall[(3 * len(wall)) // 4]
        return {"baseline_ms": statistics.median(p[2] for p in pairs) * 1e3,
                "ratio": statistics.median(wall), "ratio_q1": q1, "ratio_q3": q3,
                "host_thread_cpu_ratio": statistics.median(p[1] for p in pairs),
                "log_call_us": statistics.median(p[3] for p in pairs) * 1e6}

    def log_call_us(kind: str, calls: int) -> float:
        """Host cost of one log call that keeps nothing, timed alone (no writer work to contend with)."""
        options = {"filtered": {"names": ["nothing.*"]}, "disabled": {"enabled": False}}[kind]
        with td.record(tmp / f"calls-{kind}.arrow", **options) as rec:
            start = time.perf_counter()
            for step in range(calls):
                rec.log("target.aux", hidden, step=step, token_ids=token_ids)
            seconds = (time.perf_counter() - start) / calls
        (tmp / f"calls-{kind}.arrow").unlink(missing_ok=True)
        return seconds * 1e6

    calls = {kind: log_call_us(kind, 100000) for kind in ("disabled", "filtered")}
    step_us = statistics.median([run("baseline", 0)[0] for _ in range(3)]) * 1e6
    return {"filtered": compare("filtered"), "recording": compare("recording"),
            "bare_copy": compare("bare_copy"),
            "idle_log_call_us": calls,
            "idle_log_call_share_of_step": {k: v / step_us for k, v in calls.items()}}


def tiny_records(n: int) -> list:
    from tracediff.trace.schema import Record

    x, keys = np.zeros((1, 4), np.float32), {"request": np.array(["r"], dtype=object),
                                              "token_id": np.zeros(1, np.int64)}
    return [Record("h", x, "float32", seq_no=i, step=i, position=np.array([i]), **keys) for i in range(n)]


def tiny_writer_rate(path: Path, n: int) -> float:
    """Records/s of the format's writer alone, in writes of WRITE_BATCH records (the writer thread's)."""
    from tracediff.record.writer_thread import WRITE_BATCH
    from tracediff.trace.writer import open_writer

    records = tiny_records(n)
    writer = open_writer(path, {"source": "bench"})
    start = time.perf_counter()
    for at in range(0, n, WRITE_BATCH):
        writer.write(records[at : at + WRITE_BATCH])
    writer.close({"closed": True})
    return n / (time.perf_counter() - start)


def tiny_flood(path: Path, n: int) -> dict[str, float]:
    """A host logging n tiny records as fast as it can, default options: records/s it logged,
    records/s written (to the closed file), and the share the full queue dropped."""
    x, ids = np.zeros((1, 4), np.float32), np.arange(1)
    start = time.perf_counter()
    rec = td.record(path, source="bench")
    for step in range(n):
        rec.log("h", x, step=step, token_ids=ids, request="r")
    logged = time.perf_counter() - start
    rec.close()
    seconds = time.perf_counter() - start
    return {"logged_per_s": n / logged, "written_per_s": rec.records_written / seconds,
            "dropped_share": sum(rec.dropped.values()) / n}


def small_trace_bytes(path: Path) -> int:
    """File size of a trace of 10 KB of tensors (ten 1 KB records, one flush each)."""
    with td.record(path, source="bench") as rec:
        for step in range(10):
            rec.log("h", np.zeros((4, 64), np.float32), step=step, token_ids=np.arange(4), request="r")
            rec.flush()
    return path.stat().st_size


def numpy_steps(path: Path, steps: int) -> int:
    """A trace of ``steps`` steps of the ROW_WIDTHS tensors as float16 (bfloat16's size, no torch);
    the bytes logged."""
    rng = np.random.default_rng(0)
    pool = [{name: rng.standard_normal((ROWS, width), dtype=np.float32).astype(np.float16)
             for name, width in ROW_WIDTHS.items()} for _ in range(4)]
    logged = 0
    with td.record(path, source="bench", on_full="block", block_timeout=60) as rec:
        for step in range(steps):
            for name, x in pool[step % len(pool)].items():
                rec.log(name, x, step=step, token_ids=np.arange(ROWS), request="bench")
                logged += x.nbytes
    return logged


def cli_compare(a: Path, b: Path, verify: bool) -> float:
    """Seconds of ``tracediff compare A B --json`` in a fresh interpreter, cold cache."""
    drop_cache(a)
    drop_cache(b)
    args = ["compare", str(a), str(b), "--json", *([] if verify else ["--no-verify"])]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", "import sys; from tracediff.cli import main; "
                           f"sys.argv = ['tracediff', *{args!r}]; main()"], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise RuntimeError(done.stderr)
    return seconds


def verify_cost(work: Path, formats: list[str], steps: int, reps: int) -> dict:
    """verify vs --no-verify, interleaved, on the same files (medians of ``reps``)."""
    results: dict = {"steps": steps, "reps": reps}
    for fmt in formats:
        a, b = work / f"a.{fmt}", work / f"b.{fmt}"
        logged = numpy_steps(a, steps)
        shutil.copyfile(a, b)
        runs: dict[str, list[float]] = {}
        for _ in range(reps):
            for verify, tag in ((True, "verify"), (False, "no_verify")):
                seconds, nbytes = read_one_name(a, "draft.fc_in", verify)
                runs.setdefault(f"read_name_gbs_{tag}", []).append(nbytes / seconds / 1e9)
                opened, step = read_one_step(a, steps // 2, verify)
                runs.setdefault(f"open_plus_step_ms_{tag}", []).append((opened + step) * 1e3)
                runs.setdefault(f"compare_s_{tag}", []).append(cli_compare(a, b, verify))
        out = {"trace_gb": a.stat().st_size / 1e9, "tensor_gb": logged / 1e9,
               **{k: statistics.median(v) for k, v in runs.items()}, "runs": runs}
        out["read_name_cost"] = out["read_name_gbs_no_verify"] / out["read_name_gbs_verify"] - 1
        out["open_plus_step_cost"] = out["open_plus_step_ms_verify"] / out["open_plus_step_ms_no_verify"] - 1
        out["compare_cost"] = out["compare_s_verify"] / out["compare_s_no_verify"] - 1
        a.unlink()
        b.unlink()
        results[fmt] = out
        print(fmt, json.dumps({k: v for k, v in out.items() if k != "runs"}), flush=True)
    return results


WRITE_CHILD = """
import json, sys, tempfile
from pathlib import Path
sys.path.append(sys.argv[1])  # this checkout's benchmark functions; the package comes from PYTHONPATH
import bench_trace
import tracediff
kind, fmt, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
with tempfile.TemporaryDirectory(dir=sys.argv[5]) as d:
    path = Path(d) / f"t.{fmt}"
    if kind == "steps":
        import torch
        seconds, logged, dropped = bench_trace.record_steps(path, n, torch)
        value = logged / seconds / 1e9
    else:
        value = bench_trace.tiny_writer_rate(path, n)
print(json.dumps({"value": value, "package": tracediff.__file__}))
"""


def write_cost(work: Path, formats: list[str], baseline: Path, steps: int, reps: int,
               tiny_n: int = 100_000) -> dict:
    """This checkout's writers vs ``baseline``'s, interleaved in fresh processes (medians of ``reps``):
    the recorder's throughput on ~2.5 MB steps (GB/s) and one writer's on tiny records (records/s)."""
    trees = {"baseline": baseline.resolve(), "now": Path(__file__).resolve().parent.parent}
    runs: dict = {}
    for _ in range(reps):
        for fmt in formats:
            for kind, n in (("steps", steps), ("tiny", tiny_n)):
                for label, tree in trees.items():
                    done = subprocess.run(
                        [sys.executable, "-c", WRITE_CHILD, str(Path(__file__).parent), kind, fmt, str(n),
                         str(work)],
                        capture_output=True, text=True, check=True,
                        cwd=work,  # not a checkout: `-c` puts the working directory first on sys.path
                        env=dict(os.environ, PYTHONPATH=str(tree)))
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    assert result["package"].startswith(str(tree)), result  # each tree's own writers ran
                    runs.setdefault(f"{fmt}_{kind}", {}).setdefault(label, []).append(result["value"])
    out: dict = {"baseline": str(baseline), "steps": steps, "tiny_records": tiny_n, "reps": reps}
    for key, by_tree in runs.items():
        medians = {label: statistics.median(values) for label, values in by_tree.items()}
        unit = "gbs" if key.endswith("steps") else "records_per_s"
        out[key] = {**{f"{label}_{unit}": value for label, value in medians.items()},
                    "runs": by_tree, "cost": 1 - medians["now"] / medians["baseline"]}
        print(key, json.dumps(out[key]), flush=True)
    return out


def tiny(work: Path, formats: list[str], n: int) -> dict:
    results: dict = {"records": n}
    for fmt in formats:
        results[fmt] = {"writer_records_per_s": tiny_writer_rate(work / f"writer.{fmt}", n),
                        **tiny_flood(work / f"flood.{fmt}", n),
                        "small_trace_kb": small_trace_bytes(work / f"small.{fmt}") / 1e3}
        print(fmt, json.dumps(results[fmt]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--formats", default="arrow,h5", help="formats to benchmark; '' for overhead only")
    parser.add_argument("--overhead-steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    parser.add_argument("--tiny", action="store_true", help="tiny records and small traces instead")
    parser.add_argument("--tiny-records", type=int, default=200_000)
    parser.add_argument("--verify-cost", action="store_true", help="checksums: verify vs --no-verify")
    parser.add_argument("--write-cost", type=Path, default=None, metavar="TREE",
                        help="writers: this checkout vs the source tree TREE, side by side")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(dir=args.dir))
    if args.write_cost:
        try:
            results = write_cost(work, list(filter(None, args.formats.split(","))), args.write_cost,
                                 args.steps, min(args.reps, 7))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
        return
    if args.verify_cost:
        try:
            results = verify_cost(work, list(filter(None, args.formats.split(","))), args.steps,
                                  min(args.reps, 5))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({k: v for k, v in results.items()}, indent=1))
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
        return
    if args.tiny:
        try:
            results = tiny(work, list(filter(None, args.formats.split(","))), args.tiny_records)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(results, indent=1))
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
        return
    import torch

    results: dict = {"steps": args.steps, "step_mb": ROWS * sum(ROW_WIDTHS.values()) * 2 / MB}
    try:
        probe = work / "disk.bin"
        total = int(args.steps * results["step_mb"] * MB)
        results["disk_write_fsync_gbs"] = disk_write_speed(probe, min(total, 4 << 30)) / 1e9
        results["disk_cold_read_gbs"] = disk_read_speed(probe) / 1e9
        results["memcpy_gbs"] = memcpy_speed() / 1e9
        probe.unlink()
        for fmt in filter(None, args.formats.split(",")):
            path = work / f"trace.{fmt}"
            seconds, logged, dropped = record_steps(path, args.steps, torch)
            write = logged / seconds / 1e9
            reads = [read_one_name(path, "draft.fc_in") for _ in range(3)]
            read_s, read_bytes = statistics.median(r[0] for r in reads), reads[0][1]
            opens = [read_one_step(path, args.steps // 2) for _ in range(3)]
            open_s, step_s = (statistics.median(o[i] for o in opens) for i in (0, 1))
            results[fmt] = {
                "trace_gb": path.stat().st_size / 1e9,
                "write_gbs": write,
                "write_vs_disk": write / results["disk_write_fsync_gbs"],
                "dropped": dropped,
                "read_name_gbs": read_bytes / read_s / 1e9,
                "read_name_vs_disk": read_bytes / read_s / 1e9 / results["disk_cold_read_gbs"],
                "open_cold_ms": open_s * 1e3,
                "one_step_ms": step_s * 1e3,
                "open_plus_step_ms": (open_s + step_s) * 1e3,
            }
            path.unlink()
            print(fmt, json.dumps(results[fmt]), flush=True)
        results["overhead"] = overhead(torch, args.overhead_steps, args.reps, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

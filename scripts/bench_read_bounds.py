"""Reading hostile traces: peak RSS and wall time of show / compare / show --name, each in a fresh process.

Issue 19's four cases at full size: an HDF5 trace whose datasets have 2 GiB gzip chunks; a zstd Arrow
trace holding one 1 GiB zero record; 16 MiB of ``[]`` run metadata; a plain 1 GiB float32 record.
Usage: python scripts/bench_read_bounds.py [--tree DIR] [--scale 1.0] [--only CASE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30

# The peak is VmHWM, this process's own high-water mark: ru_maxrss of a child counts its parent's RSS at
# the fork (Linux keeps the larger across exec), and this script holds the tensors it just wrote.
CHILD = r"""
import atexit, sys
def peak():
    with open("/proc/self/status") as status:
        kib = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    print("MAXRSS_KIB", kib, file=sys.stderr)
atexit.register(peak)
sys.argv = ["tracediff", *sys.argv[1:]]
from tracediff.cli import main
main()
"""


def write_trace(path: Path, records: list, meta: dict | None = None, compression: str | None = None) -> None:
    from tracediff.trace.writer import open_writer

    writer = open_writer(path, meta or {"source": "bench"}, compression=compression)
    writer.write(records)
    writer.close({"closed": True, "records": len(records), "bytes": sum(r.nbytes for r in records)})


def small_records(n: int = 4):
    from tracediff.trace.schema import Record

    return [Record(name="h", data=np.full((2, 8), i, np.float32), dtype="float32", seq_no=i, step=i,
                   request=np.array(["r", "r"], dtype=object), position=np.array([2 * i, 2 * i + 1]),
                   token_id=np.array([1, 2])) for i in range(n)]


def rechunk_h5(src: Path, dst: Path, chunk_bytes: int) -> None:
    """A copy of an HDF5 trace whose every dataset has chunks of ``chunk_bytes`` (gzip), written as raw
    compressed chunks (no chunk-sized buffer here: zeros are compressed piece by piece)."""
    import h5py

    with h5py.File(src, "r") as old, h5py.File(dst, "w", libver="latest") as new:
        for key, value in old.attrs.items():
            new.attrs[key] = value
        names: list[str] = []
        old.visit(lambda n: names.append(n) if isinstance(old[n], h5py.Dataset) else None)
        for name in names:
            d = old[name]
            row = int(np.prod(d.shape[1:], dtype=np.int64)) * d.dtype.itemsize
            chunk = max(1, min(chunk_bytes, (4 << 30) - 1) // row)
            out = new.create_dataset(name, d.shape, dtype=d.dtype, maxshape=(None, *d.shape[1:]),
                                     chunks=(chunk, *d.shape[1:]), compression="gzip")
            if not d.shape[0]:
                continue
            values = d[:].tobytes()
            comp = zlib.compressobj(1)
            pieces = [comp.compress(values)]
            left = chunk * row - len(values)
            zeros = bytes(16 << 20)
            while left > 0:
                pieces.append(comp.compress(zeros[: min(left, len(zeros))]))
                left -= len(zeros)
            pieces.append(comp.flush())
            out.id.write_direct_chunk((0,) * d.ndim, b"".join(pieces), 0)


def build(case: str, tmp: Path, scale: float) -> tuple[list[Path], str | None]:
    """The files of a case and the tensor name show --name reads (None: not run)."""
    from tracediff.trace.schema import Record

    if case == "h5_chunks":
        plain, hostile = tmp / "plain.h5", tmp / "chunks.h5"
        write_trace(plain, small_records())
        rechunk_h5(plain, hostile, int(2 * GIB * scale))
        return [hostile], "h"
    if case == "arrow_zero":
        n = int(GIB * scale) // 4
        rec = Record(name="z", data=np.zeros((n // 1024, 1024), np.float32), dtype="float32",
                     request=np.array(["r"] * (n // 1024), dtype=object), position=np.arange(n // 1024),
                     token_id=np.ones(n // 1024, np.int64))
        path = tmp / "zero.arrow"
        write_trace(path, [rec], compression="zstd")
        return [path], "z"
    if case in ("meta_h5", "meta_arrow"):
        path = tmp / ("meta.h5" if case == "meta_h5" else "meta.arrow")
        count = int(((16 << 20) - 64) * scale) // 4  # "[], " per list
        write_trace(path, small_records(), meta={"source": "bench", "x": [[]] * count})
        return [path], None
    if case == "plain_f32":
        n = int(GIB * scale) // 4
        rows = n // 2048
        rec = Record(name="f", data=np.random.default_rng(0).standard_normal((rows, 2048), np.float32),
                     dtype="float32", request=np.array(["r"] * rows, dtype=object), position=np.arange(rows),
                     token_id=np.ones(rows, np.int64))
        path = tmp / "plain.h5"
        write_trace(path, [rec])
        return [path], "f"
    raise SystemExit(f"unknown case {case}")


def measure(tree: Path, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True,
                          timeout=900, cwd=tree)
    wall = time.perf_counter() - start
    lines = done.stderr.splitlines()
    rss = next((int(line.split()[1]) for line in lines if line.startswith("MAXRSS_KIB")), -1)
    last = [line for line in (done.stdout.splitlines() + lines) if line and not line.startswith("MAXRSS")]
    return {"exit": done.returncode, "peak_rss_mb": round(rss / 1024, 1), "wall_s": round(wall, 2),
            "says": (last[-1][:160] if last else "")}


CASES = ("h5_chunks", "arrow_zero", "meta_h5", "meta_arrow", "plain_f32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=REPO, help="the tracediff checkout to measure")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the issue's sizes")
    parser.add_argument("--only", choices=CASES, action="append")
    opts = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-read-bounds-"))
    try:
        for case in opts.only or CASES:
            files, name = build(case, tmp, opts.scale)
            path = files[0]
            other = path.with_name("copy-" + path.name)
            shutil.copyfile(path, other)
            size = path.stat().st_size
            runs = {"show": ["show", str(path)], "compare": ["compare", str(path), str(other)]}
            if name is not None:
                runs["show --name"] = ["show", str(path), "--name", name]
            for label, args in runs.items():
                result = measure(opts.tree, args)
                print(json.dumps({"case": case, "file_mb": round(size / 2**20, 2), "run": label, **result}),
                      flush=True)
            for p in tmp.iterdir():
                p.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

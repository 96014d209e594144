"""Benchmark: a full `tracediff compare` of two large traces against the cold-read disk speed and
against the layout SGLang's dumper writes (one pickled file per tensor per forward pass, loaded
with torch.load(weights_only=True) and compared tensor by tensor), run side by side on the same
tensors; plus time to the first divergence with --stop-at-first, peak memory at two sizes, and the
cost of checking checksums (the same compare with --no-verify, interleaved with the verified runs).

The traces are serving-like: every step a decode batch of BATCH requests logs three bfloat16
tensors (aux hidden states, draft hidden, draft logits); each request runs REQUEST_LEN steps. The
target trace equals the baseline except one draft.hidden row at 2% of the steps, so a full compare
reads everything and --stop-at-first may stop early. Every file is written back and read once
before any timing (a virtual disk's host-side caches then treat them alike), and the page cache
is dropped before every timed run. The disk's speed is a plain sequential read of the two trace
files themselves, interleaved with the compares.

Usage: python scripts/bench_compare.py [--gb 2] [--small-gb 0.5] [--reps 3] [--dir /tmp/bench_compare]
       [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from bench_trace import disk_read_speed, drop_cache

import tracediff as td

BATCH = 8
REQUEST_LEN = 500
WIDTHS = {"target.aux": 3 * 2048, "draft.hidden": 2048, "draft.logits": 8192}
STEP_BYTES = BATCH * sum(WIDTHS.values()) * 2
DIVERGE_AT = 0.02  # fraction of the steps


def drop_all(paths: list[Path]) -> None:
    """Write back everything still dirty (the 45k dumper files just written would otherwise be
    flushed during the next timed run), then evict these files' pages."""
    os.sync()
    for path in paths:
        drop_cache(path)


def files_under(path: Path) -> list[Path]:
    return [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]


def step_values(pool: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """Deterministic, distinct rows per step without paying for an RNG each step."""
    return {name: torch.roll(rows, shifts=step * 7, dims=1) for name, rows in pool.items()}


def write_pair(base: Path, steps: int) -> tuple[Path, Path, Path, Path]:
    """The two traces in our format and the same tensors as dumper-style .pt files."""
    generator = torch.Generator().manual_seed(0)
    pool = {name: torch.randn(BATCH, width, generator=generator).to(torch.bfloat16)
            for name, width in WIDTHS.items()}
    groups = steps // REQUEST_LEN + 1  # every request its own tokens: no two rows share a prefix
    tokens = np.random.default_rng(0).integers(0, 32000, (groups, BATCH, REQUEST_LEN))
    bad_step = int(steps * DIVERGE_AT)
    paths = base / "a.h5", base / "b.h5", base / "dump_a", base / "dump_b"
    for side, (trace, dump) in enumerate(((paths[0], paths[2]), (paths[1], paths[3]))):
        with td.record(trace, source="bench", on_full="block", block_timeout=60) as rec:
            for step in range(steps):
                position = step % REQUEST_LEN
                requests = [f"req{step // REQUEST_LEN}-{i}" for i in range(BATCH)]
                folder = dump / f"forward_pass_id={step}"
                folder.mkdir(parents=True, exist_ok=True)
                for name, value in step_values(pool, step).items():
                    if side == 1 and name == "draft.hidden" and step == bad_step:
                        value = value.clone()
                        value[3] *= 1.5
                    rec.log(name, value, step=step, request=requests, positions=[position] * BATCH,
                            token_ids=tokens[step // REQUEST_LEN, :, position])
                    torch.save(value.clone(), folder / f"name={name}.pt")
    return paths


def dumper_compare(dump_a: Path, dump_b: Path, steps: int) -> dict:
    """The baseline: load each pair of .pt files and compare per row, tensor by tensor."""
    failed = 0
    for step in range(steps):
        for name in WIDTHS:
            a = torch.load(dump_a / f"forward_pass_id={step}" / f"name={name}.pt", weights_only=True).float()
            b = torch.load(dump_b / f"forward_pass_id={step}" / f"name={name}.pt", weights_only=True).float()
            diff = a - b
            max_abs = diff.abs().amax(dim=1)
            rel_l2 = diff.norm(dim=1) / a.norm(dim=1)
            cosine = torch.nn.functional.cosine_similarity(a, b, dim=1)
            max_rel = max_abs / a.abs().amax(dim=1)
            failed += int(((max_rel > 3e-2) | (cosine < 0.999) | (rel_l2 > 1)).sum())
    return {"failed_rows": failed}


# Peak RSS from the child's own VmHWM at exit (ru_maxrss would carry over this parent's peak),
# and the peak of its anonymous memory (RssAnon, sampled every 20 ms): RSS also counts mapped
# trace pages, which the page cache holds and reclaims; anonymous memory is what the process owns.
PEAK = """
import atexit, sys, threading, time
def _status(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1])
_anon = [0]
def _sample():
    while True:
        _anon[0] = max(_anon[0], _status('RssAnon'))
        time.sleep(0.02)
threading.Thread(target=_sample, daemon=True).start()
atexit.register(lambda: sys.stderr.write(f"{_status('VmHWM')} kB peak {_anon[0]} kB anon\\n"))
"""


# In-process phases, each from a cold cache: planning (key columns only), then the whole compare.
PHASES = """
import json, sys, time
sys.path.insert(0, {here!r})
from bench_compare import drop_all
from tracediff.diff.differ import compare_traces
from tracediff.diff.pair import Pair
from tracediff.diff.plan import make_plan
from tracediff.trace.reader import open_trace
traces = Pair(open_trace({a!r}), open_trace({b!r}))
start = time.perf_counter()
plan = make_plan(traces)
planned = time.perf_counter()
drop_all([{a!r}, {b!r}])
begin = time.perf_counter()
compare_traces(traces, make_plan(traces))
done = time.perf_counter()
print(json.dumps({{"plan_s": planned - start, "chunks": len(plan.chunks),
                  "in_process_compare_s": done - begin}}))
"""


def run_child(code: str) -> tuple[float, float, float, str]:
    """(seconds, peak RSS in MB, peak anonymous memory in MB, stdout) of ``python -c PEAK + code``."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK + code], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    words = proc.stderr.strip().splitlines()[-1].split()  # "<hwm> kB peak <anon> kB anon"
    return seconds, int(words[-6]) / 1024, int(words[-3]) / 1024, proc.stdout


def prime(paths: list[Path]) -> None:
    """Read every file once after writing: the virtual disk's host caches then hold (or not) the
    traces and the dumper files alike, so every timed run starts from the same state."""
    os.sync()
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while fh.read(8 << 20):
                pass


def pair_read_speed(paths: list[Path]) -> float:
    """Bytes per second of a plain sequential read of the files, page cache dropped first."""
    seconds = sum(path.stat().st_size / disk_read_speed(path) for path in paths)
    return sum(path.stat().st_size for path in paths) / seconds


def measure(base: Path, steps: int, with_baseline: bool, reps: int) -> dict:
    """Side by side on the same files: the disk's plain read speed and the full CLI compare,
    ``reps`` times each, interleaved (medians); stop-at-first, the in-process phases and the
    dumper baseline once."""
    a, b, dump_a, dump_b = write_pair(base, steps)
    dumped = files_under(dump_a) + files_under(dump_b)
    prime([a, b, *(dumped if with_baseline else [])])
    tensor_bytes = 2 * steps * STEP_BYTES
    cli = (f"sys.argv = ['tracediff', 'compare', {str(a)!r}, {str(b)!r}, '--json']\n"
           "from tracediff.cli import main; main()")
    disk, runs, unverified = [], [], []
    for _ in range(reps):
        disk.append(pair_read_speed([a, b]) / 1e9)
        drop_all([a, b])
        runs.append(run_child(cli))
        drop_all([a, b])
        unverified.append(run_child(cli.replace("'--json'", "'--json', '--no-verify'"))[0])
    seconds = sorted(r[0] for r in runs)[reps // 2]
    no_verify_s = sorted(unverified)[reps // 2]
    out = runs[0][3]
    report = json.loads(out[: out.rindex("}") + 1])
    result = {
        "steps": steps, "tensor_bytes": tensor_bytes, "trace_bytes": a.stat().st_size + b.stat().st_size,
        "disk_read_gbs": sorted(disk)[reps // 2], "disk_read_gbs_runs": disk,
        "compare_s": seconds, "compare_s_runs": [r[0] for r in runs],
        "compare_gbs": tensor_bytes / seconds / 1e9,
        "compare_no_verify_s": no_verify_s, "compare_no_verify_s_runs": unverified,
        "verify_cost": seconds / no_verify_s - 1,
        "compare_peak_rss_mb": max(r[1] for r in runs), "compare_peak_anon_mb": max(r[2] for r in runs),
        "verdict": report["verdict"], "coverage": report["coverage"]["fraction"],
        "first_divergence": {"name": report["first_divergence"]["name"],
                             **{k: report["first_divergence"]["row"][k] for k in ("step_a", "position")}},
        "rows_compared": sum(t["rows"] for t in report["tensors"]), "rows_total": steps * BATCH * len(WIDTHS),
    }
    drop_all([a, b])
    seconds, peak_mb, _, out = run_child(cli.replace("'--json'", "'--json', '--stop-at-first'"))
    result.update({"stop_at_first_s": seconds, "stop_at_first_peak_rss_mb": peak_mb})
    here = str(Path(__file__).parent)
    drop_all([a, b])
    result.update(json.loads(run_child(PHASES.format(a=str(a), b=str(b), here=here))[3]))
    if with_baseline:
        script = (f"import sys; sys.path.insert(0, {here!r}); import bench_compare as b; "
                  f"from pathlib import Path; print(b.dumper_compare(Path({str(dump_a)!r}), "
                  f"Path({str(dump_b)!r}), {steps}))")
        drop_all(dumped)
        seconds, peak_mb, _, out = run_child(script)
        result.update({"dumper_s": seconds, "dumper_gbs": tensor_bytes / seconds / 1e9,
                       "dumper_peak_rss_mb": peak_mb, "dumper_files": 2 * steps * len(WIDTHS),
                       "dumper_result": out.strip()})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="tensor bytes per trace, large run")
    parser.add_argument("--small-gb", type=float, default=0.5, help="tensor bytes per trace, memory check")
    parser.add_argument("--reps", type=int, default=3, help="disk reads and full compares of the large pair")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_compare"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    results: dict = {}
    sizes = (("small", args.small_gb, False, 1), ("large", args.gb, True, args.reps))
    for label, gb, baseline, reps in sizes:
        base = args.dir / label
        base.mkdir()
        results[label] = measure(base, max(1, int(gb * 1e9 / STEP_BYTES)), baseline, reps)
        shutil.rmtree(base)
        print(label, json.dumps(results[label], indent=1), flush=True)
    large = results["large"]
    results["summary"] = {
        "compare_gbs": large["compare_gbs"],
        "compare_vs_disk": large["compare_gbs"] / large["disk_read_gbs"],
        "verify_cost": large["verify_cost"],
        "compare_vs_dumper": large["dumper_s"] / large["compare_s"],
        "stop_at_first_speedup": large["compare_s"] / large["stop_at_first_s"],
        "peak_rss_growth": large["compare_peak_rss_mb"] / results["small"]["compare_peak_rss_mb"],
        "peak_anon_growth": large["compare_peak_anon_mb"] / results["small"]["compare_peak_anon_mb"],
        "size_growth": large["tensor_bytes"] / results["small"]["tensor_bytes"],
    }
    print(json.dumps(results["summary"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

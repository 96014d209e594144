"""Benchmark: a full ``tracediff compare`` of the issue-21 set (fc input, draft hidden and draft
logits of STEPS x TOKENS rows, ~1 GB a side) side by side with SGLang 0.5.23's own comparator on
its real dumper's files of the same tensors, the torch.load floor of those files, and ``cat``.

Every tool runs as its own process (start-up counts), cold (page cache dropped before each run)
and warm, interleaved rep by rep; medians are reported; the package is byte-compiled first. The
target side equals the baseline but for one draft.hidden row half way (DIVERGE_AT), so every tool
reads everything and must name the same first divergence (checked). Also: peak anonymous memory
of compare at two sizes (memory flat in trace size), and start-up imports (``python -X
importtime``) of ``--help``, ``show`` and the sample's compare, which needs no compiled kernels.

Usage: python scripts/bench_compare.py [--steps 390] [--small-steps 98] [--reps 2]
       [--dir /tmp/bench_compare] [--out f.json]
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from bench_sglang import DumperWriter, run_comparator
from bench_trace import drop_cache

import tracediff as td

REPO = Path(__file__).resolve().parents[1]
TOKENS = 16
WIDTHS = {"draft.fc_in": (3 * 4096, torch.bfloat16), "draft.hidden": (4096, torch.bfloat16),
          "draft.logits": (32000, torch.float32)}
DIVERGE_AT = 0.5  # the share of the steps before the one whose draft.hidden row 3 is scaled in b
# Peak RSS from the child's own VmHWM, and the peak of its anonymous memory (RssAnon, sampled every
# 20 ms): RSS also counts mapped trace pages, which the page cache holds; anonymous memory is the
# process's own.
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
FLOOR = """
import json, sys, time
sys.path.insert(0, {here!r})
from bench_sglang import torch_load_floor
print(json.dumps(torch_load_floor({a!r}, {b!r}), default=str))
"""


def write_set(base: Path, steps: int) -> dict[str, Path]:
    """Both sides as Arrow traces and as SGLang dumper folders, the same tensors."""
    generator = torch.Generator().manual_seed(0)
    pool = {name: torch.randn(TOKENS, width, generator=generator).to(dtype)
            for name, (width, dtype) in WIDTHS.items()}
    tokens = np.random.default_rng(0).integers(0, 32000, (TOKENS, steps))
    paths = {side: base / f"{side}.arrow" for side in "ab"}
    paths.update({f"dump_{side}": base / f"dump_{side}" for side in "ab"})
    for side in "ab":
        writer = DumperWriter(paths[f"dump_{side}"])
        with td.record(paths[side], source="bench", on_full="block", block_timeout=60) as rec:
            for step in range(steps):
                values = {}
                for name, rows in pool.items():
                    value = torch.roll(rows, shifts=step * 7, dims=1)
                    if side == "b" and name == "draft.hidden" and step == int(steps * DIVERGE_AT):
                        value = value.clone()
                        value[3] *= 1.5
                    rec.log(name, value, step=step, request=[f"r{i}" for i in range(TOKENS)],
                            positions=[step] * TOKENS, token_ids=tokens[:, step])
                    values[name.split(".")[1]] = value
                writer.step(step, values)
        writer.close()
    return paths


def files_under(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def drop(paths: list[Path]) -> None:
    os.sync()
    for path in paths:
        for file in files_under(path):
            drop_cache(file)


def timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    return time.perf_counter() - start, done


def compare_cli(a: Path, b: Path) -> tuple[float, dict, float]:
    """(seconds, the JSON report, peak anonymous MB) of ``tracediff compare --json``."""
    code = (PEAK + f"import sys; sys.argv = ['tracediff', 'compare', {str(a)!r}, {str(b)!r}, '--json']\n"
            "from tracediff.entry import main; main()")
    seconds, done = timed([sys.executable, "-c", code])
    report = json.loads(done.stdout[: done.stdout.rindex("}") + 1])
    anon_kb = int(done.stderr.strip().splitlines()[-1].split()[-3])
    return seconds, report, anon_kb / 1024


def cat(paths: list[Path]) -> float:
    start = time.perf_counter()
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def import_seconds(args: list[str]) -> float:
    """Seconds of imports (``-X importtime``, top-level modules summed) of ``tracediff ARGS``."""
    code = "import sys; sys.argv = ['tracediff', *sys.argv[1:]]\nfrom tracediff.entry import main; main()"
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code, *args], capture_output=True,
                          text=True)
    total = 0
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = line.split("|")
            if cumulative.strip().isdigit() and name.startswith(" ") and not name.startswith("  "):
                total += int(cumulative)
    return total / 1e6


def measure(base: Path, steps: int, reps: int) -> dict:
    paths = write_set(base, steps)
    traces, dumps = [paths["a"], paths["b"]], [paths["dump_a"], paths["dump_b"]]
    runs: dict[str, list[float]] = {k: [] for k in ("cat_cold", "cat_warm", "compare_cold", "compare_warm",
                                                    "sglang_cold", "sglang_warm", "floor_cold", "floor_warm")}
    anon, found = [], {}
    floor_code = [sys.executable, "-c", FLOOR.format(here=str(Path(__file__).parent), a=str(dumps[0]),
                                                     b=str(dumps[1]))]
    for _ in range(reps):
        for state in ("cold", "warm"):
            if state == "cold":
                drop(traces)
            else:
                cat(traces)
            runs[f"cat_{state}"].append(cat(traces))
            if state == "cold":
                drop(traces)
            seconds, report, peak = compare_cli(*traces)
            runs[f"compare_{state}"].append(seconds)
            anon.append(peak)
            first = report["first_divergence"]
            found["tracediff"] = (first["name"], first["row"]["step_a"])
            if state == "cold":
                drop(dumps)
            else:
                cat(files_under(dumps[0]) + files_under(dumps[1]))
            sglang = run_comparator(*dumps)
            runs[f"sglang_{state}"].append(sglang["seconds"])
            found["sglang"] = tuple(sglang["first_divergence"] or ())
            if state == "cold":
                drop(dumps)
            seconds, done = timed(floor_code)
            runs[f"floor_{state}"].append(seconds)
            found["floor"] = tuple(json.loads(done.stdout.strip().splitlines()[-1])["first_failing"] or ())
    median = {k: statistics.median(v) for k, v in runs.items()}
    nbytes = sum(p.stat().st_size for p in traces)
    return {"steps": steps, "trace_bytes": nbytes, "dump_files": sum(len(files_under(d)) for d in dumps),
            "runs": runs, "median": median, "compare_peak_anon_mb": max(anon), "first_divergence": found,
            "warm_compare_gbs": nbytes / median["compare_warm"] / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=390, help="steps of the large set (2.6 MB a step)")
    parser.add_argument("--small-steps", type=int, default=98, help="steps of the memory check's small set")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_compare"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    # A user's second run finds the package's bytecode cached; a shell with PYTHONDONTWRITEBYTECODE
    # (or a read-only checkout) would compile every module in every timed run instead, so compile
    # it once here, as any first run would.
    compileall.compile_dir(REPO / "tracediff", quiet=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    results: dict = {}
    for label, steps, reps in (("small", args.small_steps, 1), ("large", args.steps, args.reps)):
        (args.dir / label).mkdir(parents=True)
        results[label] = measure(args.dir / label, steps, reps)
        if label == "large":
            sample = REPO / "traces" / "eagle3"
            results["imports_s"] = {
                "--help": import_seconds(["--help"]),
                "show": import_seconds(["show", str(args.dir / label / "a.arrow")]),
                "compare sample (no compiled kernels)": import_seconds(
                    ["compare", str(sample / "training.h5"), str(sample / "serving.h5")]),
                "compare large": import_seconds(["compare", str(args.dir / label / "a.arrow"),
                                                 str(args.dir / label / "b.arrow")]),
            }
        shutil.rmtree(args.dir / label)
        print(label, json.dumps(results[label], indent=1), flush=True)
    m = results["large"]["median"]
    results["summary"] = {
        "sglang_over_compare_cold": m["sglang_cold"] / m["compare_cold"],
        "sglang_over_compare_warm": m["sglang_warm"] / m["compare_warm"],
        "floor_over_compare_cold": m["floor_cold"] / m["compare_cold"],
        "compare_over_cat_cold": m["compare_cold"] / m["cat_cold"],
        "warm_compare_gbs": results["large"]["warm_compare_gbs"],
        "peak_anon_growth": (results["large"]["compare_peak_anon_mb"]
                             / results["small"]["compare_peak_anon_mb"]),
        "size_growth": results["large"]["trace_bytes"] / results["small"]["trace_bytes"],
        "imports_s": results["imports_s"],
    }
    print(json.dumps(results["summary"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()

"""SGLang 0.5.23's own dump-and-compare path, as the benchmark drives it: the real dumper in-process,
the real comparator CLI as a subprocess (both read from the installed package, none of it copied),
and a floor to set them against: torch.load of each pair of dump files plus per-row metrics.

``DumperWriter`` configures SGLang's process-wide ``dumper`` singleton as ``DUMPER_ENABLE=1
DUMPER_DIR=<out_dir> DUMPER_EXP_NAME=<exp_name> DUMPER_ENABLE_OUTPUT_CONSOLE=0`` would in a server
(the env prefix is ``DUMPER_``, not ``SGLANG_DUMPER_``), and each ``step`` is one forward pass: a
``dumper.dump(name, tensor)`` per tensor, then ``dumper.step()`` as ``ModelRunner.forward`` calls it.
Files land in ``<out_dir>/<exp_name>/step=S___rank=0___dump_index=I___name=N___recompute_status=
disabled.pt``, each a ``{"value": tensor, "meta": {...}}`` dict. No process group is needed: the dumper
reads rank 0 / world size 1 when torch.distributed is not initialised, and with an exp_name given it
broadcasts nothing. The one difference from a TP=1 server's file is the meta's ``sglang_parallel_info``
(SGLang's error sentinel, no server context being published), which the comparator reads as unsharded.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))  # testbed/ from this checkout

from testbed import sglang_cpu  # noqa: E402

# `python -m sglang.srt.debug_utils.comparator` as is, except that on a machine without triton
# `import sglang` fails (sglang/__init__ -> srt.utils.common imports triton): there the child first
# installs SGLang's own triton stub (testbed.sglang_cpu, import stubs only), then runs the same
# __main__ module through runpy. With triton installed the wrapper adds nothing.
_COMPARATOR_MAIN = f"""\
import importlib.util, runpy, sys
sys.path.insert(0, {str(_ROOT)!r})
if importlib.util.find_spec("triton") is None:
    from testbed.sglang_cpu import _install_import_stubs
    _install_import_stubs()
sys.argv[0] = "comparator"
runpy.run_module("sglang.srt.debug_utils.comparator", run_name="__main__", alter_sys=True)
"""

COSINE_MIN = 0.999
MAX_ABS_REL_MAX = 3e-2


class DumperWriter:
    """Writes tensors through SGLang's real dumper, one forward pass per ``step``, under
    ``out_dir/exp_name``. The dumper is a process-wide singleton: one writer at a time."""

    def __init__(self, out_dir: str | os.PathLike[str], exp_name: str = "dump") -> None:
        sglang_cpu.prepare()
        from sglang.srt.debug_utils.dumper import DumperConfig, dumper

        self._dumper = dumper
        self.exp_dir = Path(out_dir) / exp_name
        config = DumperConfig(enable=True, dir=str(out_dir), exp_name=exp_name, enable_output_console=False)
        dumper.reset()
        dumper.configure(**asdict(config))  # every field, so stray DUMPER_* env vars do not leak in

    def step(self, step_index: int, tensors: Mapping[str, torch.Tensor]) -> int:
        """Dump ``tensors`` as forward pass ``step_index`` (the dumper's step counter, which starts at
        0 and only grows: skipped indices are passes that dump nothing); returns the files written."""
        state = self._dumper.get_state()
        if step_index < state["step"]:
            raise ValueError(f"step {step_index} is behind the dumper's step {state['step']}")
        with contextlib.redirect_stdout(None):  # dumper.step() prints a line per pass
            for _ in range(step_index - state["step"]):
                self._dumper.step()
            for name, tensor in tensors.items():
                self._dumper.dump(name, tensor)
            self._dumper.step()
        return self._dumper.get_state()["dump_index"] - state["dump_index"]

    def close(self) -> list[Path]:
        """Turn the dumper off and reset it; returns the files of this dump, in name order."""
        self._dumper.configure(enable=False)
        self._dumper.reset()
        return sorted(self.exp_dir.glob("*.pt"))


def run_comparator(baseline_dir: str | os.PathLike[str],
                   target_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Run SGLang's comparator CLI on two dump directories (a dumper ``dir`` holding one exp_name
    directory, or that directory), with its defaults (preset sglang_dev, ``rel <= 1e-3`` for every
    tensor, per-step comparison) and JSONL records on stdout; wall time around the subprocess."""
    cmd = [sys.executable, "-c", _COMPARATOR_MAIN, "--baseline-path", str(baseline_dir),
           "--target-path", str(target_dir), "--output-format", "json", "--report-path", ""]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failing = [r for r in records if r["type"].startswith("comparison") and _record_failed(r)]
    summary = next((r for r in records if r["type"] == "summary"), {})
    return {
        "seconds": seconds,
        "returncode": proc.returncode,
        "first_divergence": (failing[0]["name"], failing[0]["location"]["step"]) if failing else None,
        "passed": summary.get("passed"),
        "failed": summary.get("failed"),
        "output_tail": (proc.stdout + proc.stderr)[-2000:],
    }


def _record_failed(record: dict[str, Any]) -> bool:
    """A comparison record's ``category == "failed"`` or ``"errored"`` (output_types.py), from its JSON."""
    if record["type"] == "comparison_error" or record["errors"]:
        return True
    if record["type"] == "comparison_tensor":
        diff = record.get("diff") or {}
        return not diff.get("passed", False) or any(not c["passed"] for c in record["replicated_checks"])
    if record["type"] == "comparison_non_tensor":
        return not record["values_equal"]
    return False


def torch_load_floor(baseline_dir: str | os.PathLike[str],
                     target_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Load each pair of dump files (matched on rank, step and name) with torch.load and compute per-row
    max-abs diff and cosine similarity; the first failing pair in dump order is (name, step) with a row
    of cosine < 0.999 or max-abs diff / the baseline row's max-abs > 3e-2 (or no target file)."""
    start = time.perf_counter()
    baseline, target = _dump_files(Path(baseline_dir)), _dump_files(Path(target_dir))
    order = sorted(baseline, key=lambda key: (key[1], baseline[key][1]))  # step, then dump_index
    first_failing = None
    for key in order:
        path = target.get(key)
        if path is None or _rows_fail(_load_value(baseline[key][0]), _load_value(path[0])):
            first_failing = first_failing or (key[2], key[1])
    return {"seconds": time.perf_counter() - start, "files": len(baseline) + len(target),
            "first_failing": first_failing}


def _dump_files(directory: Path) -> dict[tuple[int, int, str], tuple[Path, int]]:
    """{(rank, step, name): (path, dump_index)} of a dump directory, descending into its one
    exp_name directory when it has no files of its own, as the comparator does."""
    files = list(directory.glob("*.pt"))
    if not files:
        subdirs = [sub for sub in directory.iterdir() if sub.is_dir() and any(sub.glob("*.pt"))]
        if len(subdirs) != 1:
            raise ValueError(f"{directory}: {len(subdirs)} dump directories inside, expected one")
        files = list(subdirs[0].glob("*.pt"))
    result = {}
    for path in files:
        tags = dict(part.split("=", 1) for part in path.stem.split("___"))
        result[int(tags["rank"]), int(tags["step"]), tags["name"]] = path, int(tags["dump_index"])
    return result


def _load_value(path: Path) -> torch.Tensor:
    """The tensor of a dump file: the dumper saves ``{"value": tensor, "meta": {...}}``."""
    loaded = torch.load(path, weights_only=True)
    return loaded["value"] if isinstance(loaded, dict) else loaded


def _rows_fail(baseline: torch.Tensor, target: torch.Tensor) -> bool:
    if baseline.shape != target.shape:
        return True
    x = baseline.float().reshape(baseline.shape[0] if baseline.dim() > 1 else 1, -1)
    y = target.float().reshape(x.shape)
    max_abs = (x - y).abs().amax(dim=1)
    cosine = torch.where(max_abs == 0, 1.0, torch.nn.functional.cosine_similarity(x, y, dim=1))
    rel = max_abs / x.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    return bool((cosine < COSINE_MIN).any() or (rel > MAX_ABS_REL_MAX).any())

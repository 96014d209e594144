#!/usr/bin/env bash
# The device check (scripts/gpu_check.py) as one prepared run on a machine with one GPU, from any folder.
#
# Installs nothing from the internet: it finds out what is importable, installs wheels carried in .whl/
# (offline, into a temp folder) if there are any, and runs with the repo on PYTHONPATH. Leaves
# gpu_check.json, gpu_check.log and the device-side traces (gpu_check_traces.tgz) in $OUT if set, else in a
# temp folder. Arguments go to gpu_check.py (e.g. --device cpu --quick). PYTHON picks the interpreter.
# Exit: 0 every check passed, 1 a check failed, 2 no GPU or bad arguments, 3 a package is missing, 124 timeout.
set -u -o pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
out=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
limit=${GPU_CHECK_TIMEOUT:-280}  # seconds: the whole run stays under 5 minutes
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1

if compgen -G "$repo/.whl/*.whl" >/dev/null; then
    site=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$repo"/.whl/*.whl; then
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "gpu_check: the wheels in .whl/ did not install; going on with the packages already there"
    fi
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader | sed 's/^/gpu_check: nvidia-smi: /'

# What is importable, and the versions in use; the record path needs torch, numpy, h5py and pyarrow.
"$py" - <<'EOF' || exit 3
import importlib

found, missing = [], []
for name, needed in (("numpy", True), ("torch", True), ("h5py", True), ("pyarrow", True),
                     ("transformers", False)):
    try:
        found.append(f"{name} {importlib.import_module(name).__version__}")
    except Exception as exc:  # ImportError, or a broken install that fails on import
        missing.append((name, needed, f"{type(exc).__name__}: {exc}"))
print("gpu_check: python packages:", ", ".join(found) or "none")
for name, needed, why in missing:
    print(f"gpu_check: {name} missing ({why}){'' if needed else ': the draft runs on synthesized target states'}")
required = [name for name, needed, _ in missing if needed]
if required:
    print(f"gpu_check: needs {' '.join(required)}; nothing is fetched here: carry them as wheels in .whl/ "
          "(pip download --no-deps --only-binary=:all: -d .whl NAME==VERSION, for this machine's python)")
    raise SystemExit(1)
try:
    import tracediff.record.recorder  # noqa: F401
except Exception as exc:
    print(f"gpu_check: tracediff does not import from the repo: {type(exc).__name__}: {exc}")
    raise SystemExit(1)
EOF

timeout "$limit" "$py" "$repo/scripts/gpu_check.py" --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && echo "gpu_check: stopped after ${limit} s (GPU_CHECK_TIMEOUT)" | tee -a "$out/gpu_check.log"
if [ -d "$out/traces" ]; then  # one file: the device machine returns few files
    tar -czf "$out/gpu_check_traces.tgz" -C "$out" traces && rm -rf "$out/traces"
fi
echo "gpu_check: results in $out (exit $rc)"
exit "$rc"

#!/usr/bin/env bash
# The project's own pytest on a CUDA machine, in one device command (docs/gpu.md):
#
#     bash tools/gpu_pytest.sh [--record] [--part K/N] [PYTEST ARGS...]
#
# Installs the carried wheels (.whl/: zstandard, syrupy, transformers 5.24, the GPU kernel libraries)
# into /tmp/site without a package index, then runs the suite with this checkout on PYTHONPATH. With
# --record it first records this machine's class's goldens (both scenarios, tools/gpu_session.py
# record; a tar of them comes back under $OUT/record) so the suite checks goldens of the code it runs.
# Writes $OUT/env.txt, $OUT/pytest.log and $OUT/junit.xml, and prints a table of outcomes per test
# file at the end. The whole script keeps to $GPU_PYTEST_BUDGET_S seconds (default 510): pytest is
# ended when that time is up (-m "not heavy" runs a shorter suite), so the log always comes back inside
# a 9-minute device command. --part K/N runs the K-th of N slices of the test files (every N-th file,
# by name), for when one command cannot hold the whole suite. Exit status: pytest's (124: ended).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-pytest-out}
BUDGET=${GPU_PYTEST_BUDGET_S:-510}
SECONDS=0
mkdir -p "$OUT"

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
else
    echo "no wheels in .whl/: using what this Python has"
fi
export PYTHONPATH=/tmp/site:$PWD

python3 - > "$OUT/env.txt" 2>&1 <<'EOF'
import importlib, platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
for name in ("transformers", "safetensors", "zstandard", "syrupy", "pyarrow", "rich", "pytest", "hypothesis",
             "xdist", "accelerate", "triton", "liger_kernel", "hatchling"):
    try:
        module = importlib.import_module(name)
        print(f"{name:14s} {getattr(module, '__version__', 'present')}")
    except Exception as exc:  # noqa: BLE001 - a report of what is there
        print(f"{name:14s} missing ({type(exc).__name__})")
EOF
cat "$OUT/env.txt"

if [ "${1:-}" = "--record" ]; then
    shift
    python3 tools/gpu_session.py record --out "$OUT/record" 2>&1 | tail -40
fi
SELECTED=()
if [ "${1:-}" = "--part" ]; then
    K=${2%/*}; N=${2#*/}; shift 2
    i=0
    for file in tests/test_*.py; do
        [ $(( i % N )) -eq $(( K - 1 )) ] && SELECTED+=("$file")
        i=$(( i + 1 ))
    done
    echo "part $K/$N: ${SELECTED[*]}"
fi

LIMIT=$(( BUDGET - SECONDS - 15 ))  # what is left, less the time to print the summary
start=$(date +%s)
timeout --signal=INT --kill-after=10 "$LIMIT" \
    python3 -m pytest -q -rs -p no:cacheprovider --durations=15 --junitxml="$OUT/junit.xml" "${SELECTED[@]}" "$@" \
    > "$OUT/pytest.log" 2>&1
status=$?
tail -60 "$OUT/pytest.log"
echo "pytest exit status $status after $(( $(date +%s) - start )) s (limit $LIMIT s)"

python3 - "$OUT/junit.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

try:
    cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
except (OSError, ET.ParseError) as exc:
    sys.exit(f"no junit report ({exc})")
rows, seconds = defaultdict(Counter), Counter()
for case in cases:
    parts = case.get("classname", "?").split(".")
    where = next((part for part in parts if part.startswith("test_")), parts[0])
    outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
    rows[where][outcome] += 1
    seconds[where] += float(case.get("time", 0))
print(f"{'test file':28s} {'passed':>7s} {'failed':>7s} {'error':>7s} {'skipped':>8s} {'seconds':>8s}")
for where in sorted(rows):
    c = rows[where]
    print(f"{where:28s} {c['passed']:7d} {c['failure']:7d} {c['error']:7d} {c['skipped']:8d} {seconds[where]:8.1f}")
total = sum(rows.values(), Counter())
print(f"{'total':28s} {total['passed']:7d} {total['failure']:7d} {total['error']:7d} {total['skipped']:8d} "
      f"{sum(seconds.values()):8.1f}")
EOF
exit $status

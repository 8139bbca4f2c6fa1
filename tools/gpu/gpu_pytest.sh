#!/usr/bin/env bash
# The project's own pytest on a CUDA machine, in one device command (docs/gpu.md):
#
#     bash tools/gpu/gpu_pytest.sh [--record] [--part K/N | --jobs N] [PYTEST ARGS...]
#
# Installs the carried wheels ($GPU_PYTEST_WHEELS, default .whl/: zstandard, syrupy, transformers 5.24,
# the GPU kernel libraries) into /tmp/site without a package index, then runs the suite with this
# checkout on PYTHONPATH. With --record it first records this machine's class's goldens (both
# scenarios, tools/gpu/gpu_session.py record; a tar of them comes back under $OUT/record) so the suite
# checks goldens of the code it runs. Writes $OUT/env.txt, $OUT/pytest.log and $OUT/junit.xml, and
# prints a table of outcomes per test file at the end. The whole script keeps to $GPU_PYTEST_BUDGET_S
# seconds (default 510): pytest is ended when that time is up (-m "not heavy" runs a shorter suite), so
# the log always comes back inside a 9-minute device command. --part K/N runs the K-th of N slices of
# the test files (every N-th file, by name), for when one command cannot hold the whole suite.
#
# --jobs N runs N pytest processes at once, all on the one GPU, on disjoint slices of the test files
# (tools/gpu/pytest_slices.py plan: the slowest files spread first, by tools/gpu/test_seconds.txt), each with
# its own --basetemp, log and junit report, and OMP_NUM_THREADS = TORCHINDUCTOR_COMPILE_THREADS = cores / N
# (N processes of 16 threads each would oversubscribe the cores), all within the one budget;
# $OUT/pytest.log holds the slices' logs one after the other, $OUT/junit.xml their merged reports,
# $OUT/seconds.txt the seconds per file (a refresh of tools/gpu/test_seconds.txt), and the table is of all
# of them. GPU_PYTEST_FILES="tests/test_a.py tests/test_b.py" slices those files only.
# Sharing the one GPU (the first --jobs 10 run on the H200: a slice failed in cublasCreate for want of
# memory, one hung past the budget): the files of $GPU_PYTEST_TOGETHER (those that hold much GPU memory or
# start many CUDA processes) go into one slice, so that no two of them run at once; every slice's pytest
# may take at most $GPU_PYTEST_SHARE of the GPU's memory ($GPU_PYTEST_HEAVY_SHARE for that slice) and
# gives its cached memory back after a big test (tests/conftest.py); each test's peak goes to
# $OUT/cuda-peaks.txt (MiB, node id, largest first) and nvidia-smi's samples of the GPU's memory (every
# 5 s, with the processes holding it) to $OUT/gpu-memory.txt.
#
# A test that runs over $GPU_PYTEST_TEST_TIMEOUT_S seconds (default 240) fails with the stacks of all its
# threads (pytest-timeout, when its wheel is carried; else pytest's faulthandler_timeout prints the stacks
# and the test runs on), so a hang costs one test, not its slice's budget.
# Exit status: pytest's (124: ended at the budget); with --jobs, 0 when every slice passed, else the
# first failing slice's.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-pytest-out}
BUDGET=${GPU_PYTEST_BUDGET_S:-510}
SECONDS=0
mkdir -p "$OUT"

WHEELS=${GPU_PYTEST_WHEELS:-.whl}  # the carried folder of wheels (.whl/s: transformers, zstandard, syrupy)
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl 2>&1 | tail -3
else
    echo "no wheels in $WHEELS/: using what this Python has"
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
    python3 tools/gpu/gpu_session.py record --out "$OUT/record" 2>&1 | tail -40
fi
SELECTED=()
JOBS=0
if [ "${1:-}" = "--part" ]; then
    K=${2%/*}; N=${2#*/}; shift 2
    i=0
    for file in tests/test_*.py; do
        [ $(( i % N )) -eq $(( K - 1 )) ] && SELECTED+=("$file")
        i=$(( i + 1 ))
    done
    echo "part $K/$N: ${SELECTED[*]}"
elif [ "${1:-}" = "--jobs" ]; then
    JOBS=$2; shift 2
fi

LIMIT=$(( BUDGET - SECONDS - 15 ))  # what is left, less the time to print the summary
start=$(date +%s)
PYTEST=(python3 -m pytest -q -rs -p no:cacheprovider --durations=15)
TEST_TIMEOUT=${GPU_PYTEST_TEST_TIMEOUT_S:-240}
# gpu_session.py's recording workers print their stacks before the test's timeout ends them
export GPU_SESSION_STACKS_AFTER_S=$(( TEST_TIMEOUT * 3 / 4 ))
if python3 -c "import pytest_timeout" 2>/dev/null; then
    PYTEST+=(--timeout="$TEST_TIMEOUT" --timeout-method=signal)
else
    echo "pytest-timeout is not installed (carry its wheel): a hung test prints its stacks but is not ended"
    PYTEST+=(-o faulthandler_timeout="$TEST_TIMEOUT")
fi
if [ "$JOBS" -eq 0 ]; then
    timeout --signal=INT --kill-after=10 "$LIMIT" \
        "${PYTEST[@]}" --junitxml="$OUT/junit.xml" "${SELECTED[@]}" "$@" > "$OUT/pytest.log" 2>&1
    status=$?
    tail -60 "$OUT/pytest.log"
    echo "pytest exit status $status after $(( $(date +%s) - start )) s (limit $LIMIT s)"
    python3 tools/gpu/pytest_slices.py table "$OUT/junit.xml"
    exit $status
fi

SLICES=$(mktemp -d /tmp/gpu-pytest-slices.XXXXXX)  # the slices' own files; only merged ones go to $OUT
THREADS=$(( $(nproc) / JOBS )); [ "$THREADS" -ge 1 ] || THREADS=1
read -ra ONLY <<< "${GPU_PYTEST_FILES:-}"  # a few files instead of tests/test_*.py (to try the mode)
read -ra TOGETHER <<< "${GPU_PYTEST_TOGETHER-tests/test_realshape.py tests/test_multimodal_models.py tests/test_gpu_session_record.py}"
mapfile -t PLAN < <(python3 tools/gpu/pytest_slices.py plan "$JOBS" "${ONLY[@]}" --together "${TOGETHER[@]}")
SHARE=${GPU_PYTEST_SHARE:-0.15}; HEAVY_SHARE=${GPU_PYTEST_HEAVY_SHARE:-0.4}
sampler=""
if command -v nvidia-smi >/dev/null; then
    (  # the GPU's memory every 5 s, and which processes hold it (pid, MiB, command)
        while :; do
            echo "--- $(( $(date +%s) - start )) s: $(nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader)"
            nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | while IFS=', ' read -r pid mib _; do
                echo "$pid $mib MiB $(ps -o args= -p "$pid" 2>/dev/null | cut -c1-160)"
            done
            sleep 5
        done
    ) > "$OUT/gpu-memory.txt" 2>&1 &
    sampler=$!
fi
pids=(); names=()
set -m  # job control: without it a background job ignores SIGINT, and the budget's INT could not end pytest
for k in "${!PLAN[@]}"; do
    [ -n "${PLAN[$k]}" ] || continue  # more slices than files: an empty slice would run the whole suite
    read -ra files <<< "${PLAN[$k]}"
    share=$SHARE
    [ "${#TOGETHER[@]}" -gt 0 ] && [[ " ${files[*]} " == *" ${TOGETHER[0]} "* ]] && share=$HEAVY_SHARE
    echo "slice $(( k + 1 ))/$JOBS (GPU memory share $share): ${files[*]}"
    (
        export OMP_NUM_THREADS=$THREADS TORCHINDUCTOR_COMPILE_THREADS=$THREADS
        export VEOSNAP_TEST_CUDA_MEMORY_FRACTION=$share VEOSNAP_TEST_CUDA_PEAKS="$SLICES/peaks-$(( k + 1 ))"
        timeout --signal=INT --kill-after=10 "$LIMIT" \
            "${PYTEST[@]}" --basetemp="$SLICES/tmp-$(( k + 1 ))" --junitxml="$SLICES/junit-$(( k + 1 )).xml" \
            "${files[@]}" "$@" > "$SLICES/pytest-$(( k + 1 )).log" 2>&1
        echo "$? $(( $(date +%s) - start ))" > "$SLICES/status-$(( k + 1 ))"
    ) &
    pids+=($!); names+=($(( k + 1 )))
done
set +m
wait "${pids[@]}"
[ -z "$sampler" ] || kill "$sampler" 2>/dev/null
cat "$SLICES"/peaks-* 2>/dev/null | sort -rn > "$OUT/cuda-peaks.txt"
status=0
for k in "${names[@]}"; do
    read -r s took < "$SLICES/status-$k"
    echo "slice $k/$JOBS: pytest exit status $s after $took s (limit $LIMIT s)" | tee -a "$SLICES/status.txt"
    if [ "$s" -ne 0 ] && [ "$s" -ne 5 ] && [ "$status" -eq 0 ]; then status=$s; fi  # 5: nothing collected there
done
for k in "${names[@]}"; do
    { echo "=== slice $k/$JOBS: ${PLAN[$(( k - 1 ))]}"; cat "$SLICES/pytest-$k.log"; } >> "$OUT/pytest.log"
done
cat "$SLICES/status.txt" >> "$OUT/pytest.log"
for k in "${names[@]}"; do
    echo "--- slice $k/$JOBS, last lines"
    tail -25 "$SLICES/pytest-$k.log"
done
cat "$SLICES/status.txt"
echo "largest per-test peaks of GPU memory reserved in the slices' pytest processes (MiB; all in cuda-peaks.txt):"
head -8 "$OUT/cuda-peaks.txt"
[ -z "$sampler" ] || echo "most GPU memory in use at once (gpu-memory.txt): $(grep '^---' "$OUT/gpu-memory.txt" \
    | sort -t: -k2 -n | tail -1)"
reports=(); for k in "${names[@]}"; do reports+=("$SLICES/junit-$k.xml"); done
python3 tools/gpu/pytest_slices.py table "${reports[@]}" --merged "$OUT/junit.xml" --seconds "$OUT/seconds.txt" \
    || { [ "$status" -ne 0 ] || status=1; }
rm -rf "$SLICES"
echo "gpu_pytest --jobs $JOBS: exit status $status after $SECONDS s"
exit $status

#!/usr/bin/env bash
# Build a separate environment for the VeOmni example and run it (one command):
#
#   tools/veomni_env.sh                 # build .venv-veomni if needed, run every zoo model x layout
#   tools/veomni_env.sh --quick         # 5 models; multi-process layouts fsdp2 and ep only (what the test runs)
#   tools/veomni_env.sh --out DIR ...   # also write DIR/results.json and DIR/table.md
#
# VeOmni pins its own transformers (0.1.12 is generated against 5.9.0 and supports 5.9-5.22), so it
# cannot share veosnap's main environment (transformers 5.24). The environment holds torch==2.13.0 (CPU,
# from local disk), transformers $VEOMNI_TRANSFORMERS (default 5.22.2, the newest VeOmni supports),
# accelerate (veosnap's ep/tp layouts load through transformers' DistributedConfig), veomni==0.1.12
# installed with --no-deps (its declared dependencies are for its trainer and data pipeline; the model
# builder, ops config and parallelize import nothing beyond torch and transformers' own dependencies),
# and this checkout of veosnap, editable. An environment whose versions already match is reused.
# Everything after the options below goes to examples/veomni/run.py.
#
# Environment: VEOMNI_VENV (default .venv-veomni in the repository), VEOMNI_TRANSFORMERS, VEOMNI_VERSION.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VEOMNI_VENV:-$root/.venv-veomni}"
transformers_version="${VEOMNI_TRANSFORMERS:-5.22.2}"
veomni_version="${VEOMNI_VERSION:-0.1.12}"
python="${PYTHON:-python3}"

ready() {
    [ -x "$venv/bin/python" ] && "$venv/bin/python" - "$transformers_version" "$veomni_version" "$root" <<'PY'
import importlib.metadata as md, sys
from pathlib import Path
want_tf, want_veomni, root = sys.argv[1:]
ok = md.version("transformers") == want_tf and md.version("veomni") == want_veomni and md.version("torch").startswith("2.13.0")
md.version("accelerate")
import veosnap
ok = ok and Path(veosnap.__file__).resolve().is_relative_to(Path(root).resolve())
sys.exit(0 if ok else 1)
PY
}

if ! ready 2>/dev/null; then
    {  # the build's output goes to stderr: stdout is the example's table
        echo "building $venv (torch 2.13.0, transformers $transformers_version, veomni $veomni_version --no-deps)" >&2
        if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
            echo "$venv exists and is not a virtual environment: not replacing it (set VEOMNI_VENV)"; exit 2
        fi
        rm -rf "$venv"
        nice -n 10 "$python" -m venv "$venv"
        nice -n 10 "$venv/bin/pip" install -q "torch==2.13.0" "transformers==$transformers_version" accelerate
        nice -n 10 "$venv/bin/pip" install -q --no-deps "veomni==$veomni_version"
        nice -n 10 "$venv/bin/pip" install -q --no-deps -e "$root"
        # veosnap's own dependencies, without letting them move transformers or torch.
        nice -n 10 "$venv/bin/pip" install -q "safetensors>=0.4" "zstandard>=0.22" "pyarrow>=14" "rich>=13" "pytest>=8" \
            "syrupy>=7.0,<8" "transformers==$transformers_version" "torch==2.13.0"
    } >&2
    ready || { echo "$venv: built, but the versions do not match (see pip list)" >&2; exit 2; }
fi

cd "$root"
exec nice -n 10 "$venv/bin/python" examples/veomni/run.py "$@"

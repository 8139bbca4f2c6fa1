"""Certify committed goldens in place: plant veosnap's canaries against each golden as it is on disk and keep
the sensitivity they certify in its manifest, leaving its tensors untouched. No approval is appended: the commit
that changes the goldens is their review, and a golden with no trail is still recorded over by a machine that
reproduces its tensors.

`veosnap refresh` does the same for a golden whose fresh recording is within noise of it; this script is for
goldens a refresh on this machine would re-record (another CPU of the class measures some bounds a little
differently), so that adding a certificate does not churn their tensors. A golden a canary passes is left as
it is, with the one-line refusal printed; the exit status is 1 when any was.

    python tools/data/certify_goldens.py goldens/cpu/llama/step-float32.safetensors.zst ...
    python tools/data/certify_goldens.py --again goldens/cpu/*/train-bfloat16*.zst     # what veosnap catches changed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from veosnap.errors import VeosnapError
from veosnap.golden import store
from veosnap.reference.zoo import Project
from veosnap.runs.canaries import sensitivity_note
from veosnap.runs.record import certified, encode_checked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--again", action="store_true",
                        help="certify goldens that are certified already (what veosnap catches changed)")
    args = parser.parse_args()
    project = Project.resolve()
    refused = 0
    for path in args.paths:
        golden = store.read(path, root=project.goldens)
        if golden.manifest.reference.sensitivity and not args.again:
            print(f"unchanged {path}  (certified already)")
            continue
        try:
            certified(project, golden)
        except VeosnapError as exc:
            print(f"veosnap: error: {exc}", file=sys.stderr)
            refused += 1
            continue
        store.write_bytes(encode_checked(golden, path), path, project.goldens)
        print(f"certified {path}  {sensitivity_note(golden.manifest.reference.sensitivity)}")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())

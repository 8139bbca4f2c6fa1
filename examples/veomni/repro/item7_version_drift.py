"""Item 7: a transformers version other than the golden's is reported as a numerics failure.

    .venv-veomni/bin/python examples/veomni/repro/item7_version_drift.py     # transformers 5.22.2 (tools/veomni_env.sh)

The cpu goldens were recorded with transformers 5.24.0. transformers 5.22 builds DeepSeek-V3's router
weight in the model's dtype, 5.24 keeps it in float32: the plain *eager* reference itself then fails
its own bfloat16 golden ("grad.model.layers.1.mlp.gate.weight ... dtype bfloat16 but golden float32",
inf x bound), and nothing in the report (text or JSON) says the versions differ. Prints the golden's
provenance, this environment's versions, and the eager check's verdict and notes.
"""

import importlib.metadata as md
from pathlib import Path

from veosnap import GoldenKey, Project
from veosnap.candidates import backends
from veosnap.reference.zoo import load_golden
from veosnap.runs.check import check

root = Path(__file__).resolve().parents[3]
project = Project.resolve(goldens=root / "goldens", configs=root / "toy_configs", testdata=root / "testdata")
key = GoldenKey("cpu", "deepseek_v3", "step", "bfloat16")
provenance = load_golden(project, key).manifest.provenance
print("golden:", {k: getattr(provenance, k) for k in ("torch", "transformers")})
print("here:  ", {k: md.version(k) for k in ("torch", "transformers")})
report = check(project, key, backends.resolve("eager"))
print("eager check:", report.status, "| worst:", report.worst.name if report.worst else None,
      "| notes:", report.notes or "none", "| mentions a version:", "transformers" in " ".join(report.notes))

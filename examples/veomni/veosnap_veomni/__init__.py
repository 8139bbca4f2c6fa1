"""veosnap_veomni: VeOmni (0.1.12) as a veosnap candidate, importable by a kernel author's own tests.

    import sys; sys.path.insert(0, "examples/veomni")      # or PYTHONPATH=examples/veomni
    import veosnap_veomni as vv

    def my_moe(model, ctx):                                  # a veosnap backend (a generator)
        with vv.restored():                                  # registry, op slots, MoE pointers put back after
            vv.register_fused_moe("mine", my_grouped_gemm)   # VeOmni's KERNEL_REGISTRY + its MoE dispatcher
            yield from vv.candidate(model, ctx, vv.ops_config(moe_implementation="fused_mine"))

The public API is `__all__` (listed in docs/api.md; tests/test_veomni_adapter.py fails when a listed name
goes away):

- build VeOmni's model for a layout: `candidate(reference, ctx, ops, collator=, own_fsdp2=)` (the generator
  a backend yields from), `ops_config(**overrides)` (VeOmni's `OpsImplementationConfig`, every op eager but
  the overrides; `EAGER_OPS`, `EAGER_PATH`), and its parts: `build`, `load_reference`, `reference_state`,
  `parallel_state`, `parallelized` (VeOmni's own FSDP2), `packing_collator` (its `PackingCollator`),
  `with_pipeline_masks`, `runs_here`, `registry_key`, `families`, `WEIGHT_RENAMES`;
- snapshot and restore what VeOmni changes in the process: `restored()` (a context manager), `Snapshot`,
  `FUSED_MOE_POINTERS`; register a fused MoE kernel the way VeOmni's own are: `register_fused_moe`;
- where VeOmni stands: `MISSING` (why it is not importable, or ''), `IMPORT_REGISTRATIONS`, `import_veomni`;
- the example's backends: `veomni`, `veomni_sdpa`, `veomni_chunk_loss`, `veomni_collator`, `veomni_fsdp2`,
  `veomni_ulysses`, and VeOmni's production GPU kernels (`kernels`: what each needs, what a check ran):
  `veomni_fused_moe`, `veomni_quack`, `veomni_liger`, `veomni_liger_loss`, `veomni_fa4`, `veomni_fla`,
  `veomni_production` (also served as `examples/veomni/plugin.py:<name>`, or as `veosnap_veomni:<name>`
  with examples/veomni on PYTHONPATH).

Importable without VeOmni: `MISSING` then says why, and every backend is a skip with that reason.
"""

from __future__ import annotations

from .state import FUSED_MOE_POINTERS, IMPORT_REGISTRATIONS, MISSING, Snapshot, register_fused_moe, restored
from .core import (EAGER_OPS, EAGER_PATH, WEIGHT_RENAMES, build, families, import_veomni, load_reference,  # noqa: I001
                   ops_config, packing_collator, parallel_state, parallelized, reference_state, registry_key,
                   runs_here, with_pipeline_masks)
from .backends import (candidate, veomni, veomni_chunk_loss, veomni_collator, veomni_fa4, veomni_fla,
                       veomni_fsdp2, veomni_fused_moe, veomni_liger, veomni_liger_loss, veomni_production,
                       veomni_quack, veomni_sdpa, veomni_ulysses)

__all__ = [
    "candidate", "ops_config", "EAGER_OPS", "EAGER_PATH", "build", "load_reference", "reference_state",
    "parallel_state", "parallelized", "packing_collator", "with_pipeline_masks", "runs_here", "registry_key",
    "families", "WEIGHT_RENAMES",
    "restored", "Snapshot", "FUSED_MOE_POINTERS", "register_fused_moe",
    "MISSING", "IMPORT_REGISTRATIONS", "import_veomni",
    "veomni", "veomni_sdpa", "veomni_chunk_loss", "veomni_collator", "veomni_fsdp2", "veomni_ulysses",
    "veomni_fused_moe", "veomni_quack", "veomni_liger", "veomni_liger_loss", "veomni_fa4", "veomni_fla",
    "veomni_production",
]

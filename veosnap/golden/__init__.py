"""The golden: what a check compares against, and nothing that runs a model.

- `key`: what a golden is the reference for (hardware class, model, scenario, dtype) and its path.
- `names`: the typed vocabulary of the tensors a golden holds (`loss`, `layers.N.output`, `grad.<param>`, ...).
- `manifest`: the typed manifest (reference, provenance, tolerances, approvals) and its canonical JSON.
- `codec`: a golden in memory (`Golden`) to and from its bytes, refusing anything oversized or corrupt.
- `store`: where goldens live, atomic writes, reading and listing a goldens directory.

This package imports nothing else of veosnap but `errors`.
"""

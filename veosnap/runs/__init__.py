"""What veosnap runs: record goldens, check candidates (the one orchestrator), the support matrix,
diff, refresh and verify goldens. Each returns typed results that `render` draws.

- `verdict`: `CheckReport`, the result of checking one candidate against one golden.
- `check`: the one check orchestrator the CLI, the matrix and the pytest plugin call.
- `record`, `refresh`: write goldens from the reference; `diff`: how goldens moved; `verify`: are they whole.
- `matrix`: models by (backend, layout), every cell a check.

Imports golden, numerics, reference and candidates; never render or surfaces.
"""

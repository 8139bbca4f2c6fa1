"""Built-in backends that switch a model to a kernel library: flash-attn 4 (`fa4`), flash-linear-attention
(`fla`), quack's grouped GEMM (`quack`) and liger-kernel (`liger`).

Each module defines `requires()` (why this machine cannot run it: no CUDA GPU of the capability it
needs, the package missing) and the backend function, registered by `..backends`. A backend declines
a model it would change nothing in (`Unsupported`, with the reason), counts during the check what its
kernels ran and for which of the model's modules (`support.Ran`), says so in the report, and fails the
check when it ran nothing at all: a kernel that silently replaced nothing would pass every check.
"""

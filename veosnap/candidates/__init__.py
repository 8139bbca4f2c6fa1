"""Candidates: what is checked against a golden, made from the reference.

- `specs`: how a SPEC names an extension (a registered name, `path/file.py:obj`, `module:obj`, an
  entry point), for backends and layouts alike.
- `backends`: how a candidate model is made from the reference model (kernels, patches, compile).
- `kernels/`: the built-in backends of kernel libraries (flash-attn 4, flash-linear-attention, quack,
  liger), each saying what it needs, what it declines and what it ran.
- `layouts/`: how the golden's batch and the model are split across rows, micro-batches and
  processes (one `Layout` protocol; in process or on torchrun ranks).

Imports golden, numerics and reference; never runs, render or surfaces.
"""

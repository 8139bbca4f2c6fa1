"""Numerics: the row-error metric, reference noise and bounds, comparators, and row sketches.

Modules here are pure functions over tensors and small dataclasses; they import nothing from the
rest of veosnap but `veosnap.errors`.
"""

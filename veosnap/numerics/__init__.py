"""Numbers about tensors: the row-error metric, reference noise and bounds, route comparison, the
tensor comparators, row sketches, and how numbers read in reports.

- `metric`: a tensor cut into rows; the row error of a candidate against the golden.
- `tolerance`: the reference's noise, the bound rule (alpha x noise + floor), few-row pooling.
- `routes`: router margins and how two sets of expert choices compare.
- `compare`: each golden tensor against a candidate's, as typed results (`TensorResult`, `RouteDiff`).
- `sketch` (+ `sketch_triton`, `sketch_rule`): seeded row sketches that answer the row-error metric at bounded size.
- `fmt`: the one place numbers are formatted for people.

Pure functions over tensors and small dataclasses; imports only `golden` and `errors`.
"""

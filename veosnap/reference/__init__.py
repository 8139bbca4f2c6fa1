"""The reference: the HF eager model veosnap records and every candidate is built from.

- `zoo`: where configs, test data and goldens live (`Project`), toy configs, loading a checked golden.
- `models`, `weights`: the reference model, with weights derived from (seed, parameter name).
- `hardware`: hardware classes and devices.
- `inputs`: batches (the golden's padded one, packed ones) from the test data or a golden's inputs.
- `probes`: hooks on a model: decoder layers, logits, MoE routers (record and replay routes).
- `capture`: one forward and backward, every tensor a golden holds.
- `train`: the `train` scenario's optimizer steps.
- `determinism`: fixed threads, deterministic algorithms, TF32 off.

Imports `golden` and `numerics`, never candidates or anything to their right.
"""

"""Layouts: how the golden's batch and the candidate model are split across rows, micro-batches,
positions and processes, each checked against the same single-process golden.

- `protocol`: the one `Layout` protocol (accept, load, wrap, shard, accumulate, clip), `LayoutContext`,
  `Setup`, `Shard`. Start here to write a layout.
- `engine`: runs any layout on one rank (or in process) and assembles its capture.
- `registry`: layouts by name, and SPECs (`path/file.py:obj`, `module:obj`, entry point `veosnap.layouts`).
- one file per layout: `single`, `packed`, `microbatch` (in process); `ddp`, `fsdp2`, `hsdp`, `tp`, `ep`,
  `sp` (Ulysses, with `sp_packed`, `sp_fsdp2`, `sp_ep`), `cp` (all-gathered keys/values, with `cp_packed`)
  (torchrun ranks). `hf_parallel`: loading through transformers' DistributedConfig (tp, ep). `sequence`:
  what sp and cp share (slicing along positions, whole-sequence masks, the attention exchange hook).
- `torchrun`: the parent's side of a multi-process check (start, time limit, why it failed, results);
  `worker`: one rank (`python -m veosnap.candidates.layouts.worker`).
"""

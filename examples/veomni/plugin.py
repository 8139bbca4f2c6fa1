"""VeOmni 0.1.12 as a veosnap candidate: its own model classes, ops config, collator and parallelism.

    veosnap check --backend examples/veomni/plugin.py:veomni                          # every zoo model
    veosnap check --backend examples/veomni/plugin.py:veomni --layout ddp --layout fsdp2 --layout hsdp
    veosnap check --backend examples/veomni/plugin.py:veomni_fsdp2 --layout fsdp2     # VeOmni's own FSDP2 wrapping
    veosnap check --backend examples/veomni/plugin.py:veomni_collator --layout fsdp2  # VeOmni's packing collator

The worked case of docs/backends.md. The code is the package `veosnap_veomni` beside this file (import it
in your own tests: docs/api.md lists its API); this file serves its backends under `plugin.py:<name>`, and
the helpers that lived here until now still resolve, for one release, warning where they moved. Each backend is a generator backend that takes where it runs
(`ctx`, a `veosnap.Context`): it receives the HF eager reference veosnap built (the golden's weights,
dtype and device), builds VeOmni's patched model class for the same config through
`veomni.models.build_foundation_model` with an explicit `OpsImplementationConfig` (the model types it
builds are VeOmni's own registry, `families()`; an omni thinker is built through its omni model's entry),
loads the reference's state dict into it (`WEIGHT_RENAMES` maps the names VeOmni's generated code, based
on transformers 5.9, spells differently), sets up VeOmni's parallel state for the layout it is told,
yields the model (declaring, for the all-eager backends, that it runs the reference path:
`Candidate(reference_path=...)`), and in its `finally` restores what VeOmni changed in the process. A
model VeOmni ships but cannot run here is declined with the reason found by building it (a package its
modeling imports that is not installed; Qwen3.5's linear attention, varlen only, with no CPU kernel).
VeOmni's multimodal models get `image_mask`/`video_mask`/`audio_mask` as its data pipeline makes them. Everything else is veosnap's: a loss without logits (GPT-OSS, the
chunked loss) is compared on every other tensor, DeepSeek-V3's one-tensor router is read at its
experts' inputs, what VeOmni prints goes to stderr, and the patches stay applied while a layout runs.

- `veomni_collator` hands VeOmni the batch in its production form: `Candidate(adapt_batch=...)` runs
  VeOmni's own `PackingCollator` (padding removed, sequences in one row, position ids restarting,
  `cu_seq_lens_*` and `max_length_*` for varlen kernels) and says where each packed token stands in
  the golden's batch, so the comparison stays on the golden's tokens.
- `veomni_fsdp2` is VeOmni's production path, `build_parallelize_model` (meta init, its own FSDP2
  wrapping, its weight loader), declared `@parallelizes`: the layout hands it the plain reference and
  does not shard it a second time.

What VeOmni changes in the process (found by running every path), and what this plugin does about it,
the "must restore" list of a real framework:

- `transformers.loss.loss_utils.LOSS_MAPPING["ForCausalLM" | "ForConditionalGeneration" |
  "ForSequenceClassification"]` (`build_foundation_model` -> `install_loss_mapping`): VeOmni's losses
  return `(loss, logits, aux)`, so every HF model built later would get a tuple for a loss. Restored
  when the check is done (a test fails without it).
- VeOmni's ops config (`veomni.ops.config.singleton`) and the OpSlots of its modeling modules
  (`build_foundation_model`): the ops config is restored when the check is done; OpSlots are rebound
  at every build.
- VeOmni's parallel state (`veomni.distributed.parallel_state`: the global state, its topology cache,
  a registry of meshes and groups; `init_parallel_state`): set for the layout, cleared when the check
  is done (and before it, so nothing earlier is taken for this check's).
- At `import veomni`: five `veomni_*_with_sp` names in transformers' `ALL_ATTENTION_FUNCTIONS`, two
  mask functions, a wrapped `load_and_register_attn_kernel`, `logging.Logger.info_rank0` and friends.
  Left: additive (nothing an HF eager model uses changes), and VeOmni's imported modules call them. This
  plugin imports VeOmni when it loads, before veosnap snapshots the process for a check, so they are
  part of the process every check starts from (`veosnap_veomni.IMPORT_REGISTRATIONS` lists them, said once by run.py),
  not "left behind" by every candidate.
- A `veomni` logger writing INFO lines to stdout, and transformers' docstring checks printing to stdout
  when VeOmni's modeling files import: nothing to do, veosnap points stdout at stderr while candidates run.
- `torch.utils.checkpoint.CheckpointFunction` (`build_parallelize_model(enable_reentrant=True)`): not
  used (gradient checkpointing is off).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the package beside this file (torchrun ranks too)
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from veosnap_veomni import (veomni, veomni_chunk_loss, veomni_collator, veomni_fa4,  # noqa: E402, F401
                            veomni_fla, veomni_fsdp2, veomni_fused_moe, veomni_liger, veomni_liger_loss,
                            veomni_production, veomni_quack, veomni_sdpa, veomni_ulysses)

# name this file had until now -> its name in veosnap_veomni (served here, warning, for one release)
MOVED = {name: name for name in (
    "WEIGHT_RENAMES", "EAGER_OPS", "EAGER_PATH", "MISSING", "IMPORT_REGISTRATIONS", "families", "build",
    "registry_key", "reference_state", "load_reference", "with_pipeline_masks", "parallel_state", "parallelized",
    "packing_collator")} | {"_ops": "ops_config", "_restored": "restored",
                            "_runs_here": "runs_here", "_import_veomni": "import_veomni"}


def __getattr__(name: str) -> object:
    if name not in MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    new = MOVED[name]
    warnings.warn(f"examples/veomni/plugin.py's {name} moved to veosnap_veomni.{new}: `from veosnap_veomni import "
                  f"{new}` (with examples/veomni on sys.path); plugin.py's goes away in the next release",
                  DeprecationWarning, stacklevel=2)
    import veosnap_veomni

    return getattr(veosnap_veomni, new)

"""Prove the recipe for the ten new toy models (issue 15) before veosnap integrates them.

For each of the ten models issue 15 added to `toy_configs/`: build it from its toy config as the HF eager reference (eager
attention, eager experts, float32), draw its weights the way veosnap does (`veosnap.reference.weights.initialize`)
plus the proposed rules where veosnap's rule does not fit (`--rules veosnap` leaves them out), and run
forward + backward on: a text-only left-padded batch; for the vision-language and omni models an
image+text batch, a video+text batch, an audio+text batch (omni), a mixed batch where half the rows
carry no image, with and without a frozen vision tower. Each model also gets: a float64 run under
`veosnap.models.KeepFloat64` compared with float32 (where that mode fails, as on transformers 5.17, the
integer-cast variant `KeepFloat64Ints` runs instead and the failure is reported); a bfloat16 build; a
packed batch (position ids restarting, 3-D M-RoPE
ids per sequence for the VLMs) compared with the padded one; each text row alone compared with the
padded batch; explicit 3-D position ids compared with the model's own `get_rope_index`; the smallest
MoE router margin over real tokens; and the hook points a capture needs.

Prints one table row per model and per-model details, writes `results.json` and per-model tensors
(`<model>.safetensors`: loss and logits of the text, image, video and audio batches) under `--out`
(default `$OUT` or `./try_new_models_out`). `--compare A B` compares two such folders tensor by tensor;
`--save-weights` / `--weights-from DIR` let a run under another transformers use the same weights even
where parameter names differ (the omni thinkers' were renamed between 5.17 and 5.24). CPU only, about
20 s on two cores; pillow, if installed, adds a check against HF's Qwen2-VL image processor.

    python tools/try_new_models.py [--models qwen3_5 ...] [--rules proposed|veosnap] [--out DIR]
    python tools/try_new_models.py --compare DIR_A DIR_B
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from veosnap.reference import inputs as vinputs  # noqa: E402
from veosnap.reference import media  # noqa: E402
from veosnap.reference import weights  # noqa: E402
from veosnap.reference.models import KeepFloat64, hf_config  # noqa: E402
from veosnap.reference.probes import find_moe_layers  # noqa: E402
from veosnap.reference.zoo import load_config  # noqa: E402

CONFIGS = ROOT / "toy_configs"
TESTDATA = ROOT / "testdata"
IGNORE = vinputs.IGNORE_INDEX
SEED = 0

MODELS = ["qwen3_5", "qwen3_5_moe", "seed_oss", "deepseek_v4", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
          "qwen3_vl_moe", "qwen2_5_omni", "qwen3_omni_moe"]
TEXT_ONLY = {"seed_oss", "deepseek_v4"}
# DeepSeek-V4's compressors cut windows at fixed tensor positions, so left padding shifts them (HF's own
# output for a row changes with its padding); right padding keeps every real token's windows.
PADDING_SIDE = {"deepseek_v4": "right"}
PLACEHOLDERS = (media.IMAGE, media.VIDEO, media.AUDIO)

# Batches (rows of multimodal_sequences.parquet by sample name; ("text", i) is row i of sequences.parquet).
IMAGE_ROWS = ["image_tiny", "image_two", "image_big", ("text", 0)]
VIDEO_ROWS = ["video_square", "video_odd", ("text", 1), ("text", 2)]
AUDIO_ROWS = ["audio_tone", "audio_chirp", "audio_long", "image_audio"]
MIXED_ROWS = [("text", 0), "image_tiny", ("text", 1), "image_two"]


# --------------------------------------------------------------------------------------------- build


def auto_class(name: str):
    """Text models: AutoModelForCausalLM. VLMs and omni thinkers: AutoModelForImageTextToText."""
    return transformers.AutoModelForCausalLM if name in TEXT_ONLY else transformers.AutoModelForImageTextToText


def build_empty(name: str, dtype: torch.dtype) -> nn.Module:
    config = hf_config(load_config(CONFIGS, name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto_class(name).from_config(config, attn_implementation="eager", experts_implementation="eager",
                                            dtype=dtype)


def lm_prefix(model: nn.Module) -> str:
    """The dotted path of the language model (whose `.layers` a capture hooks)."""
    decoder = model.get_decoder()
    return next(n for n, m in model.named_modules() if m is decoder)


@dataclass
class RuleNote:
    name: str
    rule: str
    before: str
    after: str


def _stats(t: torch.Tensor) -> str:
    t = t.detach().float()
    return f"mean {t.mean():.3g} std {t.std() if t.numel() > 1 else 0:.3g}"


@torch.no_grad()
def proposed_rules(model: nn.Module, seed: int, hf_init: dict[str, torch.Tensor]) -> list[RuleNote]:
    """Where veosnap's weight rule does not fit the new families, the values proposed instead.

    1. A 1-D parameter that HF initializes to a constant c gets c + 0.1 * noise (veosnap's norm and bias
       rules are the special cases c = 1 and c = 0). It matters where c is not what the name suggests:
       Qwen3.5's zero-centred RMSNorms compute x * (1 + w) and start at w = 0 (veosnap's rule gives
       1 + 0.1 * noise, a doubled scale); Gated DeltaNet's dt_bias and mHC's scales start at 1; LayerNorm
       biases (veosnap's rule gives every 1-D parameter named "norm" 1 + noise, biases included) and
       norms without "norm" in their name (Qwen2-VL's merger `ln_q`, which veosnap draws at 0.1 * noise).
    2. `A_log` (Gated DeltaNet decay rates): log(A), A uniform in [0.1, 1] from (seed, name), so the
       per-token decay exp(-A * softplus(a + dt_bias)) spans fast and slow memories (HF: A in [0.01, 16],
       where A = 16 forgets everything at once; veosnap's bias rule gives A ~ 1 for every head).
    3. `tid2eid` (DeepSeek-V4 hash routing table, a buffer HF leaves at zeros, i.e. every token to expert 0
       twice): each token's code dimensions, the experts the routers of the other layers also favour.
    4. Output projections that write into the residual stream but are not called o_proj/down_proj
       (Gated DeltaNet `out_proj`, DeepSeek-V4 `o_b_proj`) damp the code dimensions as veosnap's do.
    5. For MoE VLMs, the projectors that write vision/audio features into the language model's stream
       (merger output, deepstack mergers, audio projection) damp the code dimensions and write the
       placeholder token's code through their bias, so image/audio tokens route as clearly as text.
    6. Convolution weights (vision patch embeddings, audio convs, Gated DeltaNet's depthwise conv1d) use
       their true fan-in, in_channels / groups * kernel size = prod(shape[1:]); veosnap's rule takes the
       last dimension (the kernel width), which makes a Conv3d patch embedding of 3 x 2 x 16 x 16 inputs
       about 10x too loud.
    """
    notes: list[RuleNote] = []
    params = dict(model.named_parameters())
    moe = find_moe_layers(model)
    num_codes = moe[0].num_experts if moe else 0
    reserved = weights.reserved(moe)  # the code dimensions and the routers' offset dimension
    prefix = lm_prefix(model)
    for name, p in params.items():
        init = hf_init.get(name)
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            a = 0.1 + 0.9 * torch.rand(p.shape, generator=weights.generator(seed, name))
            new = a.log()
            notes.append(RuleNote(name, "A_log = log U(0.1, 1)", _stats(p), _stats(new)))
            p.copy_(new.to(p.dtype))
            continue
        if p.dim() == 1 and init is not None and leaf not in ("sinks", "e_score_correction_bias"):
            c = init.flatten()[0]
            if bool((init == c).all()):
                new = float(c) + 0.1 * weights.draw(seed, name, tuple(p.shape))
                if (new - p.float()).abs().max() > 1e-6:
                    notes.append(RuleNote(name, f"HF constant init {float(c):g} + 0.1 noise", _stats(p), _stats(new)))
                    p.copy_(new.to(p.dtype))
    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            w = module.weight
            fan_in = math.prod(w.shape[1:])
            if fan_in != w.shape[-1]:
                new = weights.draw(seed, f"{name}.weight", tuple(w.shape)) / math.sqrt(fan_in)
                notes.append(RuleNote(f"{name}.weight", f"conv fan-in {fan_in} (not {w.shape[-1]})", _stats(w), _stats(new)))
                w.copy_(new.to(w.dtype))
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            codes = weights.hashed_experts(seed, buf.shape[0], num_codes, buf.shape[1])
            notes.append(RuleNote(name, "token codes", f"{int(buf.unique().numel())} distinct", "codes"))
            buf.copy_(codes.to(buf.dtype))
    if not num_codes:
        return notes
    for name, p in params.items():
        if name.startswith(prefix) and name.endswith(("linear_attn.out_proj.weight", "self_attn.o_b_proj.weight")):
            p[:reserved] *= weights.CODE_NOISE
            notes.append(RuleNote(name, "damp code dims (output projection)", "", ""))
    config = model.config
    tokens = {"visual": getattr(config, "image_token_id", None), "audio": getattr(config, "audio_token_id", None)}
    embed = model.get_input_embeddings().weight
    for path, token in projector_outputs(model, tokens):
        lin = model.get_submodule(path)
        lin.weight[:reserved] *= weights.CODE_NOISE
        if lin.bias is not None and token is not None:
            lin.bias[:reserved] = embed[token, :reserved]
        notes.append(RuleNote(path, "projector writes the placeholder's code", "", f"token {token}"))
    return notes


def projector_outputs(model: nn.Module, tokens: dict[str, int | None]) -> list[tuple[str, int | None]]:
    """The last Linear of each module that writes encoder features into the LM stream."""
    out = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "merger" or (name.rsplit(".", 2)[-2:-1] == ["deepstack_merger_list"]):
            linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
            out.append((f"{name}.{linears[-1]}", tokens["visual"]))
    for name, module in model.named_modules():
        if name.endswith("audio_tower"):
            for leaf in ("proj2", "proj"):
                if isinstance(getattr(module, leaf, None), nn.Linear):
                    out.append((f"{name}.{leaf}", tokens["audio"]))
                    break
    return out


SAVE_WEIGHTS = False
WEIGHTS_FROM: list[Path] = []  # --weights-from: load another run's weights instead of drawing them


def build(name: str, dtype: torch.dtype, rules: str) -> tuple[nn.Module, list[RuleNote]]:
    model = build_empty(name, dtype)
    hf_init = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() == 1}
    weights.initialize(model, SEED)
    notes = proposed_rules(model, SEED, hf_init) if rules == "proposed" else []
    if WEIGHTS_FROM:
        load_renamed(model, WEIGHTS_FROM[0] / f"{name}.weights.safetensors")
    return model, notes


def load_renamed(model: nn.Module, path: Path) -> None:
    """Load a state dict saved by another transformers version, mapping the omni thinkers' renames.

    5.17's thinkers hold `audio_tower`, `visual` and the text `model` side by side; 5.24 nests them as
    `model.audio_tower`, `model.visual`, `model.language_model`.
    """
    saved = load_file(path)
    own = model.state_dict()

    def candidates(name: str):
        yield name
        for old, new in (("model.language_model.", "model."), ("model.visual.", "visual."),
                         ("model.audio_tower.", "audio_tower."), ("model.", "model.language_model."),
                         ("visual.", "model.visual."), ("audio_tower.", "model.audio_tower.")):
            if name.startswith(old):
                yield new + name[len(old):]

    mapped = {}
    for name in saved:
        target = next((c for c in candidates(name) if c in own), None)
        if target is None:
            raise KeyError(f"{path.name}: no parameter for {name}")
        mapped[target] = saved[name].to(own[target].dtype)
    missing = set(own) - set(mapped)
    if any(not k.endswith(("inv_freq", "original_inv_freq")) for k in missing):
        raise KeyError(f"{path.name}: not covered: {sorted(missing)[:3]}")
    model.load_state_dict(mapped, strict=False)


def upcast(model: nn.Module, name: str) -> nn.Module:
    high = build_empty(name, torch.float64)
    state = {k: v.detach().to(torch.float64) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    high.load_state_dict(state, strict=True)
    return high.to(torch.float64)


# --------------------------------------------------------------------------------------------- media


def load_media() -> dict[str, dict]:
    table = pq.read_table(TESTDATA / "multimodal.parquet").to_pylist()
    out = {}
    for row in table:
        dtype = {"uint8": torch.uint8, "int16": torch.int16}[row["dtype"]]
        tensor = torch.frombuffer(bytearray(row["data"]), dtype=dtype).reshape(row["shape"])
        out[row["id"]] = {**row, "tensor": tensor}
    return out


def load_mm_sequences() -> dict[tuple[str, str], dict]:
    rows = pq.read_table(TESTDATA / "multimodal_sequences.parquet").to_pylist()
    return {(r["family"], r["sample"]): r for r in rows}


@dataclass
class Row:
    tokens: list[int]
    images: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    audios: list[str] = field(default_factory=list)


def rows_for(name: str, spec: list, seqs: dict, texts: list[list[int]], all_media: dict) -> list[Row]:
    family = media.MODEL_FAMILY.get(name)
    rows = []
    for item in spec:
        if isinstance(item, tuple):
            rows.append(Row(list(texts[item[1]])))
            continue
        rec = seqs[(family, item)]
        kinds = {m: all_media[m]["kind"] for m in rec["media"]}
        rows.append(Row(list(rec["tokens"]), [m for m in rec["media"] if kinds[m] == "image"],
                        [m for m in rec["media"] if kinds[m] == "video"], [m for m in rec["media"] if kinds[m] == "audio"]))
    return rows


def labels_for(tokens: list[int]) -> list[int]:
    """Next-token labels that never ask to predict a placeholder (its embedding is replaced)."""
    return [IGNORE] + [IGNORE if t in PLACEHOLDERS else t for t in tokens[1:]]


def media_tensors(name: str, rows: list[Row], all_media: dict) -> dict[str, torch.Tensor]:
    family = media.FAMILIES[media.MODEL_FAMILY[name]]
    out: dict[str, torch.Tensor] = {}
    images = [all_media[m]["tensor"] for r in rows for m in r.images]
    videos = [all_media[m] for r in rows for m in r.videos]
    audios = [all_media[m]["tensor"].to(torch.float32) / 32768.0 for r in rows for m in r.audios]
    if images:
        out["pixel_values"], out["image_grid_thw"] = media.image_inputs(images, family.vision)
    if videos:
        out["pixel_values_videos"], out["video_grid_thw"] = media.video_inputs([v["tensor"] for v in videos],
                                                                                family.vision)
        seconds = torch.tensor([family.vision.temporal_patch_size / v["fps"] for v in videos])
        out["second_per_grid"] = seconds
    if audios:
        out["input_features"], out["feature_attention_mask"] = media.audio_inputs(audios)
    return out


def model_media_kwargs(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The golden's media tensors under the argument names each family's forward takes."""
    kwargs = {k: v for k, v in tensors.items() if k != "second_per_grid"}
    if "second_per_grid" in tensors:
        if name == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = tensors["second_per_grid"]
        elif name in ("qwen2_5_omni", "qwen3_omni_moe"):
            kwargs["video_second_per_grid"] = tensors["second_per_grid"]
    return kwargs


def mm_token_type_ids(input_ids: torch.Tensor) -> torch.Tensor:
    return (input_ids == media.IMAGE).long() + 2 * (input_ids == media.VIDEO).long() \
        + 3 * (input_ids == media.AUDIO).long()


def rope_index(model: nn.Module, name: str, input_ids, attention_mask, tensors) -> torch.Tensor:
    """[3, B, L] M-RoPE position ids from the model's own `get_rope_index`."""
    # transformers 5.24 keeps get_rope_index on the inner model; 5.17's omni thinkers keep it on the outer one.
    inner = model.model if hasattr(model.model, "get_rope_index") else model
    grids = {"image_grid_thw": tensors.get("image_grid_thw"), "video_grid_thw": tensors.get("video_grid_thw")}
    if name in ("qwen2_5_omni", "qwen3_omni_moe"):
        mask = tensors.get("feature_attention_mask")
        pos, _ = inner.get_rope_index(input_ids, grids["image_grid_thw"], grids["video_grid_thw"], attention_mask,
                                      False, mask.sum(-1) if mask is not None else None,
                                      tensors.get("second_per_grid"))
        return pos.long()  # 5.17's Qwen3-Omni returns float positions (integral values); a golden keeps int64
    extra = {"second_per_grid_ts": tensors["second_per_grid"]} if name == "qwen2_5_vl" and "second_per_grid" in tensors else {}
    pos, _ = inner.get_rope_index(input_ids, mm_token_type_ids(input_ids), attention_mask=attention_mask,
                                  **grids, **extra)
    return pos


@dataclass
class Batch:
    kwargs: dict[str, torch.Tensor]  # what the forward takes, labels excluded
    labels: torch.Tensor
    mask: torch.Tensor  # [B*L] bool: real tokens


def padded_batch(model: nn.Module, name: str, rows: list[Row], all_media: dict, explicit_positions=True,
                 side: str | None = None) -> Batch:
    """Rows padded to one width: on the left (the zoo's rule) or, for DeepSeek-V4, on the right."""
    side = side or PADDING_SIDE.get(name, "left")
    width = max(len(r.tokens) for r in rows)
    ids, att, pos, lab = [], [], [], []
    for r in rows:
        pad = width - len(r.tokens)
        parts = [([vinputs.PAD_ID] * pad, r.tokens), ([0] * pad, [1] * len(r.tokens)),
                 ([0] * pad, list(range(len(r.tokens)))), ([IGNORE] * pad, labels_for(r.tokens))]
        for store, (padding, real) in zip((ids, att, pos, lab), parts):
            store.append(padding + real if side == "left" else real + padding)
    input_ids, attention_mask = torch.tensor(ids), torch.tensor(att)
    text_pos, labels = torch.tensor(pos), torch.tensor(lab)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if name in TEXT_ONLY:
        kwargs["position_ids"] = text_pos
        return Batch(kwargs, labels, attention_mask.reshape(-1).bool())
    tensors = media_tensors(name, rows, all_media)
    kwargs.update(model_media_kwargs(name, tensors))
    if name not in ("qwen2_5_omni", "qwen3_omni_moe"):
        kwargs["mm_token_type_ids"] = mm_token_type_ids(input_ids)
    if explicit_positions:
        mrope = rope_index(model, name, input_ids, attention_mask, tensors)
        kwargs["position_ids"] = torch.cat([text_pos.unsqueeze(0), mrope], dim=0)  # [4, B, L]: text row first
    return Batch(kwargs, labels, attention_mask.reshape(-1).bool())


def packed_batch(model: nn.Module, name: str, rows: list[Row], all_media: dict) -> Batch:
    """All rows in one, position ids restarting per sequence (M-RoPE ids computed per sequence)."""
    ids = [t for r in rows for t in r.tokens]
    labels = torch.tensor([[t for r in rows for t in labels_for(r.tokens)]])
    text_pos = torch.tensor([[p for r in rows for p in range(len(r.tokens))]])
    input_ids = torch.tensor([ids])
    kwargs: dict[str, torch.Tensor] = {"input_ids": input_ids}
    if name in TEXT_ONLY:
        kwargs["position_ids"] = text_pos
        return Batch(kwargs, labels, torch.ones(len(ids), dtype=torch.bool))
    tensors = media_tensors(name, rows, all_media)
    kwargs.update(model_media_kwargs(name, tensors))
    if name not in ("qwen2_5_omni", "qwen3_omni_moe"):
        kwargs["mm_token_type_ids"] = mm_token_type_ids(input_ids)
    parts = []
    for r in rows:
        one = torch.tensor([r.tokens])
        own = media_tensors(name, [r], all_media)
        parts.append(rope_index(model, name, one, torch.ones_like(one), own))
    kwargs["position_ids"] = torch.cat([text_pos.unsqueeze(0), torch.cat(parts, dim=2)], dim=0)
    return Batch(kwargs, labels, torch.ones(len(ids), dtype=torch.bool))


def text_rows(texts: list[list[int]]) -> list[Row]:
    return [Row(list(t)) for t in texts]


# ------------------------------------------------------------------------------------------- capture


@dataclass
class Hooks:
    """Where a capture hooks in (module paths) and what it finds there."""

    decoder_layers: str
    layer_types: list[str]
    output_embeddings: bool
    vision_blocks: str | None = None
    vision_merger: str | None = None
    deepstack: str | None = None
    audio_layers: str | None = None
    audio_proj: str | None = None
    linear_attention: list[str] = field(default_factory=list)
    routers: list[str] = field(default_factory=list)
    router_kinds: list[str] = field(default_factory=list)
    experts: int = 0
    top_k: int = 0


def find_hooks(model: nn.Module) -> Hooks:
    prefix = lm_prefix(model)
    layers = model.get_submodule(prefix).layers
    types = [getattr(layer, "block_type", None) or getattr(getattr(layer, "self_attn", None), "layer_type", None)
             or "attention" for layer in layers]
    hooks = Hooks(decoder_layers=f"{prefix}.layers", layer_types=types,
                  output_embeddings=model.get_output_embeddings() is not None)
    for name, module in model.named_modules():
        if isinstance(getattr(module, "blocks", None), nn.ModuleList) and hooks.vision_blocks is None:
            hooks.vision_blocks = f"{name}.blocks"
            hooks.vision_merger = f"{name}.merger" if hasattr(module, "merger") else None
            if hasattr(module, "deepstack_merger_list"):
                hooks.deepstack = f"{name}.deepstack_merger_list"
        if name.endswith("audio_tower"):
            hooks.audio_layers = f"{name}.layers"
            hooks.audio_proj = f"{name}.proj2" if hasattr(module, "proj2") else f"{name}.proj"
        if name.endswith("linear_attn"):
            hooks.linear_attention.append(name)
    for moe in find_moe_layers(model):
        hooks.routers.append(moe.router_name)
        hooks.router_kinds.append(type(moe.router).__name__)
        hooks.experts, hooks.top_k = moe.num_experts, moe.top_k
    return hooks


def route_margin(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Per token: lowest chosen score minus best unchosen, in logit units (inf for hash routing)."""
    logits = logits.detach().double().reshape(-1, logits.shape[-1])
    if hasattr(router, "tid2eid"):
        return torch.full((logits.shape[0],), math.inf)
    score_fn = getattr(router, "score_fn", None)
    bias = getattr(router, "e_score_correction_bias", None)
    if score_fn is not None:  # DeepSeek-V4: sqrtsoftplus (or sigmoid / softmax) scores + bias
        with torch.enable_grad():
            x = logits.clone().requires_grad_(True)
            s = score_fn(x)
            slope = torch.autograd.grad(s.sum(), x)[0]
        scores = s.detach() + (bias.double() if bias is not None else 0)
    elif isinstance(bias, torch.Tensor):
        sig = logits.sigmoid()
        scores, slope = sig + bias.double(), sig * (1 - sig)
    else:
        scores, slope = logits, torch.ones_like(logits)
    picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, indices.reshape(scores.shape[0], -1).long(), True)
    low, low_at = scores.masked_fill(~picked, math.inf).min(1)
    high, high_at = scores.masked_fill(picked, -math.inf).max(1)
    mean_slope = (slope.gather(1, low_at[:, None]) + slope.gather(1, high_at[:, None])).squeeze(1) / 2
    return ((low - high) / mean_slope.clamp_min(1e-12)).float()


def indexer_margin(scores: torch.Tensor, k: int, rate: int, position_ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Smallest gap between the k-th and (k+1)-th indexer score among the entries a real query may see.

    A query at position p sees the compressed entries before (p + 1) // rate; with k or fewer of them
    the indexer has no choice to make (inf).
    """
    worst = math.inf
    visible = (position_ids + 1) // rate
    for b in range(scores.shape[0]):
        for t in range(scores.shape[1]):
            n = int(min(visible[b, t], scores.shape[2]))
            if not mask[b, t] or n <= k:
                continue
            top = scores[b, t, :n].double().sort(descending=True).values
            worst = min(worst, float(top[k - 1] - top[k]))
    return worst


@contextmanager
def capture(model: nn.Module, hooks: Hooks):
    """Records LM layer outputs, vision/audio block outputs, merger outputs, logits and router margins."""
    got: dict[str, object] = {"margins": {}, "routes": {}, "layers": {}, "vision": {}, "audio": {}, "indexer": [],
                              "conv_std": {}}
    handles = []

    def keep(store: dict, key):
        def hook(_m, _i, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            t = getattr(t, "pooler_output", t)
            store[key] = t.detach().clone()
        return hook

    for i, layer in enumerate(model.get_submodule(hooks.decoder_layers)):
        handles.append(layer.register_forward_hook(keep(got["layers"], i)))
    if hooks.vision_blocks:
        for i, blk in enumerate(model.get_submodule(hooks.vision_blocks)):
            handles.append(blk.register_forward_hook(keep(got["vision"], f"blocks.{i}")))
        if hooks.vision_merger:
            handles.append(model.get_submodule(hooks.vision_merger).register_forward_hook(keep(got["vision"], "merger")))
    if hooks.audio_layers:
        for i, blk in enumerate(model.get_submodule(hooks.audio_layers)):
            handles.append(blk.register_forward_hook(keep(got["audio"], f"layers.{i}")))
        handles.append(model.get_submodule(hooks.audio_proj).register_forward_hook(keep(got["audio"], "proj")))
    for name, module in model.named_modules():
        if type(module).__name__.endswith("IndexerScorer"):  # DeepSeek-V4's lightning indexer picks top-k entries
            def ihook(module, _i, scores, owner=name.rsplit(".", 1)[0]):
                got["indexer"].append((model.get_submodule(owner), scores.detach().clone()))
            handles.append(module.register_forward_hook(ihook))
    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and "language_model" not in name:
            handles.append(module.register_forward_hook(
                lambda _m, _i, out, name=name: got["conv_std"].__setitem__(name, float(out.detach().float().std()))))
    head = model.get_output_embeddings()
    handles.append(head.register_forward_hook(lambda _m, _i, out: got.__setitem__("logits", out.detach().clone())))
    for moe in find_moe_layers(model):
        def rhook(module, _i, out, layer=moe.layer):
            got["margins"][layer] = route_margin(module, out[0], out[2])
            got["routes"][layer] = out[2].detach().reshape(-1, out[2].shape[-1]).sort(dim=-1).values
            got.setdefault("route_format", f"tuple of {len(out)}: " + ", ".join(
                f"{tuple(o.shape)} {str(o.dtype).removeprefix('torch.')}" for o in out[:3]))
        handles.append(moe.router.register_forward_hook(rhook))
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Causal-LM loss in the logits' own precision (as veosnap's float64 run computes it)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE)


@dataclass
class Step:
    loss: float
    logits: torch.Tensor
    layers: dict
    vision: dict
    audio: dict
    grads: dict[str, torch.Tensor]
    margins: dict[int, torch.Tensor]
    seconds: float
    route_format: str | None = None
    indexer: list = field(default_factory=list)  # (indexer module, scores [B, S, entries])
    routes: dict[int, torch.Tensor] = field(default_factory=dict)  # sorted expert ids [B*L, k]
    conv_std: dict[str, float] = field(default_factory=dict)  # encoder conv output std (activation scale)


def step(model: nn.Module, hooks: Hooks, batch: Batch, backward: bool = True) -> Step:
    model.train()
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with capture(model, hooks) as got, torch.set_grad_enabled(backward):
        out = model(**batch.kwargs, use_cache=False)
        loss = lm_loss(out.logits, batch.labels)
        if backward:
            loss.backward()
    seconds = time.perf_counter() - start
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None} if backward else {}
    return Step(float(loss), got["logits"], got["layers"], got["vision"], got["audio"], grads, got["margins"],
                seconds, got.get("route_format"), got["indexer"], got["routes"], got["conv_std"])


def rel(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Relative L2 distance over the real tokens (rows of the flattened [B*L, ...] view)."""
    a, b = a.detach().double(), b.detach().double()
    if mask is not None:
        a, b = a.reshape(mask.numel(), -1)[mask], b.reshape(mask.numel(), -1)[mask]
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def route_flips(a: Step, b: Step, mask: torch.Tensor, eps: float) -> dict[str, int]:
    """Real tokens whose experts differ between two runs: clear ones (a's margin >= eps) and near-ties."""
    clear = near = 0
    for layer, experts in a.routes.items():
        differs = (experts != b.routes[layer]).any(-1) & mask
        tie = a.margins[layer] < eps
        clear += int((differs & ~tie).sum())
        near += int((differs & tie).sum())
    return {"clear": clear, "near_tie": near}


def first_layer_off(packed: Step, padded: Step, mask: torch.Tensor, limit: float = 1e-5) -> int | None:
    """The first decoder layer whose packed output differs from the padded one over real tokens."""
    for i in sorted(padded.layers):
        flat = padded.layers[i].reshape(-1, *padded.layers[i].shape[2:])[mask]
        if rel(packed.layers[i].reshape(flat.shape), flat) > limit:
            return i
    return None


def grad_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest relative gradient distance; a gradient that is zero in exact arithmetic (a key bias under
    softmax: its stored value is rounding noise of norm ~1e-10) is measured against 1e-6, not its own norm."""
    return max(float((a[n].double() - b[n].double()).norm() / max(float(b[n].double().norm()), 1e-6)) for n in b)


def min_margin(s: Step, mask: torch.Tensor) -> float | None:
    if not s.margins or not bool(mask.any()):
        return None
    return min(float(m[mask].min()) for m in s.margins.values())


class KeepFloat64Ints(KeepFloat64):
    """veosnap's KeepFloat64, and integer tensors cast to float32 become float64 instead.

    transformers 5.17's rotary embeddings compute `inv_freq @ position_ids.float()` (5.24 multiplies
    elementwise, which promotes): under KeepFloat64 the float64 `inv_freq` meets float32 positions and
    the matmul fails ("expected scalar type Double but found Float"), for every model, the text zoo too.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and not first.is_floating_point() and not first.is_complex():
            if func is torch.Tensor.float:
                return first.to(torch.float64)
            if func in (torch.Tensor.to, torch.Tensor.type) and (torch.float32 in args[1:]
                                                                  or (kwargs or {}).get("dtype") is torch.float32):
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
                if (kwargs or {}).get("dtype") is torch.float32:
                    kwargs = {**kwargs, "dtype": torch.float64}
        return super().__torch_function__(func, types, args, kwargs)


KEEP64 = [KeepFloat64]


def run64(high: nn.Module, hooks: Hooks, batch: Batch, res: dict) -> Step:
    """The float64 step under KeepFloat64, falling back to KeepFloat64Ints (and saying so) if it fails."""
    try:
        with KEEP64[0]():
            return step(high, hooks, batch)
    except RuntimeError as exc:
        if KEEP64[0] is KeepFloat64Ints:
            raise
        res["keepfloat64_error"] = str(exc).splitlines()[0]
        KEEP64[0] = KeepFloat64Ints
        with KeepFloat64Ints():
            return step(high, hooks, batch)


# --------------------------------------------------------------------------------------------- check


def check_model(name: str, rules: str, all_media, seqs, texts, out_dir: Path) -> dict:
    res: dict[str, object] = {"model": name}
    model, notes = build(name, torch.float32, rules)
    res["params"] = sum(p.numel() for p in model.parameters())
    res["rules"] = [n.__dict__ for n in notes]
    hooks = find_hooks(model)
    res["hooks"] = hooks.__dict__
    res["ln_vocab"] = math.log(model.get_output_embeddings().weight.shape[0])
    saved: dict[str, torch.Tensor] = {}

    # (a) text-only, left-padded
    text = padded_batch(model, name, text_rows(texts), all_media)
    s_text = step(model, hooks, text)
    res["text"] = {"loss": s_text.loss, "seconds": s_text.seconds, "min_margin": min_margin(s_text, text.mask),
                   "grads": len(s_text.grads), "params_without_grad": sum(1 for n, _ in model.named_parameters()
                                                                           if n not in s_text.grads)}
    res["route_format"] = s_text.route_format
    saved["text.loss"], saved["text.logits"] = torch.tensor(s_text.loss), s_text.logits

    # float64 twin under KeepFloat64
    high = upcast(model, name)
    s64 = run64(high, hooks, text, res)
    res["float64_mode"] = KEEP64[0].__name__
    res["float64"] = {"logits": rel(s_text.logits, s64.logits, text.mask),
                      "layers": max(rel(s_text.layers[i], s64.layers[i], text.mask) for i in s_text.layers),
                      "grads": grad_rel(s_text.grads, s64.grads),
                      "loss": abs(s_text.loss - s64.loss), "route_flips": route_flips(s_text, s64, text.mask, 1e-3)}

    # bfloat16 build of the same weights (veosnap casts the float32 values)
    low, _ = build(name, torch.bfloat16, rules)
    s_bf = step(low, hooks, text)
    res["bfloat16"] = {"loss": s_bf.loss, "logits": rel(s_bf.logits, s64.logits, text.mask),
                       "finite": bool(torch.isfinite(s_bf.logits).all()) and all(bool(torch.isfinite(g).all())
                                                                                 for g in s_bf.grads.values()),
                       "route_flips": route_flips(s_text, s_bf, text.mask, 5e-2) if s_text.routes else None}
    del low

    # each text row alone vs in the padded batch, for both padding sides
    res["row_alone_vs_padded"] = {}
    for side in ("left", "right"):
        batch = padded_batch(model, name, text_rows(texts), all_media, side=side)
        s_batch = step(model, hooks, batch, backward=False)
        worst = 0.0
        for i, r in enumerate(text_rows(texts)):
            s_alone = step(model, hooks, padded_batch(model, name, [r], all_media), backward=False)
            width, n = batch.labels.shape[1], len(r.tokens)
            row = s_batch.logits[i, width - n:] if side == "left" else s_batch.logits[i, :n]
            worst = max(worst, rel(row, s_alone.logits[0]))
        res["row_alone_vs_padded"][side] = worst
    if s_text.indexer:
        pos, att = text.kwargs["position_ids"], text.kwargs["attention_mask"]
        res["indexer_min_margin"] = min(indexer_margin(sc, ix.index_topk, ix.compress_rate, pos, att)
                                        for ix, sc in s_text.indexer)
        res["indexer_score_median"] = float(torch.cat([sc[sc.isfinite()].abs() for _, sc in s_text.indexer]).median())

    # the same weights as the text-only CausalLM class (VLMs whose config AutoModelForCausalLM also builds)
    if name in CAUSAL_TWIN:
        res["causal_lm_twin"] = causal_twin(model, name, hooks, text, s_text)

    # packed vs padded (text)
    packed = packed_batch(model, name, text_rows(texts), all_media)
    s_packed = step(model, hooks, packed)
    res["packed_text"] = {"logits": rel(s_packed.logits.reshape(-1, s_packed.logits.shape[-1]),
                                        s_text.logits.reshape(-1, s_text.logits.shape[-1])[text.mask]),
                          "grads": grad_rel(s_packed.grads, s_text.grads),
                          "loss": abs(s_packed.loss - s_text.loss),
                          "first_layer_off": first_layer_off(s_packed, s_text, text.mask)}

    if name not in TEXT_ONLY:
        mm_checks(model, name, hooks, all_media, seqs, texts, res, saved)
        del high
        high = upcast(model, name)
        image = padded_batch(model, name, rows_for(name, IMAGE_ROWS, seqs, texts, all_media), all_media)
        s_img = step(model, hooks, image)
        s_img64 = run64(high, hooks, image, res)
        res["float64_image"] = {
            "logits": rel(s_img.logits, s_img64.logits, image.mask),
            "vision": max(rel(s_img.vision[k], s_img64.vision[k]) for k in s_img.vision),
            "grads": grad_rel(s_img.grads, s_img64.grads)}

    if rules == "proposed" and find_moe_layers(model):
        bare = build_empty(name, torch.float32)
        weights.initialize(bare, SEED)
        spec = AUDIO_ROWS if "audio" in res else IMAGE_ROWS if name not in TEXT_ONLY else None
        batch = padded_batch(bare, name, rows_for(name, spec, seqs, texts, all_media), all_media) if spec else text
        s_bare = step(bare, hooks, batch, backward=False)
        placeholder = torch.isin(batch.kwargs["input_ids"].reshape(-1), torch.tensor(PLACEHOLDERS))
        res["bare_rule_min_margin"] = min_margin(s_bare, batch.mask)
        res["bare_rule_margin_split"] = {"text tokens": min_margin(s_bare, batch.mask & ~placeholder),
                                         "placeholder tokens": min_margin(s_bare, batch.mask & placeholder)}
    save_file({k: v.contiguous() for k, v in saved.items()}, out_dir / f"{name}.safetensors")
    if SAVE_WEIGHTS:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
        save_file(state, out_dir / f"{name}.weights.safetensors")
    return res


def is_vision(name: str) -> bool:
    """A vision-tower parameter (`model.visual.*` in transformers 5.24, `visual.*` in 5.17's omni thinkers)."""
    return name.startswith("visual.") or ".visual." in name


def mm_checks(model, name, hooks, all_media, seqs, texts, res, saved) -> None:
    family = media.FAMILIES[media.MODEL_FAMILY[name]]
    image_rows = rows_for(name, IMAGE_ROWS, seqs, texts, all_media)
    image = padded_batch(model, name, image_rows, all_media)
    s = step(model, hooks, image)
    vision_params = [n for n in s.grads if is_vision(n)]
    res["image"] = {"loss": s.loss, "seconds": s.seconds, "min_margin": min_margin(s, image.mask),
                    "vision_grads": len(vision_params), "tokens": int(image.mask.sum()),
                    "image_tokens": int((image.kwargs["input_ids"] == media.IMAGE).sum()),
                    "pixel_values": list(image.kwargs["pixel_values"].shape),
                    "vision_outputs": {k: list(v.shape) for k, v in s.vision.items()},
                    "conv_std": s.conv_std, "vision_std": {k: float(v.float().std()) for k, v in s.vision.items()}}
    saved["image.loss"], saved["image.logits"] = torch.tensor(s.loss), s.logits

    # explicit [4, B, L] position ids == the model's own get_rope_index
    implicit = padded_batch(model, name, image_rows, all_media, explicit_positions=False)
    s_imp = step(model, hooks, implicit, backward=False)
    res["explicit_vs_model_positions"] = rel(s.logits, s_imp.logits, image.mask)

    # packed multimodal vs padded
    packed = packed_batch(model, name, image_rows, all_media)
    s_p = step(model, hooks, packed)
    res["packed_image"] = {"logits": rel(s_p.logits.reshape(-1, s_p.logits.shape[-1]),
                                         s.logits.reshape(-1, s.logits.shape[-1])[image.mask]),
                           "grads": grad_rel(s_p.grads, s.grads),
                           "loss": abs(s_p.loss - s.loss)}

    video = padded_batch(model, name, rows_for(name, VIDEO_ROWS, seqs, texts, all_media), all_media)
    s_v = step(model, hooks, video)
    saved["video.loss"], saved["video.logits"] = torch.tensor(s_v.loss), s_v.logits
    res["video"] = {"loss": s_v.loss, "seconds": s_v.seconds, "min_margin": min_margin(s_v, video.mask),
                    "video_tokens": int((video.kwargs["input_ids"] == media.VIDEO).sum()),
                    "grid": video.kwargs["video_grid_thw"].tolist()}
    if family.audio_rule:
        audio = padded_batch(model, name, rows_for(name, AUDIO_ROWS, seqs, texts, all_media), all_media)
        s_a = step(model, hooks, audio)
        saved["audio.loss"], saved["audio.logits"] = torch.tensor(s_a.loss), s_a.logits
        res["audio"] = {"loss": s_a.loss, "seconds": s_a.seconds, "min_margin": min_margin(s_a, audio.mask),
                        "audio_tokens": int((audio.kwargs["input_ids"] == media.AUDIO).sum()),
                        "input_features": list(audio.kwargs["input_features"].shape),
                        "audio_outputs": {k: list(v.shape) for k, v in s_a.audio.items()},
                        "conv_std": s_a.conv_std, "audio_std": {k: float(v.float().std()) for k, v in s_a.audio.items()},
                        "audio_grads": len([n for n in s_a.grads if "audio_tower" in n])}
        audio_rows = rows_for(name, AUDIO_ROWS, seqs, texts, all_media)
        s_ap = step(model, hooks, packed_batch(model, name, audio_rows, all_media))
        res["packed_audio"] = {"logits": rel(s_ap.logits.reshape(-1, s_ap.logits.shape[-1]),
                                             s_a.logits.reshape(-1, s_a.logits.shape[-1])[audio.mask]),
                               "grads": grad_rel(s_ap.grads, s_a.grads)}

    # mixed batch: two rows without an image; then the same with the vision tower frozen
    mixed = padded_batch(model, name, rows_for(name, MIXED_ROWS, seqs, texts, all_media), all_media)
    s_m = step(model, hooks, mixed)
    visual = [p for n, p in model.named_parameters() if is_vision(n)]
    for p in visual:
        p.requires_grad_(False)
    try:
        s_f = step(model, hooks, mixed)
    finally:
        for p in visual:
            p.requires_grad_(True)
    lm_names = [n for n in s_m.grads if not is_vision(n)]
    res["mixed"] = {"loss": s_m.loss, "min_margin": min_margin(s_m, mixed.mask),
                    "vision_grads": len([n for n in s_m.grads if is_vision(n)]),
                    "frozen_vision_grads": len([n for n in s_f.grads if is_vision(n)]),
                    "frozen_loss_diff": abs(s_f.loss - s_m.loss),
                    "frozen_lm_grads_rel": grad_rel(s_f.grads, {n: s_m.grads[n] for n in lm_names})}


CAUSAL_TWIN = {"qwen3_5", "qwen3_5_moe"}


def causal_twin(model: nn.Module, name: str, hooks: Hooks, text: Batch, s_text: Step) -> dict:
    """Build the same config with AutoModelForCausalLM (text-only class), copy the LM weights, compare."""
    config = hf_config(load_config(CONFIGS, name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                             experts_implementation="eager", dtype=torch.float32)
    state = {k.replace("model.language_model.", "model."): v for k, v in model.state_dict().items()
             if not is_vision(k)}
    missing, unexpected = twin.load_state_dict(state, strict=False)
    s = step(twin, find_hooks(twin), Batch({k: v for k, v in text.kwargs.items()}, text.labels, text.mask))
    return {"class": type(twin).__name__, "params": sum(p.numel() for p in twin.parameters()),
            "missing": list(missing), "unexpected": list(unexpected), "logits": rel(s.logits, s_text.logits, text.mask),
            "loss_diff": abs(s.loss - s_text.loss)}


# -------------------------------------------------------------------------------- processor oracles


def processor_oracles(all_media: dict) -> dict:
    """Our preprocessing against the HF processor classes constructed locally (no download)."""
    out: dict[str, object] = {}
    spec = media.FAMILIES["qwen2_vl"].vision
    for cls_name in ("Qwen2VLImageProcessorPil", "Qwen2VLImageProcessor"):  # PIL backend first (no torchvision)
        try:
            import numpy as np

            cls = getattr(transformers, cls_name)
            proc = cls(min_pixels=spec.factor ** 2, max_pixels=spec.max_pixels, patch_size=14, merge_size=2,
                       temporal_patch_size=2)
            for mid in ("img_wide", "img_odd"):
                img = all_media[mid]["tensor"]
                ours, grid = media.image_inputs([img], spec)
                theirs = proc(images=[np.ascontiguousarray(img.numpy())], return_tensors="pt")
                same_grid = theirs["image_grid_thw"].tolist() == grid.tolist()
                diff = float((theirs["pixel_values"] - ours).abs().max()) if same_grid else float("nan")
                out[f"{cls_name}.{mid}"] = {"same_grid": same_grid, "max_abs_diff": diff}
            break
        except Exception as exc:  # noqa: BLE001 - an oracle that cannot run is reported, not fatal
            out[cls_name] = f"unavailable: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    try:
        from transformers import WhisperFeatureExtractor
        from transformers.audio_utils import mel_filter_bank

        hf_filters = torch.from_numpy(mel_filter_bank(num_frequency_bins=201, num_mel_filters=128, min_frequency=0.0,
                                                      max_frequency=8000.0, sampling_rate=16000, norm="slaney",
                                                      mel_scale="slaney"))
        out["mel_filters_max_abs_diff"] = float((hf_filters - media.mel_filters()).abs().max())
        fe = WhisperFeatureExtractor(feature_size=128)
        wave = all_media["aud_chirp"]["tensor"].to(torch.float32) / 32768.0
        theirs = fe._torch_extract_fbank_features(wave.numpy(), "cpu")
        ours = media.log_mel(wave)
        out["whisper_log_mel_max_abs_diff"] = float((torch.from_numpy(theirs) - ours).abs().max())
    except Exception as exc:  # noqa: BLE001
        out["whisper"] = f"unavailable: {type(exc).__name__}: {exc}"
    return out


# ------------------------------------------------------------------------------------------- report


def fmt(x, spec=".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


def print_report(results: list[dict]) -> None:
    print()
    head = (f"{'model':<15} {'ok':<4} {'params':>7} {'loss txt':>8} {'loss img':>8} {'loss vid':>8} {'loss aud':>8} "
            f"{'ln V':>5} {'sec':>5} {'f64 lgt':>8} {'pack txt':>8} {'pack img':>8} {'alone':>8} {'margin':>7} {'bare':>7}")
    print(head)
    print("-" * len(head))
    for r in results:
        if "error" in r:
            print(f"{r['model']:<15} FAIL {r['error'][:100]}")
            continue
        secs = sum(r.get(k, {}).get("seconds", 0) for k in ("text", "image", "video", "audio"))
        margins = [r.get(k, {}).get("min_margin") for k in ("text", "image", "video", "audio", "mixed")]
        margins = [m for m in margins if m is not None]
        print(f"{r['model']:<15} {'yes':<4} {r['params']:>7} {fmt(r['text']['loss'], '.3f'):>8} "
              f"{fmt(r.get('image', {}).get('loss'), '.3f'):>8} {fmt(r.get('video', {}).get('loss'), '.3f'):>8} "
              f"{fmt(r.get('audio', {}).get('loss'), '.3f'):>8} {r['ln_vocab']:>5.2f} {secs:>5.2f} "
              f"{fmt(r['float64']['logits']):>8} {fmt(r['packed_text']['logits']):>8} "
              f"{fmt(r.get('packed_image', {}).get('logits')):>8} {fmt(r['row_alone_vs_padded'][PADDING_SIDE.get(r['model'], 'left')]):>8} "
              f"{fmt(min(margins) if margins else None):>7} {fmt(r.get('bare_rule_min_margin')):>7}")
    print("\ncolumns: losses of the text / image / video / audio batches (ln V = a uniform guess); sec = the four"
          " steps; f64 lgt = float32 vs float64 logits (rel L2); pack = packed vs padded logits; alone = each text"
          " row alone vs in the padded batch; margin = smallest MoE router margin over real tokens (proposed"
          " rules); bare = the same under veosnap's rule alone (image batch)")
    for r in results:
        if "error" in r:
            continue
        h = r["hooks"]
        print(f"\n== {r['model']}  ({r['auto_class']}, {r['class']})")
        print(f"   decoder layers: {h['decoder_layers']} {h['layer_types']}; output embeddings: {h['output_embeddings']}")
        if h["vision_blocks"]:
            print(f"   vision: {h['vision_blocks']} -> {h['vision_merger']}" + (f"; deepstack {h['deepstack']}" if h["deepstack"] else ""))
        if h["audio_layers"]:
            print(f"   audio: {h['audio_layers']} -> {h['audio_proj']}")
        if h["linear_attention"]:
            print(f"   linear attention: {h['linear_attention']}")
        if h["routers"]:
            print(f"   routers ({h['experts']} experts, top {h['top_k']}): {list(zip(h['routers'], h['router_kinds']))};"
                  f" returns {r.get('route_format')}")
        per_batch = {k: fmt(r[k]["min_margin"]) for k in ("text", "image", "video", "audio", "mixed")
                     if k in r and r[k].get("min_margin") is not None}
        if per_batch:
            print(f"   router margins per batch: {per_batch}; veosnap's rule alone: {r.get('bare_rule_margin_split')}")
        if "indexer_min_margin" in r:
            print(f"   lightning indexer: smallest k-th vs (k+1)-th score gap over real queries "
                  f"{fmt(r['indexer_min_margin'])} (median |score| {fmt(r['indexer_score_median'])})")
        side = r["row_alone_vs_padded"]
        print(f"   each text row alone vs in the padded batch: left padding {fmt(side['left'])}, right {fmt(side['right'])}"
              f" (golden batch: {PADDING_SIDE.get(r['model'], 'left')})")
        if "causal_lm_twin" in r:
            t = r["causal_lm_twin"]
            print(f"   AutoModelForCausalLM on the same config: {t['class']} ({t['params']} params), text logits vs the"
                  f" VLM's {fmt(t['logits'])}, missing {t['missing']}, unexpected {t['unexpected']}")
        f64 = r["float64"]
        print(f"   float64 (KeepFloat64) vs float32, text: logits {fmt(f64['logits'])} layers {fmt(f64['layers'])} "
              f"grads {fmt(f64['grads'])}" + (f"; image: logits {fmt(r['float64_image']['logits'])} vision "
                                              f"{fmt(r['float64_image']['vision'])} grads {fmt(r['float64_image']['grads'])}"
                                              if "float64_image" in r else ""))
        bf = r["bfloat16"]
        print(f"   bfloat16 build: loss {bf['loss']:.4f}, logits vs float64 {fmt(bf['logits'])}, finite {bf['finite']}"
              + (f", routes vs float32 {bf['route_flips']}; float64 vs float32 routes {f64['route_flips']}"
                 if bf["route_flips"] is not None else ""))
        print(f"   packed vs padded, text: logits {fmt(r['packed_text']['logits'])} grads {fmt(r['packed_text']['grads'])}"
              + (f" (first layer off: {r['packed_text']['first_layer_off']})"
                 if r['packed_text']['first_layer_off'] is not None else "")
              + (f"; image: logits {fmt(r['packed_image']['logits'])} grads {fmt(r['packed_image']['grads'])}"
                 if "packed_image" in r else ""))
        if "image" in r:
            i = r["image"]
            print(f"   image batch: {i['image_tokens']} image tokens, pixel_values {i['pixel_values']}, vision outputs "
                  f"{i['vision_outputs']}; explicit vs model positions {fmt(r['explicit_vs_model_positions'])}")
            print(f"   activation std: convs {({k.rsplit('.', 2)[-2] + '.' + k.rsplit('.', 1)[-1]: round(v, 2) for k, v in i['conv_std'].items()})}, "
                  f"vision {({k: round(v, 2) for k, v in i['vision_std'].items()})}"
                  + (f", audio {({k: round(v, 2) for k, v in r['audio']['audio_std'].items()})}" if "audio" in r else ""))
            print(f"   text-only batch: {r['text']['params_without_grad']} parameters get no gradient (the towers do not run)")
            print(f"   video batch: {r['video']['video_tokens']} video tokens, grids {r['video']['grid']}")
            if "audio" in r:
                a = r["audio"]
                print(f"   audio batch: {a['audio_tokens']} audio tokens, input_features {a['input_features']}, "
                      f"outputs {a['audio_outputs']}, {a['audio_grads']} audio-tower grads; packed vs padded logits "
                      f"{fmt(r['packed_audio']['logits'])} grads {fmt(r['packed_audio']['grads'])}")
            m = r["mixed"]
            print(f"   mixed batch: loss {m['loss']:.4f}, vision grads {m['vision_grads']}; frozen tower: vision grads "
                  f"{m['frozen_vision_grads']}, loss diff {fmt(m['frozen_loss_diff'])}, LM grads rel {fmt(m['frozen_lm_grads_rel'])}")
        for note in r["rules"]:
            print(f"   rule: {note['name']}: {note['rule']}" + (f" ({note['before']} -> {note['after']})" if note["before"] else ""))


def compare(a: Path, b: Path) -> int:
    """Tensor-by-tensor distance between two output folders (e.g. two transformers versions)."""
    ra, rb = json.loads((a / "results.json").read_text()), json.loads((b / "results.json").read_text())
    print(f"A: {a} (transformers {ra['transformers']})   B: {b} (transformers {rb['transformers']})")
    for f in sorted(p for p in a.glob("*.safetensors") if not p.name.endswith(".weights.safetensors")):
        if not (b / f.name).is_file():
            print(f"{f.stem:<15} missing in B")
            continue
        ta, tb = load_file(f), load_file(b / f.name)
        parts = []
        for k in sorted(ta):
            if k not in tb or ta[k].shape != tb[k].shape:
                parts.append(f"{k}: differs in shape")
                continue
            parts.append(f"{k}: {'identical' if torch.equal(ta[k], tb[k]) else fmt(rel(ta[k], tb[k]))}")
        print(f"{f.stem:<15} " + "; ".join(parts))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--rules", choices=("proposed", "veosnap"), default="proposed")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "try_new_models_out")))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    parser.add_argument("--save-weights", action="store_true", help="also write <model>.weights.safetensors")
    parser.add_argument("--weights-from", type=Path, help="use the weights another run saved (renames mapped)")
    args = parser.parse_args()
    global SAVE_WEIGHTS
    SAVE_WEIGHTS = args.save_weights
    if args.weights_from:
        WEIGHTS_FROM.append(args.weights_from)
    if args.compare:
        return compare(*args.compare)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    all_media, seqs = load_media(), load_mm_sequences()
    texts = vinputs.load_sequences(TESTDATA, vinputs.DEFAULT_SEQUENCES)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, rules: {args.rules}")
    oracles = processor_oracles(all_media)
    print("preprocessing vs HF processors:", json.dumps(oracles))
    results = []
    for name in args.models:
        start = time.perf_counter()
        try:
            res = check_model(name, args.rules, all_media, seqs, texts, args.out)
            res["auto_class"] = auto_class(name).__name__
            res["class"] = json.loads((CONFIGS / name / "config.json").read_text())["architectures"][0]
        except Exception as exc:  # noqa: BLE001 - one model's failure is a finding; the others still run
            res = {"model": name, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(res["traceback"], file=sys.stderr)
        res["wall_seconds"] = time.perf_counter() - start
        print(f"{name}: done in {res['wall_seconds']:.1f}s" + (f" ERROR {res['error']}" if "error" in res else ""))
        results.append(res)
    summary = {"transformers": transformers.__version__, "torch": torch.__version__, "rules": args.rules,
               "oracles": oracles, "results": results}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    print_report(results)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

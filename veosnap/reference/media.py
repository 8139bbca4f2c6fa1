"""Deterministic, network-free preprocessing of images, videos and audio into Qwen-family model inputs.

The multimodal toy models take their media through their own tensor inputs (`pixel_values` with
`image_grid_thw`, `pixel_values_videos` with `video_grid_thw`, `input_features` with
`feature_attention_mask`), so no hub processor is needed. This module computes those tensors from the
raw media in `testdata/multimodal.parquet` with a fixed rule of its own, in plain torch:

- images and video frames: resized (only where a side is not a multiple of `patch * merge`) to the size
  Qwen's `smart_resize` picks (each side rounded to the nearest multiple, Python's round half to even,
  then clamped to the pixel budget), bicubic with antialias in float32, rescaled by 1/255, normalized by
  the family's mean and std, and cut into patches in exactly the order HF's Qwen2-VL processors use
  (merge windows together; each patch row is [channel, time, row, column]); a still image fills both
  frames of a temporal patch, and a video with an odd frame count repeats its last frame;
- audio: Whisper's log-mel (hann window 400, hop 160, 128 slaney mel bins up to 8 kHz, log10, floor at
  max - 8, then (x + 4) / 4, last STFT frame dropped), computed per clip on the clip's own frames, then
  right-padded to the longest clip of the batch with `feature_attention_mask` marking real frames.

Why our own and not the HF processor classes: the processors differ between transformers releases (PIL
versus torchvision backends, fast versus slow), their resize is not bit-stable across those backends,
and Whisper's extractor pads every clip to 30 s. A golden stores the tensors this module makes, so the
rule only has to be deterministic; issue 15's trial script compared it with the HF processors constructed
locally (identical patch order; values equal where no resize happens; docs/models.md).

`reference.inputs` builds a golden's multimodal batch with it; `tools/data/make_multimodal_testdata.py` writes
the test data's token sequences with its placeholder counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
N_MELS = 128

# Placeholder and special token ids of the multimodal toy configs: the text table uses ids 3..255, so
# these sit just above it, inside each toy's vocabulary of 264.
VISION_START = 256
VISION_END = 257
IMAGE = 258
VIDEO = 259
AUDIO_START = 260
AUDIO_END = 261
AUDIO = 262
USER = 263
VOCAB = 264


@dataclass(frozen=True)
class VisionSpec:
    """How one model family turns pixels into patches."""

    patch_size: int
    merge_size: int = 2
    temporal_patch_size: int = 2
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD
    min_pixels: int | None = None  # None: one merged token (factor * factor)
    max_pixels: int = 128 * 128

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class Family:
    """A model family's input rules: its vision spec, how videos are laid out, how audio is counted.

    `video_layout`: "block" puts a video's tokens in one vision_start..vision_end block (Qwen2-VL,
    Qwen2.5-VL, the omni thinkers); "timestamps" splits them per temporal patch, each group preceded by
    a timestamp text token (Qwen3-VL, Qwen3.5). `audio_rule`: None (no audio tower), "qwen2_5_omni" or
    "qwen3_omni" (see `audio_tokens`).
    """

    name: str
    vision: VisionSpec
    video_layout: str = "block"
    audio_rule: str | None = None
    audio_n_window: int = 50


FAMILIES = {
    "qwen2_vl": Family("qwen2_vl", VisionSpec(patch_size=14)),
    "qwen3_vl": Family("qwen3_vl", VisionSpec(patch_size=16, mean=HALF, std=HALF), video_layout="timestamps"),
    "qwen2_5_omni": Family("qwen2_5_omni", VisionSpec(patch_size=14), audio_rule="qwen2_5_omni"),
    "qwen3_omni": Family("qwen3_omni", VisionSpec(patch_size=16, mean=HALF, std=HALF), audio_rule="qwen3_omni",
                         audio_n_window=50),
}

# Which family each multimodal toy config belongs to.
MODEL_FAMILY = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "qwen3_5": "qwen3_vl",
    "qwen3_5_moe": "qwen3_vl",
    "qwen2_5_omni": "qwen2_5_omni",
    "qwen3_omni_moe": "qwen3_omni",
}


def smart_resize(height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    """Qwen's target size: sides rounded to multiples of patch * merge, then fitted to the pixel budget."""
    factor = spec.factor
    min_pixels = spec.min_pixels if spec.min_pixels is not None else factor * factor
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > spec.max_pixels:
        beta = math.sqrt((height * width) / spec.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _frames_to_float(frames: torch.Tensor, spec: VisionSpec) -> torch.Tensor:
    """[F, H, W, 3] uint8 -> [F, 3, h, w] float32, resized and normalized."""
    x = frames.permute(0, 3, 1, 2).to(torch.float32)
    height, width = x.shape[-2:]
    target = smart_resize(height, width, spec)
    if target != (height, width):
        x = F.interpolate(x, size=target, mode="bicubic", align_corners=False, antialias=True).clamp(0.0, 255.0)
    x = x / 255.0
    mean = torch.tensor(spec.mean, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(spec.std, dtype=torch.float32).view(1, 3, 1, 1)
    return (x - mean) / std


def patchify(frames: torch.Tensor, spec: VisionSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[F, 3, h, w] float -> ([grid_t * grid_h * grid_w, 3 * tps * p * p], (grid_t, grid_h, grid_w)).

    The patch order is HF's: temporal groups, then merge windows row by row, then the patches inside a
    window; each row is [channel, time, pixel row, pixel column].
    """
    tps, p, m = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    if pad := -frames.shape[0] % tps:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)], dim=0)
    num_frames, channels, height, width = frames.shape
    grid_t, grid_h, grid_w = num_frames // tps, height // p, width // p
    x = frames.reshape(grid_t, tps, channels, grid_h // m, m, p, grid_w // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(grid_t * grid_h * grid_w, channels * tps * p * p).contiguous(), (grid_t, grid_h, grid_w)


def image_inputs(images: list[torch.Tensor], spec: VisionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """`pixel_values` [patches, 3*tps*p*p] and `image_grid_thw` [images, 3] for uint8 [H, W, 3] images."""
    rows, grids = [], []
    for image in images:
        frames = _frames_to_float(image.unsqueeze(0), spec)
        frames = frames.expand(spec.temporal_patch_size, -1, -1, -1)  # a still image fills the temporal patch
        patches, grid = patchify(frames, spec)
        rows.append(patches)
        grids.append(grid)
    return torch.cat(rows), torch.tensor(grids, dtype=torch.long)


def video_inputs(videos: list[torch.Tensor], spec: VisionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """`pixel_values_videos` and `video_grid_thw` for uint8 [F, H, W, 3] videos."""
    rows, grids = [], []
    for video in videos:
        patches, grid = patchify(_frames_to_float(video, spec), spec)
        rows.append(patches)
        grids.append(grid)
    return torch.cat(rows), torch.tensor(grids, dtype=torch.long)


def vision_tokens(grid: tuple[int, int, int], spec: VisionSpec) -> int:
    """How many placeholder tokens one image or video takes in the text: t * h * w / merge^2."""
    t, h, w = grid
    return t * h * w // (spec.merge_size**2)


def image_grid(height: int, width: int, spec: VisionSpec) -> tuple[int, int, int]:
    h, w = smart_resize(height, width, spec)
    return (1, h // spec.patch_size, w // spec.patch_size)


def video_grid(frames: int, height: int, width: int, spec: VisionSpec) -> tuple[int, int, int]:
    h, w = smart_resize(height, width, spec)
    return (-(-frames // spec.temporal_patch_size), h // spec.patch_size, w // spec.patch_size)


# ---------------------------------------------------------------------------------------------- audio


def _hz_to_mel(freq: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return torch.where(freq >= min_log_hz, min_log_mel + torch.log(freq.clamp_min(1e-10) / min_log_hz) / logstep,
                       freq / f_sp)


def _mel_to_hz(mels: torch.Tensor) -> torch.Tensor:
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return torch.where(mels >= min_log_mel, min_log_hz * torch.exp(logstep * (mels - min_log_mel)), f_sp * mels)


def mel_filters(n_mels: int = N_MELS, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE,
                f_max: float = 8000.0) -> torch.Tensor:
    """[n_fft // 2 + 1, n_mels] triangular slaney-normalized filters (float64), as Whisper uses."""
    fft_freqs = torch.linspace(0, sample_rate // 2, n_fft // 2 + 1, dtype=torch.float64)
    mel_points = torch.linspace(float(_hz_to_mel(torch.tensor(0.0, dtype=torch.float64))),
                                float(_hz_to_mel(torch.tensor(f_max, dtype=torch.float64))), n_mels + 2,
                                dtype=torch.float64)
    hz_points = _mel_to_hz(mel_points)
    diff = hz_points[1:] - hz_points[:-1]
    slopes = hz_points.unsqueeze(0) - fft_freqs.unsqueeze(1)  # [freqs, n_mels + 2]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = torch.clamp(torch.minimum(down, up), min=0.0)
    enorm = 2.0 / (hz_points[2:] - hz_points[:-2])
    return filters * enorm.unsqueeze(0)


def log_mel(waveform: torch.Tensor) -> torch.Tensor:
    """[N_MELS, samples // HOP] Whisper log-mel features of one float waveform in [-1, 1]."""
    window = torch.hann_window(N_FFT, dtype=torch.float32)
    stft = torch.stft(waveform.to(torch.float32), N_FFT, HOP, window=window, return_complex=True)
    power = (stft[..., :-1].abs() ** 2).contiguous()
    mel = mel_filters().to(torch.float32).T @ power
    spec = torch.clamp(mel, min=1e-10).log10()
    spec = torch.maximum(spec, spec.max() - 8.0)
    return (spec + 4.0) / 4.0


def audio_inputs(waveforms: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_features` [clips, N_MELS, frames] (right-padded with 0) and `feature_attention_mask`."""
    feats = [log_mel(w) for w in waveforms]
    width = max(f.shape[1] for f in feats)
    out = torch.zeros(len(feats), N_MELS, width)
    mask = torch.zeros(len(feats), width, dtype=torch.long)
    for i, f in enumerate(feats):
        out[i, :, : f.shape[1]] = f
        mask[i, : f.shape[1]] = 1
    return out, mask


def audio_frames(samples: int) -> int:
    return samples // HOP


def audio_tokens(frames: int, family: Family) -> int:
    """How many audio placeholder tokens a clip of `frames` mel frames takes.

    qwen2_5_omni: a stride-2 conv, then a stride-2 average pool. qwen3_omni: per chunk of
    2 * n_window frames three stride-2 convs; a full 100-frame chunk gives 13 (HF's formula hard-codes
    13, so it holds for n_window 50 only).
    """
    if family.audio_rule == "qwen2_5_omni":
        after_conv = (frames - 1) // 2 + 1
        return (after_conv - 2) // 2 + 1
    if family.audio_rule == "qwen3_omni":
        chunk = family.audio_n_window * 2
        leave = frames % chunk
        tail = (leave - 1) // 2 + 1
        return ((tail - 1) // 2 + 1 - 1) // 2 + 1 + (frames // chunk) * 13
    raise ValueError(f"family {family.name} has no audio tower")


def expand(layout: list[tuple[str, object]], family: Family, media: dict[str, dict]) -> list[int]:
    """A token sequence from a layout of ("text", [ids]) / ("image"|"video"|"audio", media_id) parts."""
    spec = family.vision
    tokens: list[int] = []
    for kind, value in layout:
        if kind == "text":
            tokens += list(value)
        elif kind == "image":
            m = media[value]
            n = vision_tokens(image_grid(m["height"], m["width"], spec), spec)
            tokens += [VISION_START] + [IMAGE] * n + [VISION_END]
        elif kind == "video":
            m = media[value]
            grid = video_grid(m["frames"], m["height"], m["width"], spec)
            per_group = grid[1] * grid[2] // (spec.merge_size**2)
            if family.video_layout == "timestamps":
                for t in range(grid[0]):
                    # HF writes "<t.t seconds>" as text before each temporal group; one text id stands for it.
                    tokens += [3 + t, VISION_START] + [VIDEO] * per_group + [VISION_END]
            else:
                tokens += [VISION_START] + [VIDEO] * (per_group * grid[0]) + [VISION_END]
        elif kind == "audio":
            m = media[value]
            n = audio_tokens(audio_frames(m["samples"]), family)
            tokens += [AUDIO_START] + [AUDIO] * n + [AUDIO_END]
        else:
            raise ValueError(f"unknown layout part {kind!r}")
    return tokens

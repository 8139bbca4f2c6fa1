"""Write testdata/multimodal.parquet and testdata/multimodal_sequences.parquet for the multimodal toys.

Deterministic: running it again writes the same bytes. Nothing is downloaded.

`multimodal.parquet`, one row per medium (raw, before any preprocessing):
  id, kind (image | video | audio), height, width, frames, fps, samples, sample_rate, dtype, shape,
  data (raw bytes: uint8 [H, W, 3] images, uint8 [F, H, W, 3] videos, int16 PCM audio), note.

`multimodal_sequences.parquet`, one row per (family, sample): the token sequence with as many
placeholder tokens as that family's processor rules give each medium (`veosnap/reference/media.py`), and the media
it holds in order. Families: qwen2_vl (Qwen2-VL, Qwen2.5-VL), qwen3_vl (Qwen3-VL, Qwen3-VL-MoE,
Qwen3.5, Qwen3.5-MoE), qwen2_5_omni, qwen3_omni. Text-only rows are not repeated here: they are the
rows of `sequences.parquet`.

    python tools/data/make_multimodal_testdata.py [--out testdata]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from veosnap.reference import media  # noqa: E402

SEED = 20261201
FIRST_TOKEN, LAST_TOKEN = 3, 256  # text ids, as in sequences.parquet

# (id, height, width, note): each family gets sizes that fit its patch * merge grid and sizes it must
# resize; 42x70 rounds half to even on the 28 grid (1.5 -> 2, 2.5 -> 2: 56x56).
IMAGES = [
    ("img_tiny", 28, 28, "one merged token on the 28 grid; 32x32 (one token) on the 32 grid"),
    ("img_wide", 56, 84, "exact on the 28 grid (2x3 merged); resized to 64x96 on the 32 grid"),
    ("img_odd", 42, 70, "resized on both grids: 56x56 (28, round half to even), 32x64 (32)"),
    ("img_big", 64, 96, "exact on the 32 grid (2x3 merged); resized to 56x84 on the 28 grid"),
]
# (id, frames, height, width, fps, note)
VIDEOS = [
    ("vid_square", 4, 56, 56, 2.0, "4 frames: two temporal patches; a square moving right"),
    ("vid_odd", 3, 42, 70, 2.0, "3 frames: the last is repeated to fill the second temporal patch"),
]
# (id, milliseconds, kind, note)
AUDIOS = [
    ("aud_tone", 300, "tone", "440 Hz tone with two harmonics, 30 mel frames"),
    ("aud_chirp", 500, "chirp", "linear chirp 200 Hz -> 2 kHz, 50 mel frames"),
    ("aud_long", 1300, "noise", "seeded noise under a 3 Hz envelope, 130 mel frames: two Qwen3-Omni chunks"),
]


def make_image(gen: torch.Generator, height: int, width: int) -> torch.Tensor:
    """uint8 [H, W, 3]: a smooth gradient, a bright disc and a little seeded noise, so patches differ."""
    y = torch.linspace(0, 1, height).view(-1, 1)
    x = torch.linspace(0, 1, width).view(1, -1)
    cy, cx, r = torch.rand(3, generator=gen).tolist()
    disc = (((y - cy) ** 2 + (x - cx) ** 2) < (0.1 + 0.2 * r) ** 2).float()
    channels = [
        0.2 + 0.6 * y.expand(height, width),
        0.8 - 0.6 * x.expand(height, width),
        0.3 + 0.4 * torch.sin(6.28 * (x + y)),
    ]
    img = torch.stack(channels, dim=-1) + 0.5 * disc.unsqueeze(-1)
    img = img + 0.05 * torch.randn(height, width, 3, generator=gen)
    return (img.clamp(0, 1) * 255).round().to(torch.uint8)


def make_video(gen: torch.Generator, frames: int, height: int, width: int) -> torch.Tensor:
    """uint8 [F, H, W, 3]: a background image with a square that moves right frame by frame."""
    base = make_image(gen, height, width).to(torch.int16)
    out = []
    side = max(4, height // 4)
    for f in range(frames):
        frame = base.clone()
        left = (f * width // (frames + 1)) % (width - side)
        frame[height // 3: height // 3 + side, left: left + side] = torch.tensor([250, 40, 40], dtype=torch.int16)
        out.append(frame)
    return torch.stack(out).to(torch.uint8)


def make_audio(gen: torch.Generator, ms: int, kind: str) -> torch.Tensor:
    """int16 PCM at 16 kHz."""
    n = media.SAMPLE_RATE * ms // 1000
    t = torch.arange(n, dtype=torch.float64) / media.SAMPLE_RATE
    if kind == "tone":
        wave = 0.5 * torch.sin(2 * math.pi * 440 * t) + 0.2 * torch.sin(2 * math.pi * 880 * t) \
            + 0.1 * torch.sin(2 * math.pi * 1320 * t)
    elif kind == "chirp":
        f0, f1, dur = 200.0, 2000.0, ms / 1000
        wave = 0.6 * torch.sin(2 * math.pi * (f0 * t + (f1 - f0) / (2 * dur) * t * t))
    else:
        wave = 0.4 * torch.randn(n, generator=gen, dtype=torch.float64) * (0.6 + 0.4 * torch.sin(2 * math.pi * 3 * t))
    fade = torch.clamp(torch.minimum(t, t[-1] - t) / 0.01, max=1.0)  # 10 ms fades: no clicks
    return (wave * fade * 32767).round().clamp(-32768, 32767).to(torch.int16)


def text(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(FIRST_TOKEN, LAST_TOKEN, (n,), generator=gen).tolist()


def layouts(gen: torch.Generator) -> list[tuple[str, list, bool]]:
    """(sample, layout, needs_audio): the same text around the same media for every family."""
    return [
        ("image_tiny", [("text", text(gen, 6)), ("image", "img_tiny"), ("text", text(gen, 9))], False),
        ("image_two", [("text", text(gen, 4)), ("image", "img_wide"), ("text", text(gen, 5)),
                       ("image", "img_odd"), ("text", text(gen, 3))], False),
        ("image_big", [("text", text(gen, 3)), ("image", "img_big"), ("text", text(gen, 7))], False),
        ("video_square", [("text", text(gen, 5)), ("video", "vid_square"), ("text", text(gen, 6))], False),
        ("video_odd", [("text", text(gen, 4)), ("video", "vid_odd"), ("text", text(gen, 4))], False),
        ("audio_tone", [("text", text(gen, 4)), ("audio", "aud_tone"), ("text", text(gen, 6))], True),
        ("audio_chirp", [("text", text(gen, 3)), ("audio", "aud_chirp"), ("text", text(gen, 5))], True),
        ("audio_long", [("text", text(gen, 2)), ("audio", "aud_long"), ("text", text(gen, 4))], True),
        ("image_audio", [("text", text(gen, 3)), ("image", "img_tiny"), ("text", text(gen, 2)),
                         ("audio", "aud_tone"), ("text", text(gen, 3))], True),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "testdata")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(SEED)

    rows: dict[str, list] = {k: [] for k in ("id", "kind", "height", "width", "frames", "fps", "samples",
                                              "sample_rate", "dtype", "shape", "data", "note")}
    info: dict[str, dict] = {}

    def add(mid, kind, tensor, note, height=0, width=0, frames=0, fps=0.0, samples=0, sample_rate=0):
        values = dict(id=mid, kind=kind, height=height, width=width, frames=frames, fps=fps, samples=samples,
                      sample_rate=sample_rate, dtype=str(tensor.dtype).removeprefix("torch."),
                      shape=list(tensor.shape), data=tensor.contiguous().numpy().tobytes(), note=note)
        for key, value in values.items():
            rows[key].append(value)
        info[mid] = values

    for mid, h, w, note in IMAGES:
        add(mid, "image", make_image(gen, h, w), note, height=h, width=w, frames=1)
    for mid, f, h, w, fps, note in VIDEOS:
        add(mid, "video", make_video(gen, f, h, w), note, height=h, width=w, frames=f, fps=fps)
    for mid, ms, kind, note in AUDIOS:
        pcm = make_audio(gen, ms, kind)
        add(mid, "audio", pcm, note, samples=pcm.numel(), sample_rate=media.SAMPLE_RATE)

    schema = pa.schema([("id", pa.string()), ("kind", pa.string()), ("height", pa.int32()), ("width", pa.int32()),
                        ("frames", pa.int32()), ("fps", pa.float32()), ("samples", pa.int32()),
                        ("sample_rate", pa.int32()), ("dtype", pa.string()), ("shape", pa.list_(pa.int32())),
                        ("data", pa.binary()), ("note", pa.string())])
    args.out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows, schema=schema), args.out / "multimodal.parquet", compression="zstd")

    seq_rows: dict[str, list] = {k: [] for k in ("family", "sample", "tokens", "media")}
    for family in media.FAMILIES.values():
        for sample, layout, needs_audio in layouts(torch.Generator().manual_seed(SEED + 1)):
            if needs_audio and family.audio_rule is None:
                continue
            seq_rows["family"].append(family.name)
            seq_rows["sample"].append(sample)
            seq_rows["tokens"].append(media.expand(layout, family, info))
            seq_rows["media"].append([v for k, v in layout if k != "text"])
    seq_schema = pa.schema([("family", pa.string()), ("sample", pa.string()), ("tokens", pa.list_(pa.int32())),
                            ("media", pa.list_(pa.string()))])
    pq.write_table(pa.table(seq_rows, schema=seq_schema), args.out / "multimodal_sequences.parquet",
                   compression="zstd")
    sizes = {p.name: p.stat().st_size for p in (args.out / "multimodal.parquet", args.out / "multimodal_sequences.parquet")}
    print(f"wrote {len(rows['id'])} media and {len(seq_rows['family'])} sequences: {sizes}")


if __name__ == "__main__":
    main()

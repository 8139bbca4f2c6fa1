"""Every size limit of a golden, in one place, and the reader's checks on a golden's bytes.

Two kinds of limit, and they must agree:

- what `record` aims for and allows (`TARGET_BYTES`, `HARD_LIMIT`): the bytes of a golden's tensors
  before compression. The sketch planner keeps a golden under the target where it can and refuses
  one over the hard limit (`numerics.sketch.plan`).
- what a reader accepts before it allocates anything (`MAX_COMPRESSED`, `MAX_DECOMPRESSED`,
  `MAX_HEADER`, `MAX_RATIO`): a file over them is not a golden, or a decompression bomb.

The hard limit stays well below the reader's caps (a test asserts it), and `record` runs the reader
itself on the bytes it is about to write, so it never writes a golden that `check` would refuse.
"""

from __future__ import annotations

import zstandard

from ..errors import GoldenError

# What record aims for and allows: the golden's tensors (and their stored parts) before compression.
TARGET_BYTES = 16 << 20
HARD_LIMIT = 64 << 20

# What a reader accepts.
MAX_COMPRESSED = 256 << 20  # the file
MAX_DECOMPRESSED = 1 << 30  # the safetensors payload inside the zstd frame
MAX_HEADER = 16 << 20  # the safetensors header (it holds the JSON manifest)
# Goldens compress about 1.2-1.5x (float tensors); a frame declaring far more content than its size
# could hold is a decompression bomb, refused before anything is allocated.
MAX_RATIO = 64
RATIO_SLACK = 1 << 20

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def check_limits(data: bytes, source: object) -> int:
    """The reader's checks on a golden's bytes before anything is decompressed: the file's size, one
    zstd frame that declares its content size, under the caps and the ratio. Returns the declared size;
    raises `GoldenError` naming the limit."""
    if len(data) > MAX_COMPRESSED:
        raise GoldenError(source, f"file is over the {MAX_COMPRESSED} byte cap")
    if len(data) < 4 or data[:4] != ZSTD_MAGIC:
        hint = " (this looks like an uncompressed safetensors file)" if data[8:10] == b'{"' else ""
        raise GoldenError(source, f"not a zstd frame; a golden is zstd-compressed safetensors{hint}")
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError:
        raise GoldenError(source, "truncated or corrupt zstd frame header") from None
    size = params.content_size
    if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        raise GoldenError(source, "zstd frame does not declare its content size; refusing (veosnap always writes it)")
    if size == 0:
        raise GoldenError(source, "zstd frame is empty")
    if size > MAX_DECOMPRESSED:
        raise GoldenError(source, f"zstd frame declares {size} bytes of content, over the {MAX_DECOMPRESSED} byte cap; "
                                  "refusing (decompression bomb?)")
    if size > MAX_RATIO * len(data) + RATIO_SLACK:
        raise GoldenError(source, f"zstd frame declares {size} bytes of content from {len(data)} compressed bytes "
                                  f"(over {MAX_RATIO}x); refusing (decompression bomb?)")
    return size


def mib(nbytes: int) -> str:
    """A byte count as people read limits: `16 MiB`, `1.5 MiB`."""
    return f"{nbytes / 2**20:.3g} MiB"

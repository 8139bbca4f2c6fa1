"""Fuzzing the golden reader: any bytes end in a valid Golden or a GoldenError, nothing else, without
a large allocation. Mutations hit the compressed file, the safetensors bytes inside (recompressed, so
they get past the zstd checksum) and the manifest's fields.
"""

from __future__ import annotations

import functools
import json
import struct
import tracemalloc
from dataclasses import dataclass

import pytest
import zstandard

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (in veosnap's [test] extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from golden_repo import committed_golden  # noqa: E402

from veosnap.errors import GoldenError
from veosnap.golden import codec
from veosnap.golden.manifest import READABLE_SCHEMAS

@dataclass(frozen=True)
class Source:
    """The golden every mutation starts from: its file, its decompressed safetensors, the header's end."""

    data: bytes
    raw: bytes
    header_end: int

    @property
    def manifest(self) -> dict:
        return json.loads(json.loads(self.raw[8:self.header_end])["__metadata__"][codec.METADATA_KEY])

    @property
    def allocation_cap(self) -> int:
        """A decode may hold the file, its decompressed content and a copy or two of that; never more."""
        return 4 * (len(self.data) + len(self.raw)) + (8 << 20)


@functools.cache
def source() -> Source:
    """This class's committed qwen3_moe bfloat16 step golden (small, has routes; no model runs), read when a
    test first needs it (not at import: a checkout without it skips the tests, not the collection)."""
    data = committed_golden("qwen3_moe", "bfloat16").read_bytes()
    raw = zstandard.ZstdDecompressor().decompress(data)
    return Source(data, raw, 8 + struct.unpack("<Q", raw[:8])[0])


def compress(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True).compress(raw)


def byte_edits(size: int, near: int | None = None) -> st.SearchStrategy:
    """A list of flips, truncations, insertions and deletions on a buffer of `size` bytes,
    positions biased to the first `near` bytes (where the structure is) when given."""
    pos = st.integers(0, size - 1) if near is None else st.one_of(st.integers(0, near), st.integers(0, size - 1))
    edit = st.one_of(
        st.tuples(st.just("flip"), pos, st.integers(0, 7)),
        st.tuples(st.just("truncate"), pos),
        st.tuples(st.just("insert"), pos, st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete"), pos, st.integers(1, 64)),
        st.tuples(st.just("overwrite"), pos, st.binary(min_size=1, max_size=8)),
    )
    return st.lists(edit, min_size=1, max_size=4)


def apply(data: bytes, edits: list[tuple]) -> bytes:
    buf = bytearray(data)
    for op, at, *arg in edits:
        at = min(at, max(len(buf) - 1, 0))
        if op == "flip" and buf:
            buf[at] ^= 1 << arg[0]
        elif op == "truncate":
            del buf[at:]
        elif op == "insert":
            buf[at:at] = arg[0]
        elif op == "delete":
            del buf[at : at + arg[0]]
        elif op == "overwrite":
            buf[at : at + len(arg[0])] = arg[0]
    return bytes(buf)


ODD_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                       st.text(max_size=8), st.just([]), st.just({}), st.just([1.0]), st.just([0.0, -1.0]))


@st.composite
def manifest_edit(draw: st.DrawFn) -> bytes:
    """The golden with one manifest field (or one tolerance, or one key part) set to an odd value."""
    src = source()
    manifest = src.manifest
    target = draw(st.sampled_from(["top", "tolerance", "key", "reference", "min_margin"]))
    value = draw(ODD_VALUES)
    if target == "top":
        field = draw(st.sampled_from(sorted(manifest) + ["unknown_field"]))
        if draw(st.booleans()):
            manifest.pop(field, None)
        else:
            manifest[field] = value
    else:
        section = manifest[target]
        name = draw(st.sampled_from(sorted(section) or ["0"]))
        section[name] = value
    header = json.loads(src.raw[8:src.header_end])
    header["__metadata__"][codec.METADATA_KEY] = json.dumps(manifest)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return compress(struct.pack("<Q", len(blob)) + blob + src.raw[src.header_end:])


def mutants() -> st.SearchStrategy:
    src = source()
    return st.one_of(
        byte_edits(len(src.data)).map(lambda e: apply(src.data, e)),
        byte_edits(len(src.raw), near=src.header_end).map(lambda e: compress(apply(src.raw, e))),
        manifest_edit(),
    )


MUTANTS = st.deferred(mutants)  # built at the first draw, inside a test: the golden is read then


def decode_outcome(data: bytes) -> str:
    tracemalloc.start()
    try:
        g = codec.decode(data, "fuzzed")
        outcome = "valid"
        assert g.manifest.schema_version in READABLE_SCHEMAS
    except GoldenError as exc:
        outcome = "refused"
        message = str(exc)
        assert message.startswith("fuzzed: ") and "\n" not in message
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < source().allocation_cap
    return outcome


def test_the_unmutated_golden_is_valid():
    assert decode_outcome(source().data) == "valid"
    assert decode_outcome(compress(source().raw)) == "valid"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(MUTANTS)
def test_mutated_goldens_decode_or_are_refused_in_one_line(data):
    decode_outcome(data)

"""Write testdata/sequences.parquet: token sequences of varied lengths for the toy models.

Deterministic: running it again writes the same table. Tokens are drawn from [3, 256) so that ids 0
(pad), 1 (bos) and 2 (eos) of the toy configs never appear inside a sequence.

    python tools/data/make_testdata.py [--out testdata/sequences.parquet]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

LENGTHS = [29, 17, 32, 8, 23, 12, 31, 5, 26, 19, 14, 30, 9, 21, 16, 27]
VOCAB = 256
FIRST_TOKEN = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[2] / "testdata" / "sequences.parquet")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(20261130)
    rows = [torch.randint(FIRST_TOKEN, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    table = pa.table(
        {
            "id": pa.array(range(len(rows)), pa.int32()),
            "length": pa.array([len(r) for r in rows], pa.int32()),
            "tokens": pa.array(rows, pa.list_(pa.int32())),
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, args.out, compression="zstd")
    print(f"wrote {args.out}: {len(rows)} sequences, lengths {min(LENGTHS)}..{max(LENGTHS)}")


if __name__ == "__main__":
    main()

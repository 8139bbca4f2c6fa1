"""Write testdata/realshape.parquet: the sequences of the real-shape goldens, as (id, length, seed).

Deterministic: running it again writes the same table. Only lengths and seeds are stored: the token
ids are derived for each model's vocabulary (`veosnap.reference.inputs.derive_tokens`), spread over
all of it, and the golden stores the ids it ran. The lengths are chosen for the kernels' shape
branches: one sequence of 4096 tokens (positions past 2048 and 4095), one of 2049, one of 600 (the
cpu goldens: 4 key blocks of 128 and a partial one), one of a single token, and two packs of short
sequences for varlen rows: 26 summing to 600 (cpu) and 40 summing to 4096 (cuda), each as long as
the single sequence beside it (a row of packed sequences must not be padded: transformers finds
packed sequences from the position ids only when there is no attention mask), with lengths on both sides of the attention kernels' key
blocks of 64, 128 and 256, so that sequences start and end inside and across blocks.

    python tools/data/make_realshape_testdata.py [--out testdata/realshape.parquet]

Which sequences a config's golden uses is its `veosnap.json` (`batch.rows`); `SETS` below names them
for the config files (printed by `--show`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

LONG = {0: 4096, 1: 600, 2: 2049, 3: 1}
CPU_PACK = [129, 1, 33, 17, 9, 25, 12, 31, 7, 20, 15, 23, 11, 19, 13, 27, 8, 21, 14, 29, 18, 1, 5, 24, 40, 48]
GPU_PACK = [1, 127, 128, 129, 255, 256, 257, 63, 64, 65, 200, 31, 17, 300, 2, 90, 129, 45, 70, 33,
            120, 9, 150, 77, 130, 23, 60, 100, 41, 250, 12, 99, 15, 36, 80, 110, 5, 28, 51, 0]
CPU_FIRST, GPU_FIRST = 10, 40
SEED_BASE = 20261130


def lengths() -> dict[int, int]:
    table = dict(LONG)
    table.update({CPU_FIRST + i: n for i, n in enumerate(CPU_PACK)})
    gpu = list(GPU_PACK)
    gpu[-1] = 4096 - sum(gpu[:-1])  # the last sequence fills the row to exactly 4096 tokens
    assert gpu[-1] > 0, gpu[-1]
    table.update({GPU_FIRST + i: n for i, n in enumerate(gpu)})
    assert sum(CPU_PACK) == LONG[1], sum(CPU_PACK)  # rows of equal length: no padding
    return table


SETS = {
    "cpu_packed": [CPU_FIRST + i for i in range(len(CPU_PACK))],
    "cuda_packed": [GPU_FIRST + i for i in range(len(GPU_PACK))],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[2] / "testdata" / "realshape.parquet")
    parser.add_argument("--show", action="store_true", help="print the id sets for veosnap.json files")
    args = parser.parse_args()
    table = lengths()
    if args.show:
        print(json.dumps(SETS))
        return
    ids = sorted(table)
    out = pa.table({
        "id": pa.array(ids, pa.int32()),
        "length": pa.array([table[i] for i in ids], pa.int32()),
        "seed": pa.array([SEED_BASE + i for i in ids], pa.int64()),
    })
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(out, args.out, compression="zstd")
    print(f"wrote {args.out}: {len(ids)} sequences, {sum(table.values())} tokens, lengths {min(table.values())}.."
          f"{max(table.values())}")


if __name__ == "__main__":
    main()

"""What a check's last milliseconds are made of: the "+layouts" tail of `bench_scale.py`'s path table.

    python tools/bench/tail_probe.py llama-hd128 [REPEATS]     # a size of bench_scale.py (GPU sizes on a GPU)

Records that size's golden (as `bench_scale.py` does), then runs plain checks while keeping, in turn, nothing,
the golden, the prebuild, or both alive past the check (by holding a reference taken where the check makes
them), and prints per variant the median (range) of: the tail (ms from the prebuild's cancel to the check's
return, wall and the main thread's CPU time), and the time to free what was kept, after the check. Then it times
freeing a freshly decoded golden against freeing plain tensors of the same sizes and one buffer of their total.

Round 10 (docs/scale.md) ran it on an H100 before `runs.letgo`: the tail was the golden's release (1.7-3.6 ms on
that host's 55 threads, 0.3 ms on a 2-core CPU). Since `runs.letgo` every variant keeps the golden past the
check; "none" then shows the tail as a check now has it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale as bench  # noqa: E402 - the benchmark's sizes, project and recording

import torch  # noqa: E402

from veosnap.candidates import backends  # noqa: E402
from veosnap.golden import store  # noqa: E402
from veosnap.golden.key import GoldenKey  # noqa: E402
from veosnap.reference import prebuild as prebuild_module  # noqa: E402
from veosnap.runs import check as check_module  # noqa: E402
from veosnap.runs import letgo  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("size", choices=sorted(bench.SIZES), help="a size of bench_scale.py")
    parser.add_argument("repeats", nargs="?", type=int, default=3)
    args = parser.parse_args()
    size, repeats = bench.SIZES[args.size], args.repeats
    project = bench.make_project(Path(tempfile.mkdtemp()), size)
    key = GoldenKey(project.hardware_class, size.name, "step", "bfloat16")
    path = store.path_for(project.goldens, key)
    store.write_bytes(bench.encode_checked(bench.build_golden(project, key, allow_near_ties=True, sketch="auto"),
                                           path), path, project.goldens)
    backend = backends.resolve(size.candidate[0])

    kept: list[object] = []
    clock: dict[str, tuple[float, float]] = {}
    load, init = check_module.load_checked, prebuild_module.Prebuild.__init__
    cancel, layouts = prebuild_module.Prebuild.cancel, check_module._check_layouts

    def keep_golden(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = load(*args, **kwargs)
        kept.append(out[0])
        return out

    def keep_prebuild(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        init(self, *args, **kwargs)
        kept.append(self)

    def cancelled(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        try:
            return cancel(self, *args, **kwargs)
        finally:
            clock["cancel"] = (time.perf_counter(), time.thread_time())

    def returned(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        try:
            return layouts(*args, **kwargs)
        finally:
            clock["return"] = (time.perf_counter(), time.thread_time())

    prebuild_module.Prebuild.cancel, check_module._check_layouts = cancelled, returned

    def one(what: str) -> dict[str, float]:
        check_module.load_checked = keep_golden if what in ("golden", "both") else load
        prebuild_module.Prebuild.__init__ = keep_prebuild if what in ("prebuild", "both") else init
        try:
            check_module.check(project, key, backend)
        finally:
            check_module.load_checked, prebuild_module.Prebuild.__init__ = load, init
        started = time.perf_counter()
        kept.clear()
        letgo.let_go()
        return {"tail wall": clock["return"][0] - clock["cancel"][0],
                "tail cpu": clock["return"][1] - clock["cancel"][1], "freed after": time.perf_counter() - started}

    one("none")
    rows: dict[str, list[dict[str, float]]] = {}
    for _ in range(repeats):
        for what in ("none", "golden", "prebuild", "both"):
            rows.setdefault(what, []).append(one(what))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{device}, {size.name}, {len(os.listdir('/proc/self/task'))} threads; ms, median (range) of {repeats}")
    for what, runs in rows.items():
        print(f"kept {what:9s} " + "  ".join(
            f"{name} {1e3 * statistics.median(r[name] for r in runs):.2f} "
            f"({1e3 * min(r[name] for r in runs):.2f}-{1e3 * max(r[name] for r in runs):.2f})" for name in runs[0]))

    golden = store.read(path)
    sizes = [t.numel() * t.element_size() for t in golden.tensors.values()]
    sizes += [t.numel() * t.element_size() for s in golden.sketches.values() for t in vars(s).values()
              if isinstance(t, torch.Tensor)]
    del golden
    print(f"the golden: {len(sizes)} tensors, {sum(sizes) / 2**20:.1f} MiB; ms to free, median (range) of 5:")
    for label, make in (("a decoded golden", lambda: store.read(path)),
                        ("plain tensors of its sizes", lambda: [torch.ones(max(s // 4, 1)) for s in sizes]),
                        ("one buffer of its total", lambda: bytearray(sum(sizes)))):
        times = []
        for _ in range(5):
            thing = make()
            started = time.perf_counter()
            del thing
            times.append(1e3 * (time.perf_counter() - started))
        print(f"  {label}: {statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})")


if __name__ == "__main__":
    main()

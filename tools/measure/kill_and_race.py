"""Fault injection for golden writes: recorders SIGKILLed at random moments, and recorders racing
each other and a reader, on the CPU on any machine (a GPU is hidden). Prints a table (or JSON with
--json); tests/test_crashes.py runs it small.

    python tools/measure/kill_and_race.py kill --kills 100 [--mode record|write] [--seed 0] [--dir DIR]
    python tools/measure/kill_and_race.py race --rounds 6 [--dir DIR]

Recorders run `veosnap.surfaces.cli.main(["record", ...])` in children forked from this process, which has
already imported torch and transformers, so a kill costs a fork instead of a ~4 s interpreter start.
`kill --mode record` kills at random moments of whole recordings (model build, runs, encode, write);
`kill --mode write` kills children that only rewrite the golden, so most kills land inside the write.
After every kill the golden must read (`store.read`) and be byte-identical to one recorded version.

Two kills in three land at random moments; the third, in turn, at a staged moment whatever the speed of
the machine: inside a write (the temp file written and fsynced, not yet renamed) or right after one (the
new version in place). The child stops there and says so through a pipe, and is killed only then, so
`staged_mid_write` kills each leave a temp file and `staged_after_write` kills each change the golden,
on a busy machine as on an idle one.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
# Kills and races are about files, and forked children cannot use a CUDA context their parent made:
# hide any GPU, so the recorders run on the CPU (class cpu) on every machine.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402

from veosnap.errors import GoldenError  # noqa: E402
from veosnap.golden import codec, store  # noqa: E402
from veosnap.golden.key import GoldenKey  # noqa: E402
from veosnap.surfaces.cli import main as cli  # noqa: E402

# One intra-op thread before any fork: a child must not inherit a half-initialized thread pool.
# (Recording runs on one thread anyway, for reproducible bytes.)
torch.set_num_threads(1)

MODEL = "llama"


def record(goldens: Path, seed: int, model: str = MODEL) -> None:
    """One `veosnap record` of the model's float32 golden with weight seed `seed`."""
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli(["record", "--goldens", str(goldens), "--hardware-class", "cpu", "--model", model,
                    "--dtype", "float32", "--seed", str(seed)])
    if code:
        raise SystemExit(code)


def golden_path(goldens: Path, model: str = MODEL) -> Path:
    return store.path_for(goldens, GoldenKey("cpu", model, "step", "float32"))


def fork(work: Callable[[], None]) -> int:
    """Run `work` in a forked child; returns its pid. The child never returns into this program."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            work()
        except BaseException:  # noqa: BLE001 - report and leave; the parent sees the exit status
            traceback.print_exc()
            code = 1
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    return pid


def wait(*pids: int) -> None:
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"child {pid} failed with status {os.waitstatus_to_exitcode(status)}")


def versions(work_dir: Path, seeds: tuple[int, ...]) -> tuple[dict[bytes, int], float]:
    """The golden's bytes for each seed, recorded one after the other (no interference), and the
    time of the fastest recording.

    Recorded here, not in a child, so the children forked later inherit every lazily imported module.
    """
    times = []
    for seed in seeds:
        t0 = time.monotonic()
        record(work_dir / f"seed-{seed}", seed)
        times.append(time.monotonic() - t0)
    return {golden_path(work_dir / f"seed-{seed}").read_bytes(): seed for seed in seeds}, min(times)


STAGES = ("random", "mid-write", "after-write")


def staged(stage: str, notify: int) -> None:
    """In the child: stop at `stage` of the next golden write (`mid-write`: temp file fsynced, before the
    rename; `after-write`: right after it), say so through `notify`, and wait there to be killed."""
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if stage == "mid-write":
            os.write(notify, b"m")
            signal.pause()
        real_replace(src, dst, *args, **kwargs)
        if stage == "after-write":
            os.write(notify, b"a")
            signal.pause()

    os.replace = replace


def kill(work_dir: Path, kills: int, mode: str, rng: random.Random) -> dict:
    """SIGKILL a recorder `kills` times, at random or staged moments; after each, judge the golden on disk."""
    seeds = (1, 2)
    known, record_seconds = versions(work_dir / "versions", seeds)
    by_seed = {seed: data for data, seed in known.items()}
    goldens = work_dir / "goldens"
    path = golden_path(goldens)
    t0 = time.monotonic()
    store.write_bytes(by_seed[1], path)  # the previous golden every kill must leave intact
    write_seconds = time.monotonic() - t0
    # record: kills spread over two recordings and what lies between; write: over about ten writes
    window = 2.5 * record_seconds if mode == "record" else 10 * max(write_seconds, 1e-3)

    stats = {"mode": mode, "kills": 0, "readable": 0, "whole_version": 0, "changed": 0, "temps_left": 0,
             "listed_once": 0, "staged_mid_write": 0, "staged_after_write": 0, "changed_by_staged": 0,
             "temps_left_by_staged": 0, "window_s": round(window, 3), "errors": []}
    current = 1
    for index in range(kills):
        first = 2 if current == 1 else 1  # start with the other version, so every write changes the file
        stage = STAGES[index % len(STAGES)]
        notify_r, notify_w = os.pipe()

        def churn(first: int = first, stage: str = stage) -> None:
            os.close(notify_r)
            if stage != "random":
                staged(stage, notify_w)
            turn = first
            while True:
                if mode == "record":
                    record(goldens, turn)
                else:
                    store.write_bytes(by_seed[turn], path)
                turn = 2 if turn == 1 else 1

        temps_before = set(store.temp_files(path))
        pid = fork(churn)
        os.close(notify_w)
        if stage == "random":
            time.sleep(rng.uniform(0, window))
        elif os.read(notify_r, 1):  # blocks until the child stands at its stage: no timing involved
            stats["staged_" + stage.replace("-", "_")] += 1
        os.close(notify_r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        stats["kills"] += 1
        data = path.read_bytes()
        left = len(set(store.temp_files(path)) - temps_before)
        if data in known:
            stats["whole_version"] += 1
            stats["changed"] += known[data] != current
            stats["changed_by_staged"] += stage == "after-write" and known[data] != current
            current = known[data]
        stats["temps_left_by_staged"] += stage == "mid-write" and left > 0
        try:
            store.read(path, root=goldens)
            stats["readable"] += 1
        except GoldenError as exc:
            stats["errors"].append(str(exc))
        stats["temps_left"] += left
        stats["listed_once"] += [p for _, p in store.list_goldens(goldens)] == [path]
    stats["lost"] = stats["kills"] - min(stats["readable"], stats["whole_version"])
    return stats


def race(work_dir: Path, rounds: int) -> dict:
    """Recorders on different goldens at once; then two recorders on one golden under a reader loop."""
    serial = work_dir / "serial"
    parallel = work_dir / "parallel"
    models = ("llama", "qwen2")

    for model in models:
        record(serial, 0, model)
    wait(*[fork(lambda model=model: [record(parallel, seed, model) for seed in [1, 0] * (rounds // 2) + [0]])
           for model in models])
    different = {
        "different_goldens": len(models),
        "identical_to_serial": sum(golden_path(parallel, m).read_bytes() == golden_path(serial, m).read_bytes()
                                   for m in models),
    }

    seeds = (1, 2)
    known, _ = versions(work_dir / "versions", seeds)
    shared = work_dir / "shared"
    path = golden_path(shared)
    store.write_bytes(next(iter(known)), path)
    pids = [fork(lambda seed=seed: [record(shared, seed) if i % 2 == 0 else record(shared, 3 - seed)
                                    for i in range(rounds)]) for seed in seeds]
    reads = whole = readable = switches = 0
    last = None
    errors: list[str] = []
    live = set(pids)
    while live:
        for pid in list(live):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                live.discard(pid)
                if os.waitstatus_to_exitcode(status) != 0:
                    raise SystemExit(f"recorder {pid} failed with status {os.waitstatus_to_exitcode(status)}")
        data = path.read_bytes()
        reads += 1
        whole += data in known
        switches += last is not None and data != last
        last = data
        try:
            codec.decode(data, path)
            readable += 1
        except GoldenError as exc:
            errors.append(str(exc))
        time.sleep(0.002)
    return {**different, "same_golden_writers": len(seeds), "writes_each": rounds, "reads": reads,
            "readable": readable, "whole_version": whole, "switches_seen": switches, "errors": errors[:5]}


def table(stats: dict) -> str:
    width = max(map(len, stats))
    return "\n".join(f"{k:{width}s}  {v}" for k, v in stats.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("kill", help="SIGKILL recorders at random moments")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--mode", choices=("record", "write"), default="record")
    p.add_argument("--seed", type=int, default=0, help="seed of the random kill times")
    p = sub.add_parser("race", help="parallel recorders, and two recorders on one golden under a reader")
    p.add_argument("--rounds", type=int, default=4)
    for p in sub.choices.values():
        p.add_argument("--dir", type=Path, help="work directory (default: a fresh temp dir, removed after)")
        p.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work_dir = args.dir or Path(tempfile.mkdtemp(prefix="veosnap-faults-"))
    try:
        if args.what == "kill":
            stats = kill(work_dir, args.kills, args.mode, random.Random(args.seed))
        else:
            stats = race(work_dir, args.rounds)
    finally:
        if args.dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
    print(json.dumps(stats) if args.json else table(stats))


if __name__ == "__main__":
    main()

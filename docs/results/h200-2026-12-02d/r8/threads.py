"""Round 7's diagnosis run (docs/scale.md), kept with its log (diag.log): which threads ran, by their CPU time
in /proc's schedstat, while a plain check's main thread was in the guard's entry and from its last layout judged
to its return; how long the device was still busy after the return; the same checks at a 0.5 ms GIL switch
interval. Its /proc reads cost the main thread 2-3 ms each and fall inside the intervals it times (its e2e
figures, its guard entries and its tail are inflated by them). On the H200:
python3 docs/results/h200-2026-12-02d/r8/threads.py llama-hd128,qwen3_moe-1b"""
import os, sys, time, tempfile, threading, json
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]  # run from the repository root as python3 docs/results/h200-2026-12-02d/r8/threads.py SIZES
sys.path.insert(0, str(ROOT / "tools")); sys.path.insert(0, str(ROOT))
import torch
import bench_scale as b
from veosnap.runs import check as check_module
from veosnap.candidates import backends, guard as guard_module
from veosnap.golden.key import GoldenKey

def tasks():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            ns = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
        except OSError:
            continue
        out[tid] = (name, ns)
    return out

def busy(a, b_):
    res = []
    names = pythreads()
    for tid, (name, ns) in b_.items():
        name = names.get(tid, name) + f"/{tid}"
        d = ns - a.get(tid, (name, 0))[1]
        if d > 100_000:
            res.append(f"{name}={d/1e6:.1f}")
    return " ".join(sorted(res, key=lambda x: -float(x.rsplit('=', 1)[1])))

pyname = {}
def pythreads():
    return {str(t.native_id): t.name for t in threading.enumerate()}

b.instrument()
log = []
real_running = guard_module.running
from contextlib import contextmanager
@contextmanager
def running(*a, **k):
    t0, s0 = time.perf_counter(), tasks()
    with real_running(*a, **k):
        t1, s1 = time.perf_counter(), tasks()
        log.append(f"guard entry {(t1-t0)*1e3:.2f} ms; ran: {busy(s0, s1)}")
        yield
guard_module.running = running
real_loaded = check_module._check_loaded
tail = {}
def loaded(*a, **k):
    r = real_loaded(*a, **k)
    tail["t"], tail["s"] = time.perf_counter(), tasks()
    return r
check_module._check_loaded = loaded
real_check = check_module.check
def checked(*a, **k):
    r = real_check(*a, **k)
    tail["r"], tail["rs"] = time.perf_counter(), tasks()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    tail["i"] = time.perf_counter()
    return r
check_module.check = checked

INTERVALS = (0.005, 0.0005) if torch.cuda.is_available() else (0.005, 0.0005)
for name in sys.argv[1].split(","):
    size = b.SIZES[name]
    work = Path(tempfile.mkdtemp())
    project = b.make_project(work, size)
    key = GoldenKey(project.hardware_class, size.name, "step", "bfloat16")
    path = b.store.path_for(project.goldens, key)
    b.store.write_bytes(b.encode_checked(b.build_golden(project, key, allow_near_ties=True, sketch="auto"), path), path, project.goldens)
    backend = backends.resolve(size.candidate[0])
    golden = b.store.read(path, project.goldens)
    from veosnap.reference.zoo import load_config
    toy = load_config(project.configs, size.name)
    with b.deterministic():
        fb = b.candidate_alone(toy, "bfloat16", golden, backend)[0]
    print(name, "cand f+b", round(fb * 1e3, 1), flush=True)
    for interval in INTERVALS:
        sys.setswitchinterval(interval)
        for i in range(2):
            log.clear()
            _, plain, check_s, _ = b.one_check(project, key, backend, only={"build"})
            build_s = plain.get("build") + plain.get("bg:build") - plain.get("vet")
            e2e = check_s - build_s - fb
            print(f"  switch {interval*1e3:.1f} ms: e2e own {e2e*1e3:.1f} ms ({e2e/fb:.2f}); gc {sum(x for _, x in plain.collections)*1e3:.1f} ms; out->return {(tail['r']-tail['t'])*1e3:.2f} ms, ran: {busy(tail['s'], tail['rs'])}; return->idle {(tail['i']-tail['r'])*1e3:.2f} ms", flush=True)
            for line in log:
                print("   ", line[:600], flush=True)
    sys.setswitchinterval(0.005)

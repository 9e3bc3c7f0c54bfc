"""The engine's memory over a long run (issue 62): whether the vLLM worker's RSS grows with the
steps, and with the model.

    python bench/worker_memory.py                       # the default job, 1,000 steps, no evaluation
    python bench/worker_memory.py --env MALLOC_ARENA_MAX=2 -- --train.steps=200
    python bench/worker_memory.py --scale               # bench/scale.py at 0.49B, world 1, 20 syncs of each path

Default mode: `run.py` with the default job's flags (its tiny model and warm start) for
--steps steps without held-out evaluation (any run.py flag after `--` is added), while this
process samples, every --every seconds, the RSS (/proc/PID/statm) of the trainer, the vLLM
engine core (VLLM::EngineCore) and its worker (VLLM::Worker), each with the step the run has
logged. Printed per process: its RSS at the first quarter of the steps and at the end, and the
slope over the last half of the steps (least squares, MB a step):

    RESULT process=worker steps=1000 rss_quarter_mb=... rss_last_step_mb=... slope_last_half_mb_per_step=...

--scale: `bench/scale.py --worlds 1 --syncs N --trace` (a random Qwen2-0.5B-shaped model: 494M
parameters, 1.98 GB in float32), then the worker's RSS in its trace just before each sync and
after it, by path (group, the loop's; file):

    RESULT scale sync=3 path=group worker_after_mb=...
    RESULT scale path=group worker_after_sync3_mb=... worker_after_last_mb=... ratio=...

--trace writes every sample (JSON). Not a test and not imported by any; results go to
bench/results/worker_memory.md, what they mean to docs/faults.md. Run it niced on a shared
machine: the figures are memory, not time, and a loaded machine moves only the seconds.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1e6
# process names: the kernel's (15 characters) or, where psutil reads the command line, the whole title
KINDS = {"VLLM::EngineCor": "engine_core", "VLLM::Worker": "worker"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for the run (and its engine), repeatable")
    p.add_argument("--trace", default="", help="write every sample here (JSON)")
    p.add_argument("--scale", action="store_true", help="bench/scale.py's syncs at 0.49B instead of a run")
    p.add_argument("--syncs", type=int, default=20, help="--scale: syncs of each path")
    p.add_argument("--report", default="", help="print the RESULT lines of a --trace file written before, run nothing")
    p.add_argument("flags", nargs="*", help="run.py flags (after --)")
    return p.parse_args()


def kind_of(process, root_pid: int) -> str | None:
    """trainer, engine_core, worker, or None for another process of the run (the reaper, ...)."""
    if process.pid == root_pid:
        return "trainer"
    try:
        name = process.name()
        return next((kind for prefix, kind in KINDS.items() if name.startswith(prefix)), None)
    except Exception:  # ended meanwhile
        return None


def rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


class Sampler:
    """Every `every` seconds: (time, the run's logged step, {kind: RSS bytes}), and the pid of each kind."""

    def __init__(self, root_pid: int, every: float, step=lambda: None):
        import psutil
        self.root, self.every, self.step = psutil.Process(root_pid), every, step
        self.samples, self.pids = [], {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import psutil
        while not self.stop.wait(self.every):
            try:
                processes = [self.root] + self.root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            row = {}
            for p in processes:
                kind = kind_of(p, self.root.pid)
                value = rss(p.pid) if kind else None
                if value is not None:
                    self.pids.setdefault(kind, set()).add(p.pid)
                    row[kind] = row.get(kind, 0) + value
            self.samples.append((time.time(), self.step(), row))

    def close(self):
        self.stop.set()
        self.thread.join()


def slope(points) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else float("nan")


def logged_steps(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def run_job(args):
    out = tempfile.mkdtemp(prefix="worker-memory-")
    flags = [f"--train.steps={args.steps}", "--train.eval_every=0", "--log.wandb_mode=disabled",
             "--log.progress=False", f"--log.out_dir={out}/run", *args.flags]
    env = {**os.environ, **dict(e.split("=", 1) for e in args.env)}
    print(f"run.py {' '.join(flags)}  env {args.env}; load average {os.getloadavg()}", flush=True)
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), *flags], cwd=ROOT, env=env)
    sampler = Sampler(proc.pid, args.every, lambda: logged_steps(f"{out}/run/metrics.jsonl"))
    code = proc.wait()
    sampler.close()
    print(f"exit {code} after {time.time() - t0:.0f} s; load average {os.getloadavg()}", flush=True)
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump({"flags": flags, "env": args.env, "samples": sampler.samples}, f)
    report(sampler.samples)
    return code


def report(samples: list):
    """The RESULT lines of a run's samples; those taken once its last step is logged are its
    shutdown (the engine freeing its memory), not a step's, and are left out."""
    steps = max((s for _, s, _ in samples if s), default=0)
    for kind in ("trainer", "engine_core", "worker"):
        series = [(s, row[kind] / MB) for _, s, row in samples if s and s < steps and kind in row]
        if not series:
            continue
        quarter = next((v for s, v in series if s >= steps / 4), float("nan"))
        last_half = [(s, v) for s, v in series if s >= steps / 2]
        print(f"RESULT process={kind} steps={steps} rss_quarter_mb={quarter:.0f} rss_last_step_mb={series[-1][1]:.0f} "
              f"rss_max_mb={max(v for _, v in series):.0f} slope_last_half_mb_per_step={slope(last_half):.4f}")


def run_scale(args):
    """bench/scale.py at world 1 with --trace; the worker's RSS around each sync."""
    work = tempfile.mkdtemp(prefix="worker-memory-scale-")
    trace = os.path.join(work, "trace")
    env = {**os.environ, **dict(e.split("=", 1) for e in args.env)}
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "scale.py"), "--worlds", "1",
                             "--syncs", str(args.syncs), "--trace", trace, *args.flags], cwd=ROOT, env=env)
    sampler = Sampler(proc.pid, 1.0)  # for the pid of each kind: scale.py's own trace holds every 10 ms
    code = proc.wait()
    sampler.close()
    if code:
        return code
    with open(f"{trace}.world1.json") as f:
        recorded = json.load(f)
    workers = {str(pid) for pid in sampler.pids.get("worker", ())}
    series = [(t, sum(v for pid, v in row.items() if pid in workers)) for t, row in recorded["samples"]
              if workers & row.keys()]
    after = {"group": [], "file": []}
    for e in recorded["events"]:
        if e["what"] == "sync_end" and e["rank"] == 0:
            later = [v for t, v in series if t >= e["t"]][:1]
            after[e["how"]].append(later[0] / MB if later else float("nan"))
    for how, values in after.items():
        for i, v in enumerate(values, 1):  # group's first is the untimed sync that opens the weight group
            print(f"RESULT scale sync={i} path={how} worker_after_mb={v:.0f}")
        if len(values) >= 3:
            print(f"RESULT scale path={how} syncs={len(values)} worker_after_sync3_mb={values[2]:.0f} "
                  f"worker_after_last_mb={values[-1]:.0f} ratio={values[-1] / values[2]:.3f}")
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump({"after": after, "worker_series": series}, f)
    return 0


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.report:
        with open(arguments.report) as f:
            sys.exit(report(json.load(f)["samples"]))
    sys.exit(run_scale(arguments) if arguments.scale else run_job(arguments))

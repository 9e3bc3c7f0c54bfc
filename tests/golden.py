"""Pinned gradients and metrics of every objective on a fixed batch (tests/golden.json).

    python tests/golden.py                  # rewrite tests/golden.json from the current code
    python tests/golden.py --spread DIR     # each pinned figure under every kernel and thread count (below)

The numbers were first written by the loop as it was before the objectives were split out
of run.py (commit 95aa211), and the objectives table gave the same ones; they were rewritten
by the table when the tiny model's recipe changed (version 2: the strops prompt names its
ops, so the tokenizer, the model and the batch changed), and again (version 3, 2026-11-27)
under a recorder that steps (tests/test_loop.py's SteppingRecorder), on a batch whose engine
log-probs are the start's plus noise, so that the second mini-batch runs off ratio 1 and
the clips and IS weights act; tests/test_loop.py checks these steps against an independent
computation, these pins keep today's numbers; in 2026-11-29 the metrics added since
(is/clipfrac, sdpo/is_clipfrac, sdpo/divergence_right and _wrong) joined them, the figures
pinned before left as they were. tests/test_objectives.py checks that the code of today gives
the same ones. A gradient is pinned by, per parameter tensor, its sum,
its sum of squares and its dot product with a fixed random vector: a change anywhere in a
tensor moves the last one.

The same code gives other float32 sums on another machine (other SIMD kernels, another split
of the work between threads), so the tests' tolerances are set from the spread `--spread`
measures: tests/golden.json's gradients and metrics, and tests/test_async.py's golden run
(tests/golden_run.json), each under ATEN_CPU_CAPABILITY=default, avx2 and avx512 (those the
CPU has) and 1 and 2 threads (OMP_NUM_THREADS, and the cores the run's engine may use). Each
setting's figures are written to DIR (kept: a second call only adds what is missing), each built
from its own tiny model and warm start (a cache under DIR), then the
largest difference between two settings, and from the pinned file, is printed for each kind
of figure; the tables and the margins taken over them are in docs/results.md (Tests).
"""
import argparse
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PATH = os.path.join(ROOT, "tests", "golden.json")

# (name, flags): every objective and the SDPO variants whose loss path differs
CASES = [
    ("sdpo", ["--algo=sdpo"]),
    ("sdpo-full-reverse-unchunked", ["--algo=sdpo", "--sdpo.distill=full", "--sdpo.alpha=1.0", "--sdpo.chunked=False"]),
    ("sdpo-token", ["--algo=sdpo", "--sdpo.distill=token"]),
    ("sdpo-no-is-correction", ["--algo=sdpo", "--rollout.is_correction=False"]),
    ("sdpo-trust-region", ["--algo=sdpo", "--sdpo.teacher=trust-region"]),
    ("grpo", ["--algo=grpo"]),
    ("gspo", ["--algo=gspo"]),
    ("hybrid", ["--algo=hybrid"]),
    ("sft", ["--algo=sft"]),
    # mini-batches of whole prompts (the default since 2026-11-27; pinned when it became so)
    ("sdpo-prompt-mini-batches", ["--algo=sdpo", "--train.shuffle_samples=False"]),
    ("grpo-prompt-mini-batches", ["--algo=grpo", "--train.shuffle_samples=False"]),
]
# The cases before the last two were pinned with mini-batches of single shuffled samples.
COMMON = ["--train.mini_batches=2", "--train.micro_batch=4", "--sdpo.topk=8", "--sdpo.chunk_size=7",
          "--train.shuffle_samples=True"]


def fingerprint(grads: dict) -> dict:
    """name -> [sum, sum of squares, dot with a fixed random vector] of each gradient."""
    out = {}
    for name, g in sorted(grads.items()):
        g = g.double().flatten()
        probe = torch.randn(g.numel(), generator=torch.Generator().manual_seed(len(name)), dtype=torch.float64)
        out[name] = [g.sum().item(), (g * g).sum().item(), (g * probe).sum().item()]
    return out


def record(step_fn) -> dict:
    """step_fn(flags) -> (list of per-optimizer-step gradient dicts, metrics dict)."""
    results = {}
    for name, flags in CASES:
        grads, metrics = step_fn(COMMON + flags)  # a case's own flags win
        results[name] = {"grads": [fingerprint(g) for g in grads],
                         "metrics": {k: v for k, v in sorted(metrics.items())
                                     if isinstance(v, (int, float)) and not k.startswith("time/")}}
    return results


def settings() -> list[tuple[str, int]]:
    """(ATEN_CPU_CAPABILITY, threads) of every setting this machine can run."""
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    kernels = ["default"] + [k for k, flag in (("avx2", "avx2"), ("avx512", "avx512f")) if flag in flags]
    return [(k, t) for k in kernels for t in (1, 2) if t <= len(os.sched_getaffinity(0))]


# vLLM's CPU sampler compiles a kernel with torch inductor, whose code does not build under
# ATEN_CPU_CAPABILITY=default (vLLM's CPU backend needs AVX2 or AVX-512 anyway): in that setting the
# golden run's trainer takes the default kernels and its engine, started without the variable, its own.
TRAINER_ONLY = ("import os, runpy, sys, torch; torch.backends.cpu.get_cpu_capability(); "
                "del os.environ['ATEN_CPU_CAPABILITY']; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")


def measure(directory: str, kernel: str, threads: int, what: str) -> str:
    """The golden gradients (what="grads") or the golden run (what="run") under one setting, in
    a process of their own, into DIRECTORY/<what>-<kernel>-<threads>.json (kept if there)."""
    path = os.path.join(directory, f"{what}-{kernel}-{threads}.json")
    if os.path.exists(path):
        return path
    # a cache of its own: the tiny model and the golden run's warm start built under the setting too
    env = {**os.environ, "ATEN_CPU_CAPABILITY": kernel, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           "SDPO_CACHE": os.path.join(directory, f"cache-{kernel}-{threads}")}
    cores = sorted(os.sched_getaffinity(0))[:threads]  # the engine computes on these
    if what == "grads":
        cmd = [sys.executable, __file__, "--measure", path + ".partial"]
    else:
        from test_async import GOLDEN_RUN
        out = path + ".run"
        cmd = [sys.executable, os.path.join(ROOT, "run.py"), *GOLDEN_RUN, "--train.off_policy_steps=0",
               f"--log.out_dir={out}", "--log.overwrite=True"]
        if kernel == "default":  # the trainer's kernels alone: see TRAINER_ONLY
            cmd[1:1] = ["-c", TRAINER_ONLY]
    print(f"{what} {kernel} {threads} thread(s): {' '.join(cmd[1:3])} ...", flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, preexec_fn=lambda: os.sched_setaffinity(0, cores),
                   stdout=subprocess.DEVNULL)
    if what == "run":
        with open(os.path.join(out, "metrics.jsonl")) as f, open(path + ".partial", "w") as g:
            json.dump({"records": [json.loads(line) for line in f]}, g)
    os.replace(path + ".partial", path)
    return path


def figures(record: dict, what: str):
    """Every pinned figure of a measurement: ((kind, where), value, scale), where scale is what
    the test measures its difference against (a gradient's sum and projection: the tensor's
    gradient norm; a sum of squares and a metric: itself)."""
    if what == "grads":
        for case, result in record.items():
            for step, grads in enumerate(result["grads"]):
                for tensor, (total, squares, projection) in grads.items():
                    norm = squares ** 0.5
                    yield ("gradient sum, projection (/ its tensor's norm)", (case, step, tensor, 0)), total, norm
                    yield ("gradient sum, projection (/ its tensor's norm)", (case, step, tensor, 2)), projection, norm
                    yield ("gradient sum of squares (relative)", (case, step, tensor)), squares, squares
            for key, value in result["metrics"].items():
                yield (f"metric {key}", case), value, abs(value)
    else:
        for r in record["records"]:
            for key, value in r.items():
                if not key.startswith(("time/", "throughput/", "sync/seconds")) and key != "step":
                    yield (f"golden run {key}", r["step"]), value, abs(value)


def spread(measured: dict, pinned: dict, what: str) -> dict:
    """kind -> (largest difference between two settings, from the pinned value), each as an
    absolute difference and relative to its scale: {kind: (abs, rel, abs_pinned, rel_pinned)}."""
    values = {}
    for name, record in measured.items():
        for (kind, where), value, scale in figures(record, what):
            values.setdefault((kind, where), []).append((value, scale))
    pins = {key: value for key, value, _ in figures(pinned, what)}
    out = {}
    for (kind, where), got in values.items():
        scale = max(s for _, s in got) or 1e-300
        between = max(v for v, _ in got) - min(v for v, _ in got)
        from_pin = max(abs(v - pins[(kind, where)]) for v, _ in got) if (kind, where) in pins else 0.0
        old = out.get(kind, (0.0, 0.0, 0.0, 0.0))
        out[kind] = (max(old[0], between), max(old[1], between / scale), max(old[2], from_pin),
                     max(old[3], from_pin / scale))
    return out


def print_spread(directory: str):
    os.makedirs(directory, exist_ok=True)
    for what, pinned_file in (("grads", PATH), ("run", os.path.join(ROOT, "tests", "golden_run.json"))):
        measured = {}
        for kernel, threads in settings():
            with open(measure(directory, kernel, threads, what)) as f:
                measured[f"{kernel}/{threads}"] = json.load(f)
        with open(pinned_file) as f:
            pinned = json.load(f)
        print(f"\n{what}: {len(measured)} settings ({', '.join(measured)}); the largest difference between two "
              f"settings, and from {os.path.basename(pinned_file)}\n")
        print("| figure | between settings: abs | rel | from the pinned: abs | rel |\n|---|---:|---:|---:|---:|")
        for kind, (a, r, pa, pr) in sorted(spread(measured, pinned, what).items()):
            print(f"| {kind} | {a:.2g} | {r:.2g} | {pa:.2g} | {pr:.2g} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spread", metavar="DIR", help="measure every setting into DIR and print the spread")
    parser.add_argument("--measure", metavar="FILE", help=argparse.SUPPRESS)  # one setting's gradients (a child)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    if args.spread:
        print_spread(args.spread)
        sys.exit()
    from test_objectives import new_loop_step
    with open(args.measure or PATH, "w") as f:
        json.dump(record(lambda flags: new_loop_step(flags, stepping=True)), f, indent=1)
    print(f"wrote {args.measure or PATH}")

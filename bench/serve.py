"""A new run's start and steps with an engine of its own against a warm engine that vLLM's server
runs (served.py, --rollout.engine): what a sweep saves by reusing one, and what the HTTP costs.

    python bench/serve.py                       # the tiny model, the default job's batch, 2 runs of each
    python bench/serve.py --steps 3 --repeats 3
    python bench/serve.py --model-dir DIR       # another model (a text model of the default task)

One server (served.serve_command on loopback, the run's settings) is started first and left warm;
its start is reported (server_start_s: what a sweep's first run pays once). Then, alternately
(own, served, own, served, ...: the machine's load falls on both alike), child processes each play
a new run's start as run.py does it:
  own     rollout.start_engine starts a vLLM engine of its own (in its own process on CPU), the
          policy loads, the first batch is generated;
  served  rollout.start_engine connects to the warm server (its model checked), the policy loads,
          its weights go to the server by the run's first sync (proven), the first batch is generated;
each timed from the child process's creation (its imports included) to the first batch
(first_batch_{own,served}_s). Then --steps steps of what the loop does with the engine: every weight
nudged, `sync.sync_engine` (transfer, digests, probe), a batch generated (`rollout.generate_and_score`):
step_{own,served}_s, with its sync and generation parts. Prints a line per child and

    RESULT server_start_s=... first_batch_own_s=... first_batch_served_s=... step_own_s=... step_served_s=...
           sync_own_s=... sync_served_s=... generate_own_s=... generate_served_s=...

(means over the children; the min-max spread on the detail lines). The load average is printed at
the start and the end: on a shared machine the seconds are noisy. Results: bench/results/serve.md.
Not a test and not imported by any.
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="", help="the model (default: the tiny model)")
    p.add_argument("--steps", type=int, default=3, help="timed steps of each child after its first batch")
    p.add_argument("--repeats", type=int, default=2, help="children of each kind")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # own|served:URL:OUT_FILE
    return p.parse_args()


FLAGS = ["--train.warm_start_steps=0", "--log.wandb_mode=disabled", "--log.progress=False"]


def child(args):
    import psutil
    import torch

    import policy
    import rollout
    import run
    import sync
    from distributed import Dist, local_tensor
    kind, _, rest = args.child.partition(":")
    url, _, out = rest.rpartition(":") if kind == "served" else ("", "", rest)
    cfg = run.parse_config(FLAGS + ([f"--rollout.engine={url}"] if url else []))
    d = Dist(0, 1, torch.device("cpu"))
    tokenizer = policy.load_tokenizer(args.model_dir)
    train_rows, eval_rows = run.load_data(cfg)
    engine = rollout.start_engine(cfg, args.model_dir, tokenizer, train_rows + eval_rows, d)
    model = policy.load_policy(args.model_dir, cfg, 1, d.device)
    rows = train_rows[:cfg.train.prompts_per_step]
    if url:
        sync.sync_engine(cfg, engine, model, tokenizer, d, version=0)  # as run.restore does for a served engine
    rollout.generate_and_score(engine, tokenizer, rows, cfg, 0, cfg.rollout.n, cfg.rollout.temperature)
    first = time.time() - psutil.Process().create_time()
    steps = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        with torch.no_grad():
            for p in model.parameters():
                local_tensor(p).add_(1e-3 * torch.randn_like(local_tensor(p)))
        metrics = sync.sync_engine(cfg, engine, model, tokenizer, d, version=step)
        t1 = time.perf_counter()
        rows = train_rows[step * cfg.train.prompts_per_step:(step + 1) * cfg.train.prompts_per_step]
        rollout.generate_and_score(engine, tokenizer, rows, cfg, step, cfg.rollout.n, cfg.rollout.temperature)
        steps.append({"step_s": time.perf_counter() - t0, "sync_s": t1 - t0, "generate_s": time.perf_counter() - t1,
                      "probe": metrics["sync/probe_max_abs_diff"]})
    engine.close()
    with open(out, "w") as f:
        json.dump({"kind": kind, "first_batch_s": first, "steps": steps}, f)
    os._exit(0)


def start_server(model_dir: str, log) -> tuple[subprocess.Popen, str, float]:
    import requests

    import served
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv, env = served.serve_command(model_dir, "127.0.0.1", port, "float32", cuda=False, kv_cache_bytes=1 << 30)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env, "HF_HUB_OFFLINE": "1"}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            sys.exit(f"the server ended (exit {proc.returncode}); its log: {log.name}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - t0
        except requests.RequestException:
            pass
        time.sleep(0.5)


def run_child(args, kind: str, url: str) -> dict:
    out = tempfile.mktemp(suffix=".json")
    spec = f"served:{url}:{out}" if kind == "served" else f"own:{out}"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec, "--model-dir", args.model_dir,
                           "--steps", str(args.steps)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"a {kind} child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return result


def mean(values):
    return sum(values) / len(values)


def summary(kind: str, results: list) -> dict:
    steps = [s for r in results for s in r["steps"]]
    firsts = [r["first_batch_s"] for r in results]
    out = {"first_batch": mean(firsts), "step": mean([s["step_s"] for s in steps]),
           "sync": mean([s["sync_s"] for s in steps]), "generate": mean([s["generate_s"] for s in steps])}
    print(f"{kind}: first batch {out['first_batch']:.1f} s ({min(firsts):.1f}-{max(firsts):.1f}); a step "
          f"{out['step']:.2f} s ({min(s['step_s'] for s in steps):.2f}-{max(s['step_s'] for s in steps):.2f}): "
          f"sync {out['sync']:.2f} s, generation {out['generate']:.2f} s; probe diffs up to "
          f"{max(s['probe'] for s in steps):.1e}", flush=True)
    return out


def main():
    args = parse_args()
    if not args.model_dir:
        import tiny_models
        args.model_dir = tiny_models.tiny_model_dir()
    if args.child:
        return child(args)
    print(f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    log = open(tempfile.mktemp(prefix="bench-serve-", suffix=".log"), "w")
    server, url, server_start = start_server(args.model_dir, log)
    print(f"server: up in {server_start:.1f} s at {url}", flush=True)
    results = {"own": [], "served": []}
    try:
        for i in range(args.repeats):
            for kind in ("own", "served"):
                results[kind].append(r := run_child(args, kind, url))
                print(f"{kind} {i}: first batch {r['first_batch_s']:.1f} s; steps "
                      + ", ".join(f"{s['step_s']:.2f} (sync {s['sync_s']:.2f})" for s in r["steps"]) + " s",
                      flush=True)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    own, srv = summary("own", results["own"]), summary("served", results["served"])
    print(f"RESULT server_start_s={server_start:.2f} first_batch_own_s={own['first_batch']:.2f} "
          f"first_batch_served_s={srv['first_batch']:.2f} step_own_s={own['step']:.3f} "
          f"step_served_s={srv['step']:.3f} sync_own_s={own['sync']:.3f} sync_served_s={srv['sync']:.3f} "
          f"generate_own_s={own['generate']:.3f} generate_served_s={srv['generate']:.3f}", flush=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the entry point must be guarded
    main()

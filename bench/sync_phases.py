"""Where a group sync's seconds go: trainer rank 0's phases of `sync.sync_engine`, timed, at two
ranks on the random Qwen2-0.5B-shaped model of bench/scale.py, in this tree and in a baseline's.

    python bench/sync_phases.py                        # this tree and 9d53e47's, 3 syncs each
    python bench/sync_phases.py --runs 2 --syncs 5     # alternated twice: the machine's drift on both

bench/scale.py measures a sync whole; this bench times its parts, by wrapping the functions a sync
calls (where the tree has them) with a clock in trainer rank 0's process, so it needs no change to
the code it measures. Each tree runs under `torchrun --nproc_per_node=2` from its own files (the
baseline extracted with `git archive`), one untimed sync first (it opens the weight group), then
--syncs timed ones, each with new weights. Seconds per sync, rank 0's view:
  total_s          sync.sync_engine, as the loop calls it
  probe_forward_s  the trainer's probe forward (sync.probe_logprobs: FSDP2 unshards every layer)
  pass_s           one pass of the weights to the engine (Engine._transfer_weights, through vLLM's
                   API; 9d53e47: Engine._stream_weights), which includes:
  gather_s         the FSDP2 all-gathers of every tensor (PolicySource._full / WeightStream._full)
  send_s           sdpo_gloo: waiting for each bucket's broadcast to arrive (the order rule: no
                   gather while a send is under way; 9d53e47 sent in a thread meanwhile: nan)
  load_wait_s      sdpo_gloo: waiting for the worker to load the last bucket (Job.result)
  digest_s         rank 0's digests of what it sends (sdpo_transfer.digest)
  engine_score_s   the engine's probe scoring (Engine.score)
Then `RESULT sync_phases tree=... total_s=... ...` per tree (the mean over runs; the per-run
figures on the lines above). Results: bench/results/scale.md. Not a test and not imported by any.
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ["total_s", "probe_forward_s", "pass_s", "gather_s", "send_s", "load_wait_s", "digest_s", "engine_score_s"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if "--child" not in sys.argv:  # a child imports nothing of this tree's: gpu_update would
        from gpu_update import add_model_args
        add_model_args(p, "Qwen2-0.5B", hidden=896, layers=24, heads=14, intermediate=4864)
    p.add_argument("--baseline", default="9d53e47", help="the git revision to time beside this tree")
    p.add_argument("--syncs", type=int, default=3, help="timed syncs per run")
    p.add_argument("--runs", type=int, default=1, help="runs of each tree, alternated")
    p.add_argument("--bucket-mb", type=int, default=512, help="--rollout.sync_bucket_mb")
    p.add_argument("--model-dir", default="", help="the random model's directory (default: bench/scale.py's)")
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)  # TREE OUT: a torchrun child
    return p.parse_args()


def child(args):
    """One rank, in the tree on sys.path: syncs with rank 0's phases timed, written to OUT."""
    import torch
    import torch.distributed as dist

    import distributed
    import policy
    import rollout
    import sync
    from config import Config
    from distributed import local_tensor

    d = distributed.setup_distributed()
    seconds = collections.defaultdict(float)

    def clock(owner, name: str, phase: str):
        if not hasattr(owner, name):
            return
        fn = getattr(owner, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[phase] += time.perf_counter() - t0
        setattr(owner, name, timed)

    cfg = Config()
    cfg.rollout.sync, cfg.rollout.sync_bucket_mb, cfg.rollout.kv_cache_tokens = "group", args.bucket_mb, 4096
    tokenizer = policy.load_tokenizer(args.model_dir)
    engine = rollout.start_engine(cfg, args.model_dir, tokenizer, [], d)
    model = policy.load_policy(args.model_dir, cfg, d.world, d.device)
    norms = [p for p in model.parameters() if p.ndim == 1]
    if d.rank == 0:
        clock(sync, "probe_logprobs", "probe_forward_s")
        for name in ("_transfer_weights", "_stream_weights"):
            clock(type(engine), name, "pass_s")
        clock(type(engine), "score", "engine_score_s")
        for source in ("PolicySource", "WeightStream"):
            clock(getattr(sync, source, None), "_full", "gather_s")
        if hasattr(sync, "transfer_module"):
            transfer = sync.transfer_module()
            clock(transfer.GlooTrainerWeightTransferEngine, "_send", "send_s")
            clock(transfer.Job, "result", "load_wait_s")
            clock(transfer, "digest", "digest_s")
    for version in range(1, args.syncs + 2):
        with torch.no_grad():  # new weights every sync
            for p in norms:
                local_tensor(p).add_(1e-3)
        dist.barrier()
        if version == 2:  # the first sync opened the group: not timed
            seconds.clear()
        t0 = time.perf_counter()
        sync.sync_engine(cfg, engine, model, tokenizer, d, version)
        seconds["total_s"] += time.perf_counter() - t0
    if d.rank == 0:
        with open(args.child[1], "w") as f:
            json.dump({k: v / args.syncs for k, v in seconds.items()}, f)
        engine.close()
    distributed.end_distributed(d)
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown (gloo's threads)


def run_tree(args, tree: str) -> dict:
    import socket
    out = tempfile.mktemp(prefix="sync-phases-", suffix=".json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=tree)  # the engine's processes import the tree's modules too
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           os.path.abspath(__file__), "--child", tree, out, "--model-dir", args.model_dir,
           "--syncs", str(args.syncs), "--bucket-mb", str(args.bucket_mb)]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode or not os.path.exists(out):
        sys.exit(f"{tree} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return result


def main():
    args = parse_args()
    if args.child:
        sys.path.insert(0, args.child[0])
        return child(args)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    sys.path.insert(0, ROOT)
    import scale
    args.model_dir = args.model_dir or scale.write_model(args)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    trees = {f"{head}+worktree": ROOT, args.baseline: scale.baseline_tree(args.baseline)}
    print(f"2 ranks, {args.syncs} timed syncs a run, {args.runs} run(s) of each tree, load average "
          f"{scale.load_average()}", flush=True)
    runs = collections.defaultdict(list)
    for run in range(args.runs):
        for name, tree in trees.items():
            runs[name].append(run_tree(args, tree))
            print(f"run {run + 1} {name}: " + " ".join(f"{k}={runs[name][-1].get(k, float('nan')):.3f}" for k in PHASES),
                  flush=True)
    print(f"load average {scale.load_average()}")
    for name, results in runs.items():
        mean = {k: sum(r.get(k, float("nan")) for r in results) / len(results) for k in PHASES}
        print(f"RESULT sync_phases tree={name} syncs={args.syncs * args.runs} "
              + " ".join(f"{k}={v:.3f}" for k, v in mean.items()))


if __name__ == "__main__":
    main()

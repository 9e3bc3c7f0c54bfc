"""Loading and weight sync at a size where they show: a random Qwen2-0.5B-shaped model on CPU,
one and two trainer ranks under torchrun (gloo), one vLLM-CPU engine in its own process.

    python bench/scale.py                       # Qwen2-0.5B's shape (494M parameters), worlds 1 and 2
    python bench/scale.py --worlds 2 --syncs 5  # two ranks only, five syncs of each path
    python bench/scale.py --tiny                # a seconds-long smoke test of the bench itself
    python bench/scale.py --worlds 2 --baseline 9d53e47  # also the group path as it was at 9d53e47

No download: the model is built from its config (`from_config`, random weights) with the tiny
model's locally trained tokenizer, and saved once as a bfloat16 checkpoint (as released models
are) under the temp dir, so that loading reads a real checkpoint. Then, for each world size, one
`torchrun --nproc_per_node=W` process group runs what `run.py` runs, through the project's own
code: `rollout.start_engine` (a float32 engine, the CPU default, in its own process),
`policy.load_policy` (world 1: the one process reads the checkpoint in float32; world 2: rank 0
reads it, rank 1 builds on the meta device, FSDP2 shards, the weights arrive by broadcast), then
`sync.sync_engine` (the loop's sync and its proof) alternately through vLLM's weight-transfer API
(`--rollout.sync group`: the trainer engines of every rank and the engine's start/update/finish,
here the gloo backend sdpo_transfer's, buckets of --bucket-mb) and through the file (`--rollout.sync
file`), --syncs times each, after one untimed group sync that opens the group. Every sync carries
new weights (the norms' weights and the biases are nudged before each). Last, trainer rank 0 copies
the bytes a sync moves, one bucket at a time (one `copy_` of a bucket-sized buffer, repeated):
the floor. With --baseline REV, each world size runs a second time from REV's tree (extracted
with `git archive` into the temp dir, its own bench/scale.py child): the group path as REV had
it (9d53e47: the home-made weight group, before the vLLM API), with its file path again beside it,
so that a change of the machine's load between the two runs shows in the file path's seconds.

This process samples the resident memory (RSS, /proc/PID/statm) of every rank and every engine
process every 10 ms, and the ranks mark when each phase starts and ends, so:
  load_peak_gb_rankN         rank N's peak RSS while it loads, above its RSS just before (the
                             load's own memory: the imports are not counted)
  sync_peak_extra_gb_trainer trainer rank 0's peak RSS during a sync above its RSS just before
                             (the highest of the syncs of the group path)
  sync_peak_extra_gb_engine  the same for the engine (its processes' RSS summed), group path
  sync_stream_peak_extra_gb_trainer  sync_peak_extra_gb_trainer from the moment the trainer's
                             probe forward is done (the gather, the buckets, the engine's load)
  forward_peak_extra_gb_trainer  trainer rank 0's peak above its RSS just before during the
                             probe's forward alone, outside any sync: FSDP2 all-gathers each
                             unit into a flat buffer and copies it out, so the root unit (here
                             the tied embedding) is whole twice for a moment, in every forward
and their file-path counterparts on the detail lines. Seconds are `sync/seconds` as the run logs
it (gather, transfer, load, prefix-cache reset and the probe's proof on both sides); the mean
over the syncs, with the min-max spread printed. Bytes: `sync/megabytes` (group: the bytes
broadcast; file: the state dict written). Prints a detail line per sync and per world, then

    RESULT params=... world=1 load_peak_gb_rank0=... ...
    RESULT params=... world=2 load_peak_gb_rank0=... load_peak_gb_rank1=... full_fp32_gb=... bucket_gb=...
           sync_vllm_api_s=... sync_group_s=... sync_file_s=... sync_file_baseline_s=... copy_s=...
           sync_peak_extra_gb_trainer=... sync_peak_extra_gb_engine=...

(sync_vllm_api_s: this tree's group path; sync_group_s and sync_file_baseline_s: --baseline's, nan
without it) and the issues' targets checked on the world-2 figures (load_peak_gb_rank1 <= 0.6 x
full_fp32_gb; sync_peak_extra_gb_trainer <= 2 x bucket_gb + 0.05 x full_fp32_gb; sync_vllm_api_s <=
sync_file_s; sync_vllm_api_s <= sync_group_s with --baseline).
The machine's load average is printed at the start and the end: on a shared machine the seconds
are noisy, the memory is not. At its peak (a file sync at two ranks) the bench's processes hold
about 16 GB together: run it on a 24 GiB machine with little else running. Results: bench/results/scale.md; what they say at 8B and 32B:
docs/scale.md. Not a test and not imported by any.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

GB = 1e9
PAGE = os.sysconf("SC_PAGE_SIZE")


def parse_args():
    from gpu_update import add_model_args
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, "Qwen2-0.5B", hidden=896, layers=24, heads=14, intermediate=4864)
    p.add_argument("--worlds", default="1,2", help="trainer ranks of each run, in turn")
    p.add_argument("--syncs", type=int, default=3, help="timed syncs of each path")
    p.add_argument("--bucket-mb", type=int, default=512, help="--rollout.sync_bucket_mb")
    p.add_argument("--model-dir", default="", help="the random model's directory (default: under the temp dir, "
                                                   "built once and reused)")
    p.add_argument("--trace", default="", help="also write every sample and mark of each world here (JSON, "
                                               "one file per world: TRACE.worldN.json)")
    p.add_argument("--baseline", default="", help="also run each world from this git revision's tree (its "
                                                  "group path: sync_group_s)")
    p.add_argument("--tiny", action="store_true", help="a tiny model: a smoke test of the bench")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # the events file of a torchrun child
    args = p.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab = 128, 2, 2, 2, 256, 1024
        args.bucket_mb = 1
    return args


# ----------------------------------------------------------------------------------------
# the model


def write_model(args) -> str:
    """The random model as an HF directory (bfloat16 safetensors, the tiny model's tokenizer),
    built once per shape under the temp dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from transformers.utils import logging as hf_logging

    import tiny_models
    from gpu_update import model_config
    hf_logging.disable_progress_bar()
    tokenizer_dir = tiny_models.tiny_model_dir()  # its BPE, trained locally (cached under $SDPO_CACHE)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = model_config(args)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = eos, eos, pad
    config.head_dim = args.hidden // args.heads
    key = hashlib.sha1((config.to_json_string() + tokenizer_dir).encode()).hexdigest()[:12]
    path = args.model_dir or os.path.join(tempfile.gettempdir(), f"bench-scale-{key}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    t0 = time.perf_counter()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = path + f".tmp{os.getpid()}"
    hf.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=eos).save_pretrained(tmp)
    del hf
    os.replace(tmp, path)
    print(f"model: written to {path} in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


# ----------------------------------------------------------------------------------------
# a torchrun child: one rank


def child(args):
    import torch
    import torch.distributed as dist

    import distributed
    import policy
    import rollout
    import sync
    from config import Config
    from distributed import local_tensor

    d = distributed.setup_distributed()
    events = open(f"{args.child}.rank{d.rank}", "a", buffering=1)

    def mark(what: str, **fields):
        events.write(json.dumps({"t": time.time(), "rank": d.rank, "pid": os.getpid(), "what": what, **fields}) + "\n")

    def barrier():
        if d.world > 1:
            dist.barrier()

    model_dir = args.model_dir
    cfg = Config()
    cfg.rollout.sync_bucket_mb = args.bucket_mb
    cfg.rollout.kv_cache_tokens = 4096  # the engine only scores the probe here
    tokenizer = policy.load_tokenizer(model_dir)
    mark("hello")
    engine = rollout.start_engine(cfg, model_dir, tokenizer, [], d)  # what run.py starts: own process on CPU
    if d.rank == 0:
        mark("engine", pids=sorted(engine.processes), start_s=engine.start_seconds)
    barrier()
    time.sleep(0.5)  # a few samples of each process at rest
    mark("load_start")
    t0 = time.perf_counter()
    model = policy.load_policy(model_dir, cfg, d.world, d.device)
    if d.rank == 0:
        print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    mark("load_end", seconds=time.perf_counter() - t0,
         params=sum(p.numel() for p in model.parameters()),
         local_bytes=sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in model.parameters()))
    barrier()
    norms = [p for p in model.parameters() if p.ndim == 1]

    def one_sync(how: str, version: int, label: str):
        with torch.no_grad():  # new weights every sync: nudge the 1-D ones, norms and biases (every layer moves)
            for p in norms:
                local_tensor(p).add_(1e-3)
        cfg.rollout.sync = how
        barrier()
        time.sleep(0.2)
        mark("sync_start", how=how, label=label)
        metrics = sync.sync_engine(cfg, engine, model, tokenizer, d, version)
        mark("sync_end", how=how, label=label, seconds=metrics["sync/seconds"], megabytes=metrics["sync/megabytes"],
             probe=metrics["sync/probe_max_abs_diff"], reloads=metrics["sync/reloads"])
        if d.rank == 0:
            print(f"sync {version} ({how}): {metrics['sync/seconds']:.1f} s", flush=True)

    if d.rank == 0:  # when the engine's side starts (after the trainer's probe forward), for --trace
        update_weights = engine.update_weights

        def marked(*a, **k):
            mark("engine_update_start")
            return update_weights(*a, **k)
        engine.update_weights = marked
    for _ in range(2):  # the probe's forward alone (a training forward unshards the same way), twice
        barrier()
        time.sleep(0.2)
        mark("forward_start")
        sync.probe_logprobs(model, tokenizer, d)
        mark("forward_end")
    version = 1
    one_sync("group", version, "open")  # the first group sync opens the weight group
    for i in range(args.syncs):
        for how in ("group", "file"):  # alternated: the machine's load falls on both alike
            version += 1
            one_sync(how, version, "timed")
    barrier()
    if d.rank == 0:
        # the floor: the bytes a sync moves, copied once in this process, a bucket at a time
        nbytes = int(sync.PolicySource(model, d, torch.float32).bytes_per_pass)
        chunk = min(nbytes, args.bucket_mb << 20)
        src = torch.ones(chunk, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # pages in
        copies = []
        for _ in range(args.syncs):
            t0, left = time.perf_counter(), nbytes
            while left > 0:
                n = min(chunk, left)
                dst[:n].copy_(src[:n])
                left -= n
            copies.append(time.perf_counter() - t0)
        del src, dst
        mark("copy", seconds=copies, nbytes=nbytes, threads=torch.get_num_threads())
        engine.close()
    mark("done")
    events.close()
    distributed.end_distributed(d)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (gloo's threads; see tests/conftest.exit_now)


# ----------------------------------------------------------------------------------------
# the launcher: runs each world size under torchrun and samples every process's memory


class Sampler:
    """Every 10 ms, the RSS of each descendant of a process (the list refreshed every 0.5 s)."""

    def __init__(self, root_pid: int):
        import psutil
        self.root = psutil.Process(root_pid)
        self.samples = []  # (time, {pid: rss bytes})
        self.stop = threading.Event()
        self.fds = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _refresh(self):
        import psutil
        try:
            pids = {p.pid for p in self.root.children(recursive=True)}
        except psutil.NoSuchProcess:
            pids = set()
        for pid in pids - set(self.fds):
            try:
                self.fds[pid] = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
            except OSError:
                pass

    def _run(self):
        last_refresh = 0.0
        while not self.stop.wait(0.01):
            now = time.time()
            if now - last_refresh > 0.5:
                self._refresh()
                last_refresh = now
            row = {}
            for pid, fd in list(self.fds.items()):
                try:
                    row[pid] = int(os.pread(fd, 128, 0).split()[1]) * PAGE
                except (OSError, IndexError, ValueError):  # ended
                    os.close(fd)
                    del self.fds[pid]
            self.samples.append((now, row))

    def close(self):
        self.stop.set()
        self.thread.join()
        for fd in self.fds.values():
            os.close(fd)

    def series(self, pids) -> list[tuple[float, int]]:
        """(time, summed RSS of pids) at each sample that saw all of them."""
        pids = set(pids)
        return [(t, sum(row[p] for p in pids)) for t, row in self.samples if pids <= row.keys()]


def peak_extra(series, start: float, end: float) -> tuple[float, float, float]:
    """(RSS just before start, peak RSS in [start, end], peak above before), GB."""
    before = [v for t, v in series if t < start]
    # a phase shorter than the sampling interval: the first sample after it
    during = [v for t, v in series if start <= t <= end] or [v for t, v in series if t > end][:1]
    if not before or not during:
        return float("nan"), float("nan"), float("nan")
    return before[-1] / GB, max(during) / GB, (max(during) - before[-1]) / GB


def baseline_tree(rev: str) -> str:
    """The files of git revision rev, extracted under the temp dir (its bench/scale.py is the child)."""
    tree = tempfile.mkdtemp(prefix=f"bench-scale-{rev}-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree


def run_world(args, world: int, model_dir: str, root: str = ROOT) -> dict:
    import socket
    work = tempfile.mkdtemp(prefix="bench-scale-")
    events_base = os.path.join(work, "events")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={port}",
           os.path.join(root, "bench", "scale.py"), "--child", events_base, "--model-dir", model_dir,
           "--syncs", str(args.syncs), "--bucket-mb", str(args.bucket_mb)]
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # run.py's own thread split (processes.cpu_split)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    sampler = Sampler(proc.pid)
    output = []
    for line in iter(proc.stdout.readline, b""):  # the ranks' own lines, as they come
        output.append(line.decode(errors="replace"))
        print(f"  [world {world}] {output[-1]}", end="", flush=True)
    proc.wait()
    sampler.close()
    if proc.returncode:
        sys.exit(f"world {world} failed (exit {proc.returncode}):\n{''.join(output)[-6000:]}")
    events = []
    for rank in range(world):
        with open(f"{events_base}.rank{rank}") as f:
            events += [json.loads(line) for line in f]
    shutil.rmtree(work, ignore_errors=True)
    if args.trace:
        with open(f"{args.trace}.world{world}.json", "w") as f:
            json.dump({"events": events, "samples": sampler.samples}, f)
    return analyse(args, world, events, sampler, time.perf_counter() - t0)


def analyse(args, world: int, events: list, sampler: Sampler, wall_s: float) -> dict:
    def find(what, rank=0, **match):
        return [e for e in events if e["what"] == what and e["rank"] == rank
                and all(e.get(k) == v for k, v in match.items())]

    rank_pid = {r: find("hello", r)[0]["pid"] for r in range(world)}
    engine = find("engine")[0]
    engine_pids = engine["pids"]
    load_end = find("load_end")[0]
    params = load_end["params"]  # FSDP2: a DTensor's numel is the whole tensor's
    out = {"world": world, "params": params, "engine_start_s": engine["start_s"], "wall_s": wall_s,
           "load_s": load_end["seconds"]}
    print(f"[world {world}] engine start {engine['start_s']:.1f} s; load {load_end['seconds']:.1f} s (rank 0); "
          f"rank 0 holds {load_end['local_bytes'] / GB:.2f} GB of float32 weights", flush=True)
    for r in range(world):
        start, end = find("load_start", r)[0]["t"], find("load_end", r)[0]["t"]
        before, peak, extra = peak_extra(sampler.series([rank_pid[r]]), start, end)
        out[f"load_peak_gb_rank{r}"] = extra
        print(f"[world {world}] load, rank {r}: RSS {before:.2f} GB before, peak {peak:.2f} GB: +{extra:.2f} GB",
              flush=True)
    trainer, engine_series = sampler.series([rank_pid[0]]), sampler.series(engine_pids)
    forwards = [peak_extra(trainer, s["t"], e["t"])[2] for s, e in zip(find("forward_start"), find("forward_end"))]
    out["forward_extra_trainer"] = max(forwards)
    print(f"[world {world}] the probe's forward alone: trainer rank 0 "
          + ", ".join(f"+{x:.2f}" for x in forwards) + " GB", flush=True)
    updates = [e["t"] for e in find("engine_update_start")]
    for how in ("group", "file"):
        rows = []
        for s, e in zip(find("sync_start", how=how, label="timed"), find("sync_end", how=how, label="timed")):
            _, _, t_extra = peak_extra(trainer, s["t"], e["t"])
            _, _, e_extra = peak_extra(engine_series, s["t"], e["t"])
            # from the moment the engine's side starts (the trainer's probe forward done) to the end
            stream_start = next(t for t in updates if s["t"] <= t <= e["t"])
            _, _, stream_extra = peak_extra(trainer, stream_start, e["t"])
            rows.append((e["seconds"], e["megabytes"], t_extra, e_extra, e["probe"], e["reloads"], stream_extra))
            print(f"[world {world}] sync {how}: {e['seconds']:.2f} s, {e['megabytes']:.0f} MB, trainer rank 0 "
                  f"+{t_extra:.2f} GB (+{stream_extra:.2f} after its probe forward), engine +{e_extra:.2f} GB, "
                  f"probe diff {e['probe']:.1e}, reloads {e['reloads']}", flush=True)
        seconds = [r[0] for r in rows]
        out[f"sync_{how}_s"] = sum(seconds) / len(seconds)
        out[f"sync_{how}_spread"] = (min(seconds), max(seconds))
        out[f"sync_{how}_mb"] = rows[0][1]
        out[f"sync_{how}_extra_trainer"] = max(r[2] for r in rows)
        out[f"sync_{how}_extra_engine"] = max(r[3] for r in rows)
        out[f"sync_{how}_stream_extra_trainer"] = max(r[6] for r in rows)
    opened = find("sync_end", how="group", label="open")[0]
    out["group_open_s"] = opened["seconds"]
    copy = find("copy")[0]
    out["copy_s"] = sum(copy["seconds"]) / len(copy["seconds"])
    out["copy_spread"] = (min(copy["seconds"]), max(copy["seconds"]))
    print(f"[world {world}] first group sync (opens the group) {opened['seconds']:.2f} s; copy of "
          f"{copy['nbytes'] / GB:.2f} GB ({copy['threads']} thread(s)): "
          + ", ".join(f"{s:.2f}" for s in copy["seconds"]) + " s", flush=True)
    for how in ("group", "file"):
        lo, hi = out[f"sync_{how}_spread"]
        print(f"[world {world}] {how}: mean {out[f'sync_{how}_s']:.2f} s ({lo:.2f}-{hi:.2f}), "
              f"{out[f'sync_{how}_mb']:.0f} MB, {out[f'sync_{how}_mb'] / 1e3 / out[f'sync_{how}_s']:.2f} GB/s; "
              f"peak extra: trainer rank 0 +{out[f'sync_{how}_extra_trainer']:.2f} GB, engine "
              f"+{out[f'sync_{how}_extra_engine']:.2f} GB", flush=True)
    return out


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main():
    args = parse_args()
    if args.child:
        return child(args)
    import torch
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load_average()}", flush=True)
    model_dir = write_model(args)
    tree = baseline_tree(args.baseline) if args.baseline else None
    results, baselines = {}, {}
    for world in (int(w) for w in args.worlds.split(",")):
        results[world] = r = run_world(args, world, model_dir)
        print(f"[world {world}] took {r['wall_s']:.0f} s; load average {load_average()}", flush=True)
        if tree:  # REV's group path right after: the same machine, the load as close as it gets
            print(f"[world {world}] again from {args.baseline}'s tree", flush=True)
            baselines[world] = b = run_world(args, world, model_dir, root=tree)
            print(f"[world {world}, {args.baseline}] took {b['wall_s']:.0f} s; load average {load_average()}",
                  flush=True)
    if tree:
        shutil.rmtree(tree, ignore_errors=True)
    report(args, results, baselines)
    print(f"total {time.perf_counter() - t0:.0f} s; load average {load_average()}", flush=True)


def report(args, results: dict, baselines: dict):
    """The RESULT line of each world, and the targets on the world-2 figures."""
    full_fp32_gb = next(iter(results.values()))["params"] * 4 / GB
    bucket_gb = (args.bucket_mb << 20) / GB
    nan = float("nan")
    for world, r in results.items():
        b = baselines.get(world, {})
        loads = " ".join(f"load_peak_gb_rank{k}={r[f'load_peak_gb_rank{k}']:.3f}" for k in range(world))
        print(f"RESULT params={r['params']} world={world} {loads} full_fp32_gb={full_fp32_gb:.3f} "
              f"bucket_gb={bucket_gb:.3f} sync_vllm_api_s={r['sync_group_s']:.3f} "
              f"sync_group_s={b.get('sync_group_s', nan):.3f} sync_file_s={r['sync_file_s']:.3f} "
              f"sync_file_baseline_s={b.get('sync_file_s', nan):.3f} copy_s={r['copy_s']:.3f} "
              f"sync_peak_extra_gb_trainer={r['sync_group_extra_trainer']:.3f} "
              f"sync_peak_extra_gb_engine={r['sync_group_extra_engine']:.3f} "
              f"sync_stream_peak_extra_gb_trainer={r['sync_group_stream_extra_trainer']:.3f} "
              f"forward_peak_extra_gb_trainer={r['forward_extra_trainer']:.3f}", flush=True)
    if 2 not in results:
        return
    r, b = results[2], baselines.get(2)
    checks = [
        ("params >= 4e8", r["params"] >= 4e8),
        (f"load_peak_gb_rank1 {r['load_peak_gb_rank1']:.3f} <= 0.6 x full_fp32_gb {0.6 * full_fp32_gb:.3f}",
         r["load_peak_gb_rank1"] <= 0.6 * full_fp32_gb),
        (f"sync_peak_extra_gb_trainer {r['sync_group_extra_trainer']:.3f} <= 2 x bucket_gb + 0.05 x full_fp32_gb "
         f"{2 * bucket_gb + 0.05 * full_fp32_gb:.3f}",
         r["sync_group_extra_trainer"] <= 2 * bucket_gb + 0.05 * full_fp32_gb),
        (f"sync_vllm_api_s {r['sync_group_s']:.3f} <= sync_file_s {r['sync_file_s']:.3f}",
         r["sync_group_s"] <= r["sync_file_s"]),
    ]
    if b:
        checks.append((f"sync_vllm_api_s {r['sync_group_s']:.3f} <= sync_group_s {b['sync_group_s']:.3f} "
                       f"({args.baseline}; its file path {b['sync_file_s']:.3f} against this run's "
                       f"{r['sync_file_s']:.3f}: the load's drift)", r["sync_group_s"] <= b["sync_group_s"]))
    for what, ok in checks:
        print(f"target: {what}: {'met' if ok else 'NOT met'}", flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the entry point must be guarded
    main()

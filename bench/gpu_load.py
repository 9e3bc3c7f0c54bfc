"""Loading a multi-billion-parameter checkpoint, and the sync's trainer side, on one GPU.

    torchrun --nproc_per_node 1 bench/gpu_load.py                # Qwen2.5-1.5B shape, random bf16 weights
    torchrun --nproc_per_node 1 bench/gpu_load.py --hidden 3584 --layers 28 --heads 28 --kv-heads 4 \
        --intermediate 18944                                     # Qwen2.5-7B shape
    torchrun --nproc_per_node 1 bench/gpu_load.py --tiny         # seconds-long smoke test (CPU: gloo)

No engine (no vLLM) and no download: a Qwen2-shaped model with random weights is written once,
in bfloat16 as real checkpoints are, to a temporary HF directory. Then, each in turn, on a
one-rank FSDP2 mesh (sharded as each of N ranks is, as bench/gpu_update.py does):

  whole        every rank reads the whole checkpoint in float32 on the CPU, moves it to the
               GPU, then shards it (how policy.load_policy loaded before);
  broadcast    policy.load_policy's path under torchrun: rank 0 reads the checkpoint in its own
               dtype, the model is built on the meta device, sharded, its float32 shards
               allocated, and the weights broadcast into them one tensor at a time;
  copy         policy.copy_policy: the SDPO teacher / DPO reference from the policy's shards.

For each: seconds, the process's peak host memory above its start (RSS sampled every 5 ms), and
the GPU's peak allocated memory above its start and what stays allocated after. The broadcast
model's weights must equal the whole model's to the bit.

Then the sync's trainer side: every parameter gathered whole (full_tensor, a collective), cast
to bfloat16 and packed into buckets of --bucket-mb on the GPU (what a sync streams to the
engine), in GB/s of bf16 bytes, against one device-to-device copy of the same bytes.

    RESULT device=... params=... whole_s=... broadcast_s=... whole_host_peak_gb=...
           broadcast_host_peak_gb=... whole_device_peak_gb=... broadcast_device_peak_gb=...
           copy_s=... pack_gb_per_s=... d2d_gb_per_s=...

At world size 1 a rank's shards are the whole model: the device figures are those of 1 of 1
ranks; docs/scale.md projects them to N ranks. Not a test and not imported by any.
"""
import argparse
import gc
import os
import sys
import tempfile
import threading
import time
import types

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
try:  # config.py names tyro in one annotation; a machine without it can still load models
    import tyro  # noqa: F401
except ImportError:
    sys.modules["tyro"] = types.SimpleNamespace(conf=types.SimpleNamespace(arg=lambda **kwargs: None))
import policy  # noqa: E402
from config import Config  # noqa: E402
from gpu_update import add_model_args, model_config  # noqa: E402
from distributed import BACKENDS, full_tensor  # noqa: E402

GB = 1e9


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, "Qwen2.5-1.5B", hidden=1536, layers=28, heads=12, intermediate=8960)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="timed packs and copies")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab = 64, 2, 4, 2, 128, 512
        args.bucket_mb = 1
    return args


class PeakRSS:
    """The process's peak resident memory above its value at the start, sampled every 5 ms."""

    def __enter__(self):
        import psutil
        self.process, self.stop = psutil.Process(), threading.Event()
        self.start = self.peak = self.process.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.extra_gb = (max(self.peak, self.process.memory_info().rss) - self.start) / GB


def measured(build, device) -> tuple:
    """(what build() returns, seconds, host peak GB, device peak GB, device GB kept), each above the start."""
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        out = build()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - before) / GB if cuda else float("nan")
    kept = (torch.cuda.memory_allocated() - before) / GB if cuda else float("nan")
    return out, seconds, rss.extra_gb, peak, kept


def write_model(args) -> str:
    """A random-weight Qwen2 model as an HF directory, bfloat16 as real checkpoints are."""
    from transformers import AutoModelForCausalLM
    config = model_config(args)
    path = tempfile.mkdtemp(prefix="bench-gpu-load-")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # seconds on a GPU, not minutes of CPU
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf.save_pretrained(path)
    params = sum(p.numel() for p in hf.parameters())
    del hf
    return path, params


@torch.no_grad()
def pack_seconds(model, bucket_bytes: int, device) -> tuple[float, int]:
    """Every parameter gathered whole, cast to bf16 and packed into a reused bucket on the
    device: (seconds, bf16 bytes packed)."""
    bucket = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0, used, total = time.perf_counter(), 0, 0
    for p in model.parameters():
        whole = full_tensor(p.detach()).to(torch.bfloat16).reshape(-1).view(torch.uint8)
        if used + whole.numel() > bucket_bytes:
            used = 0  # the bucket is sent here; a tensor larger than a bucket travels alone
        if whole.numel() <= bucket_bytes:
            bucket[used:used + whole.numel()].copy_(whole)
            used += whole.numel()
        total += whole.numel()
    sync()
    return time.perf_counter() - t0, total


def copy_seconds(nbytes: int, device) -> float:
    """One device-to-device copy of nbytes: the floor for moving them."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    dst.copy_(src)
    sync()
    return time.perf_counter() - t0


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc_per_node 1 bench/gpu_load.py")
    dist.init_process_group(BACKENDS[device.type])  # run.py's group: host values through gloo, GPU tensors NCCL
    if dist.get_world_size() != 1:
        raise SystemExit("one rank: at world 1 a rank holds the whole model, and the figures are 1 of 1 ranks'")
    shard = policy.shard  # shards only when world > 1: shard the one-rank mesh as each of N ranks would
    policy.shard = lambda model, world, device: shard(model, max(world, 2), device)
    model_dir, params = write_model(args)
    cfg = Config()
    name = torch.cuda.get_device_name(device).replace(" ", "_") if cuda else "cpu"
    print(f"device={name} torch={torch.__version__} params={params / 1e6:.0f}M checkpoint bf16 "
          f"{params * 2 / GB:.2f} GB, float32 {params * 4 / GB:.2f} GB", flush=True)

    whole, whole_s, whole_host, whole_peak, whole_kept = measured(
        lambda: policy.load_policy(model_dir, cfg, 1, device, from_rank0=False), device)
    reference = {n: full_tensor(p).detach().cpu() for n, p in whole.named_parameters()}
    del whole
    print(f"whole:     {whole_s:6.1f} s, host peak +{whole_host:.2f} GB, device peak +{whole_peak:.2f} GB, "
          f"kept {whole_kept:.2f} GB", flush=True)
    loaded, broadcast_s, broadcast_host, broadcast_peak, broadcast_kept = measured(
        lambda: policy.load_policy(model_dir, cfg, 1, device, from_rank0=True), device)
    print(f"broadcast: {broadcast_s:6.1f} s, host peak +{broadcast_host:.2f} GB, device peak "
          f"+{broadcast_peak:.2f} GB, kept {broadcast_kept:.2f} GB", flush=True)
    equal = all(torch.equal(full_tensor(p).detach().cpu(), reference[n]) for n, p in loaded.named_parameters())
    print(f"broadcast weights equal to the whole model's: {equal}", flush=True)
    del reference
    copy, copy_s, copy_host, copy_peak, copy_kept = measured(
        lambda: policy.copy_policy(loaded, model_dir, cfg, 1, device), device)
    print(f"copy:      {copy_s:6.1f} s, host peak +{copy_host:.2f} GB, device peak +{copy_peak:.2f} GB, "
          f"kept {copy_kept:.2f} GB", flush=True)
    del copy
    packs = [pack_seconds(loaded, args.bucket_mb << 20, device) for _ in range(args.repeats + 1)][1:]
    nbytes = packs[0][1]
    copies = [copy_seconds(nbytes, device) for _ in range(args.repeats)]
    pack_rates = sorted(nbytes / s / GB for s, _ in packs)
    copy_rates = sorted(nbytes / s / GB for s in copies)
    print(f"sync trainer side: gather + cast to bf16 + pack {nbytes / GB:.2f} GB into {args.bucket_mb} MB buckets: "
          f"{[round(r, 1) for r in pack_rates]} GB/s; one device-to-device copy of the same bytes: "
          f"{[round(r, 1) for r in copy_rates]} GB/s", flush=True)
    median = lambda xs: xs[len(xs) // 2]
    print("RESULT " + " ".join([
        f"device={name}", f"params={params:.3g}", f"weights_equal={int(equal)}",
        f"whole_s={whole_s:.1f}", f"broadcast_s={broadcast_s:.1f}",
        f"whole_host_peak_gb={whole_host:.2f}", f"broadcast_host_peak_gb={broadcast_host:.2f}",
        f"whole_device_peak_gb={whole_peak:.2f}", f"broadcast_device_peak_gb={broadcast_peak:.2f}",
        f"copy_s={copy_s:.2f}", f"copy_device_peak_gb={copy_peak:.2f}",
        f"pack_gb_per_s={median(pack_rates):.1f}", f"d2d_gb_per_s={median(copy_rates):.1f}"]), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""
Benchmark: forward + backward of the top-K SDPO loss, or of the policy-gradient head
(--objective logprob: GRPO/GSPO/DPO/SFT's token log-probs), materialised logits vs chunked.

    python bench/losses.py                       # CPU, float32, 2,048 tokens (defaults)
    python bench/losses.py --device cuda --tokens 16384 --dtype bfloat16
    python bench/losses.py --objective logprob   # the head of every other objective

Paths (each run in a fresh subprocess, `--repeats` times, median reported):
  plain     student logits = hidden @ W.T and teacher logits likewise as [N, V] tensors,
            topk_with_tail + sdpo_divergence, sum, backward (bf16 logits are upcast to
            float32 first, as a careful trainer would).
  chunked   sdpo_topk_loss_from_hidden(...) per-token losses, sum, backward (the
            general path: backward re-runs the student head, in vocab blocks).
  weighted  sdpo_topk_loss_from_hidden(..., token_weights=ones), backward (gradients
            computed during forward; no recomputation).
With --objective logprob (paths plain and chunked): plain is microbatch.logprob_head at
--train.head_chunk_size=0 (float32 [N, V] logits, token_logprobs, entropy of the detached
logits), chunked is token_logprobs_from_hidden; either's log-probs times fixed random
advantages, summed, backward.
Memory: on CPU, the child's peak resident set (getrusage ru_maxrss) minus the same
counter read right after the inputs (hidden states, both [V, H] heads) were allocated
and touched, so it is the extra memory of one forward+backward step, gradients (incl.
the [V, H] weight gradient) and temporaries included. On CUDA, max_memory_allocated
minus memory_allocated after the inputs. Time: wall clock of the one step (after a tiny
warm-up that loads the kernels), cuda-synchronised on GPU; the CPU seconds (user + sys)
of the same step are printed too, as they are less disturbed by other processes.
The last line is `RESULT mem_ratio=... time_ratio=...` for chunked / plain.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from chunked_head import sdpo_topk_loss_from_hidden, token_logprobs_from_hidden  # noqa: E402
from losses import (entropy_from_logits, sdpo_divergence,  # noqa: E402
                    token_logprobs, topk_with_tail)

PATHS = ("plain", "chunked", "weighted")


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make_inputs(args, device, dtype, tokens):
    g = torch.Generator(device="cpu").manual_seed(0)
    vocab, hidden = args.vocab, args.hidden
    # generated on CPU and moved, so that both devices see the same numbers
    student_hidden = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_(True)
    teacher_hidden = student_hidden.detach().float().cpu() + 0.1 * torch.randn(tokens, hidden, generator=g)
    teacher_hidden = teacher_hidden.to(device, dtype)
    weight = torch.randn(vocab, hidden, generator=g).mul_(0.02)
    teacher_weight = torch.randn(vocab, hidden, generator=g).mul_(0.002).add_(weight)  # an EMA-like teacher head
    weight = weight.to(device, dtype).requires_grad_(True)
    teacher_weight = teacher_weight.to(device, dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    advantages = torch.randn(tokens, generator=g).to(device)
    return student_hidden, weight, teacher_hidden, teacher_weight, targets, advantages


def step(path, inputs, args):
    student_hidden, weight, teacher_hidden, teacher_weight, targets, advantages = inputs
    if args.objective == "logprob":
        if path == "plain":
            logits = (student_hidden @ weight.T).float()
            logprobs = token_logprobs(logits, targets, args.temperature)
            entropy_from_logits(logits.detach(), args.temperature)
        else:
            logprobs, _ = token_logprobs_from_hidden(student_hidden, weight, targets, args.temperature,
                                                     args.chunk_size)
        loss = (logprobs * advantages).sum()
    elif path == "plain":
        student_logits = student_hidden @ weight.T
        with torch.no_grad():
            teacher_logits = teacher_hidden @ teacher_weight.T
        if student_logits.dtype not in (torch.float32, torch.float64):
            student_logits, teacher_logits = student_logits.float(), teacher_logits.float()
        student_support, teacher_support, _ = topk_with_tail(
            student_logits, teacher_logits, args.k, add_tail=True, temperature=args.temperature
        )
        loss = sdpo_divergence(student_support, teacher_support, args.alpha).sum()
    else:
        weights = None
        if path == "weighted":
            weights = torch.ones(student_hidden.shape[0], device=student_hidden.device)
        loss = sdpo_topk_loss_from_hidden(
            student_hidden, weight, teacher_hidden, teacher_weight, k=args.k, alpha=args.alpha, add_tail=True,
            temperature=args.temperature, chunk_size=args.chunk_size, token_weights=weights,
        )
        loss = loss.sum()
    loss.backward()
    return loss.item()


def child(args):
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    warm = make_inputs(argparse.Namespace(**{**vars(args), "vocab": 1024}), device, dtype, 8)
    step(args.child, warm, argparse.Namespace(**{**vars(args), "chunk_size": 4}))
    del warm
    inputs = make_inputs(args, device, dtype, args.tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        baseline = peak_rss_bytes()
    cpu_start, start = cpu_seconds(), time.perf_counter()
    loss = step(args.child, inputs, args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else peak_rss_bytes()
    print(json.dumps({"path": args.child, "seconds": seconds, "cpu_seconds": cpu, "extra_bytes": peak - baseline,
                      "baseline_bytes": baseline, "loss": loss}))


def run_child(path, args):
    forwarded = []
    for name in ("objective", "device", "dtype", "tokens", "vocab", "hidden", "k", "alpha", "temperature",
                 "chunk_size"):
        forwarded += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", path] + forwarded
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objective", choices=("sdpo", "logprob"), default="sdpo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--chunk-size", type=int, default=None, help="rows per chunk (default 512 CPU, 4096 CUDA)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of " + ",".join(PATHS))
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.chunk_size is None:  # GPUs want big chunks: per-chunk launch overhead, not memory, dominates there
        args.chunk_size = 4096 if args.device.startswith("cuda") else 512
    if args.child:
        return child(args)

    paths = args.paths.split(",")
    if args.objective == "logprob":
        paths = [p for p in paths if p != "weighted"]  # no weighted mode: the caller's weights are the advantages
    assert "plain" in paths and "chunked" in paths, "the RESULT line compares chunked with plain"
    print(f"objective={args.objective} device={args.device} dtype={args.dtype} tokens={args.tokens} "
          f"vocab={args.vocab} hidden={args.hidden} k={args.k} alpha={args.alpha} chunk_size={args.chunk_size} "
          f"repeats={args.repeats} threads={torch.get_num_threads()}")
    runs = {path: [] for path in paths}
    for _ in range(args.repeats):  # interleaved, so that machine load drifts hit every path alike
        for path in paths:
            runs[path].append(run_child(path, args))
    medians = {path: {key: statistics.median(r[key] for r in rs) for key in ("seconds", "cpu_seconds", "extra_bytes")}
               for path, rs in runs.items()}
    losses_seen = {path: rs[0]["loss"] for path, rs in runs.items()}
    plain = medians["plain"]

    def ratio(path, key):  # tiny runs may not raise the RSS high-water mark at all
        return medians[path][key] / plain[key] if plain[key] else float("nan")

    print(f"{'path':<10} {'extra memory (MiB)':>19} {'time (s)':>9} {'cpu (s)':>8} {'mem ratio':>10} "
          f"{'time ratio':>11} {'cpu ratio':>10} {'loss':>14}")
    for path in paths:
        m = medians[path]
        print(f"{path:<10} {m['extra_bytes'] / 2**20:>19.0f} {m['seconds']:>9.2f} {m['cpu_seconds']:>8.2f} "
              f"{ratio(path, 'extra_bytes'):>10.3f} {ratio(path, 'seconds'):>11.3f} "
              f"{ratio(path, 'cpu_seconds'):>10.3f} {losses_seen[path]:>14.6f}")
    for path, rs in runs.items():
        print(f"{path} runs: " + ", ".join(f"{r['seconds']:.2f}s/{r['extra_bytes'] / 2**20:.0f}MiB" for r in rs))
    print(f"load average after: {os.getloadavg()[0]:.1f} (other processes on the machine skew wall time)")
    print(f"RESULT mem_ratio={ratio('chunked', 'extra_bytes'):.3f} time_ratio={ratio('chunked', 'seconds'):.3f} "
          f"objective={args.objective}")


if __name__ == "__main__":
    main()

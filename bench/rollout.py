"""
Benchmark: the vLLM rollout engine on the tiny model (CPU by default): generation speed,
weight-sync time in-process and in its own process, and the probe tolerance a bfloat16
engine needs.

    python bench/rollout.py                                   # defaults below, ~4 minutes on 2 cores
    python bench/rollout.py --prompts 64 --n 8 --max-tokens 128 --syncs 10

Each measurement runs in a fresh subprocess of this script (an in-process engine sets up
global state: torch.distributed, thread settings, environment variables):
  inprocess  float32 engine with its core in this process (the default on one CPU process).
             gen: --prompts task prompts x --n samples, --max-tokens, temperature 1, after a
             small warm-up call; tok/s = generated tokens / wall seconds of one call, the
             median of --gen-repeats calls (seeds 0, 1, ...; all are printed).
             sync: one untimed sync, then --syncs syncs of the full HF state dict (lm_head
             included), the weights perturbed (Gaussian noise) before each; sync seconds =
             Engine.update_weights' own clock: key check, load, prefix-cache reset and the
             probe scoring that proves the sync.
  inprocess-omp1  the same with OMP_NUM_THREADS=1 in the child's environment. On CPU an
             in-process engine binds its OpenMP threads and then cannot lower torch's thread
             count ("doesn't allow to use torch.set_num_threads after the thread binding"), and
             with 2 threads on 2 cores it runs several times slower and erratically; the
             own-process engine sets its own threads. Compare the two lines.
  own        the same with the engine core in its own process (the torchrun / separate-GPU
             path: the state dict goes through a safetensors file in /dev/shm). In the same
             child, the time of writing that state dict once to /dev/shm with safetensors
             (median of 5 writes) is measured, for the ratio sync time / shm write time.
  bf16       a bfloat16 engine (in-process) against the float32 trainer: probe max-abs-diff
             (nats) after syncing the fresh tiny model, a copy trained by SFT on the tasks'
             reference answers (peaked distributions, as after the warm start), and copies with
             Gaussian noise of sigma 0.05 .. 0.3 added to every weight (three seeds each; the
             init std is 0.02, so 0.1 and up is a heavy perturbation); also the max-abs-diff over
             every token of 16 task sequences, to show how representative the probe is.
             (Run with OMP_NUM_THREADS=1: these are numbers, not timings.)
  at size   (--at-size, on by default) the in-process and own-process syncs again for a model
             of >= 100M parameters: a random Qwen2 of AT_SIZE's shape (~113M, 438 MB float32)
             with the tiny tokenizer, built locally and cached, or --at-size-model DIR (e.g.
             SmolLM2-135M-Instruct); seconds, MB/s and the own-process sync over one /dev/shm
             write, on a second RESULT line.
The first RESULT line is `RESULT gen_tok_s=... sync_s_inprocess=... sync_s_own_process=... sync_over_shm_write=...`
(gen_tok_s and sync_s_inprocess: the in-process engine in the environment the bench was started in).
"""

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODES = ("inprocess", "inprocess-omp1", "own", "bf16")
CHILD_ENV = {"inprocess-omp1": {"OMP_NUM_THREADS": "1"}, "bf16": {"OMP_NUM_THREADS": "1"}}
SIGMAS = (0.05, 0.1, 0.2, 0.3)  # noise added to every weight of the tiny model (its init std is 0.02)


def state_of(model):
    """The full HF-named state dict a sync sends, as sync.full_state_dict builds it on one rank."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def perturb_(model, seed, sigma):
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * sigma)
    return model


def task_prompts(tokenizer, count):
    import data
    rows = data.task_rows("arith", "test", (count + 1) // 2) + data.task_rows("strops", "test", count // 2)
    return [data.chat_prompt_ids(tokenizer, r["messages"]) for r in rows]


def task_sequences(tokenizer, count):
    import data
    rows = data.task_rows("arith", "test", count // 2) + data.task_rows("strops", "test", count - count // 2)
    return [data.chat_prompt_ids(tokenizer, r["messages"])
            + tokenizer(r["reference"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for r in rows]


def shm_write_seconds(state, repeats=5):
    """Writing the state dict once to /dev/shm with safetensors, as Engine._write_sync_file does."""
    from safetensors.torch import save_file
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    times = []
    with tempfile.TemporaryDirectory(prefix="bench-shm-", dir=base) as d:
        for _ in range(repeats):
            t0 = time.perf_counter()
            tensors, seen = {}, set()
            for name, tensor in state.items():
                tensor = tensor.detach().to("cpu").contiguous()
                if tensor.data_ptr() in seen:
                    tensor = tensor.clone()
                seen.add(tensor.data_ptr())
                tensors[name] = tensor
            save_file(tensors, os.path.join(d, "model.safetensors"))
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sft(model, tokenizer, steps, lr, batch=32, seed=0):
    """A short SFT on the synthetic tasks' reference answers (loss on the answer tokens)."""
    import data
    import packing
    import random
    import torch
    rows = data.task_rows("arith", "train", 256) + data.task_rows("strops", "train", 256)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = None
    for _ in range(steps):
        seqs, lens = [], []
        for r in rng.sample(rows, batch):
            answer = tokenizer(r["reference"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
            seqs.append(data.chat_prompt_ids(tokenizer, r["messages"]) + answer)
            lens.append(len(answer))
        ids, mask, hidden_index, targets, _ = packing.pack_responses(seqs, lens, tokenizer.pad_token_id)
        logits = model(input_ids=ids, attention_mask=mask).logits.flatten(0, 1)[hidden_index]
        loss = torch.nn.functional.cross_entropy(logits, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    return float(loss)


def child(mode, args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import rollout
    import sync
    import tiny_models

    model_dir = args.model or tiny_models.tiny_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    probe = sync.probe_ids(tokenizer)
    dtype = "bfloat16" if mode == "bf16" else "float32"
    engine = rollout.Engine(model_dir, dtype=dtype, own_process=(mode == "own"),
                            kv_cache_tokens=args.kv_tokens, max_model_len=2048)
    out = {"mode": mode, "engine_start_s": engine.start_seconds}

    if mode == "bf16":
        seqs = task_sequences(tokenizer, 16)

        def measure(model):
            result = engine.update_weights(state_of(model), probe, rollout.probe_logprobs(model, probe), float("inf"))
            scores = engine.score(seqs)
            worst = max((torch.tensor(s) - rollout.probe_logprobs(model, q)).abs().max().item()
                        for s, q in zip(scores, seqs))
            return {"probe": result.probe_max_abs_diff, "all_tokens": worst}

        out["fresh"] = measure(hf)
        for sigma in SIGMAS:
            runs = [measure(perturb_(copy.deepcopy(hf), seed, sigma)) for seed in range(3)]
            out[f"noise{sigma}"] = {k: max(r[k] for r in runs) for k in runs[0]}
        trained = copy.deepcopy(hf)
        out["sft_loss"] = sft(trained, tokenizer, args.sft_steps, lr=2e-3)
        out["sft"] = measure(trained)
        print("CHILD " + json.dumps(out), flush=True)
        engine.close()
        return

    prompts = task_prompts(tokenizer, args.prompts)
    if args.gen_repeats:
        engine.generate(prompts[:4], n=2, temperature=1.0, max_tokens=8, seed=12345)  # warm-up
    rates = []
    for rep in range(args.gen_repeats):
        t0 = time.perf_counter()
        samples = engine.generate(prompts, n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=rep)
        seconds = time.perf_counter() - t0
        tokens = sum(len(s.response_ids) for group in samples for s in group)
        rates.append((tokens / seconds, tokens, seconds))
    rate, tokens, seconds = sorted(rates)[len(rates) // 2] if rates else (float("nan"), 0, float("nan"))
    out.update(gen_seconds=seconds, gen_tokens=tokens, gen_tok_s=rate, gen_tok_s_all=[r[0] for r in rates],
               prompt_tokens=sum(len(p) for p in prompts) * args.n)

    engine.update_weights(state_of(hf), probe, rollout.probe_logprobs(hf, probe), 1e-3)  # warm-up sync
    times, diffs = [], []
    for k in range(args.syncs):
        perturb_(hf, seed=100 + k, sigma=0.01)
        result = engine.update_weights(state_of(hf), probe, rollout.probe_logprobs(hf, probe), 1e-3)
        times.append(result.seconds)
        diffs.append(result.probe_max_abs_diff)
    out.update(sync_s=statistics.mean(times), sync_s_all=times, probe_diff_max=max(diffs))
    if mode == "own":
        out["shm_write_s"] = shm_write_seconds(state_of(hf))
    out["state_mb"] = sum(v.numel() * v.element_size() for v in state_of(hf).values()) / 2 ** 20
    out["params_m"] = sum(p.numel() for p in hf.parameters()) / 1e6
    print("CHILD " + json.dumps(out), flush=True)
    engine.close()


def run_child(mode, args, model="", gen_repeats=None, syncs=None, kv_tokens=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--prompts", str(args.prompts), "--n", str(args.n),
           "--max-tokens", str(args.max_tokens), "--syncs", str(syncs or args.syncs),
           "--gen-repeats", str(args.gen_repeats if gen_repeats is None else gen_repeats),
           "--kv_tokens", str(kv_tokens or args.kv_tokens), "--sft-steps", str(args.sft_steps)]
    model = model or args.model
    cmd += ["--model", model] if model else []
    env = {**os.environ, **CHILD_ENV.get(mode, {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILD ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"child {mode} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len("CHILD "):])


AT_SIZE = dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072)  # ~113M parameters


def at_size(args):
    """Weight sync of a model of real size (>= 100M parameters): a random Qwen2 of AT_SIZE's
    shape with the tiny model's tokenizer, built locally and cached, or --at-size-model."""
    import tiny_models
    model = args.at_size_model or tiny_models.tiny_model_dir(tiny_models.TinyModelConfig(**AT_SIZE))
    res = {}
    for mode in ("inprocess", "own"):
        res[mode] = r = run_child(mode, args, model=model, gen_repeats=0, syncs=args.at_size_syncs, kv_tokens=4096)  # syncs only: a small cache
        mb_s = r["state_mb"] / r["sync_s"]
        print(f"[at size {r['params_m']:.0f}M, {mode}] sync of {r['state_mb']:.0f} MB float32: mean {r['sync_s']:.3f} s "
              f"({', '.join(f'{t:.3f}' for t in r['sync_s_all'])}) = {mb_s:.0f} MB/s; probe diff max "
              f"{r['probe_diff_max']:.2e}" + (f"; /dev/shm write {r['shm_write_s']:.3f} s, sync / write = "
                                             f"{r['sync_s'] / r['shm_write_s']:.2f}" if mode == "own" else ""), flush=True)
    own = res["own"]
    print(f"RESULT at_size params_m={own['params_m']:.0f} state_mb={own['state_mb']:.0f} "
          f"sync_s_inprocess={res['inprocess']['sync_s']:.3f} sync_s_own_process={own['sync_s']:.3f} "
          f"sync_mb_s_own_process={own['state_mb'] / own['sync_s']:.0f} "
          f"sync_over_shm_write={own['sync_s'] / own['shm_write_s']:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="a local HF model directory (default: the tiny model)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gen-repeats", type=int, default=3, help="timed generate calls (seeds 0..); median reported")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--kv_tokens", type=int, default=65536, help="tokens of KV cache (CPU)")
    parser.add_argument("--sft-steps", type=int, default=200, help="bf16 check: SFT steps of the trained copy")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--at-size", default=True, action=argparse.BooleanOptionalAction,
                        help="also measure the sync of a >= 100M-parameter model")
    parser.add_argument("--at-size-model", default="", help="a local HF directory for it (default: random Qwen2 ~113M)")
    parser.add_argument("--at-size-syncs", type=int, default=3)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args)

    import torch
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; {args.prompts} prompts x n={args.n}, "
          f"max_tokens {args.max_tokens}, temperature 1; {args.syncs} timed syncs", flush=True)
    modes = args.modes.split(",")
    res = {}
    for mode in modes:
        t0 = time.perf_counter()
        res[mode] = r = run_child(mode, args)
        print(f"[{mode}] child took {time.perf_counter() - t0:.1f} s (engine start {r['engine_start_s']:.1f} s)", flush=True)
        if mode == "bf16":
            print(f"[bf16] bfloat16 engine vs float32 trainer, max |engine - trainer| log-prob (nats), "
                  f"probe / every token of 16 task sequences:")
            keys = ["fresh", "sft"] + [f"noise{sigma}" for sigma in SIGMAS]
            for key in keys:
                label = {"fresh": "fresh tiny model", "sft": f"SFT {args.sft_steps} steps (final loss {r['sft_loss']:.3f})",
                         **{f"noise{sigma}": f"noise sigma {sigma} (max of 3 seeds)" for sigma in SIGMAS}}[key]
                print(f"  {label:42s} probe {r[key]['probe']:.4f}   all tokens {r[key]['all_tokens']:.4f}")
            print("BF16 probe_max_abs_diff " + " ".join(f"{k}={r[k]['probe']:.4f}" for k in keys), flush=True)
        else:
            print(f"[{mode}] generation (median of {len(r['gen_tok_s_all'])} calls): {r['gen_tokens']} tokens in "
                  f"{r['gen_seconds']:.2f} s = {r['gen_tok_s']:.0f} tok/s (+ {r['prompt_tokens']} prompt tokens); "
                  f"all calls: {', '.join(f'{x:.0f}' for x in r['gen_tok_s_all'])} tok/s", flush=True)
            print(f"[{mode}] sync of {r['state_mb']:.1f} MB float32: mean {r['sync_s']:.4f} s over "
                  f"{len(r['sync_s_all'])} ({', '.join(f'{t:.4f}' for t in r['sync_s_all'])}); "
                  f"float32 probe diff max {r['probe_diff_max']:.2e}", flush=True)
            if mode == "own":
                print(f"[own] safetensors write of the same state dict to /dev/shm: {r['shm_write_s']:.4f} s; "
                      f"sync / write = {r['sync_s'] / r['shm_write_s']:.2f}", flush=True)

    def field(mode, key, fmt):
        return format(res[mode][key], fmt) if mode in res else "nan"

    ratio = res["own"]["sync_s"] / res["own"]["shm_write_s"] if "own" in res else float("nan")
    print(f"RESULT gen_tok_s={field('inprocess', 'gen_tok_s', '.1f')} sync_s_inprocess={field('inprocess', 'sync_s', '.4f')} "
          f"sync_s_own_process={field('own', 'sync_s', '.4f')} sync_over_shm_write={ratio:.2f}")
    if args.at_size:
        at_size(args)


if __name__ == "__main__":
    main()

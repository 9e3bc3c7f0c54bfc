"""Update throughput and MFU of GRPO and SDPO on GPUs: the project's own update path under FSDP2.

    torchrun --nproc_per_node 1 bench/gpu_update.py                     # Qwen2.5-0.5B shape, random weights
    torchrun --nproc_per_node 8 bench/gpu_update.py                     # the same batch over 8 GPUs
    torchrun --nproc_per_node 1 bench/gpu_update.py --ceiling --profile # + plain bf16 fwd+bwd, top CUDA ops
    torchrun --nproc_per_node 1 bench/gpu_update.py --tiny              # seconds-long smoke test (CPU: gloo)

No engine (no vLLM) and no download: a Qwen2-shaped model with random weights is written once
to a temporary HF directory (--hidden/--layers/... ; the defaults are Qwen2.5-0.5B's shape),
and a synthetic rollout batch is built in the structures run.py's loop hands to the update
(microbatch.Rollout: prompt and response ids, engine log-probs, rewards; GRPO's advantages from
objectives.grpo.prepare_advantages; SDPO's teacher contexts laid out as sdpo.build_teacher_batch lays
them out: the prompt, the first successful sibling's response as the demonstration, a lone
success with none, feedback for a failure without one, then the student's response ids). What
is timed is what a user's step runs: run.build_trainer (policy sharded by shard, one
fully_shard unit per decoder layer, bf16 params / fp32 reduce; AdamW; for SDPO the EMA teacher
copy), then run.update_policy (the old log-probs before the first of --mini-batches optimizer
steps, objectives.sdpo.cache_teacher_hidden for SDPO, every micro-batch's objective loss and backward,
grad clipping, AdamW), then the EMA step (timed apart, as run.learn does it).

One GPU: shard leaves the policy unsharded at world size 1 (run.py's single-process path:
float32 weights, bf16 autocast, CausalLM.forward). By default this script shards it anyway
(a one-rank FSDP2 mesh), so that one GPU measures what each of N GPUs runs;
--no-fsdp-at-world-1 measures run.py's single-process path instead.

Model FLOPs (counted on the real tokens, not the padding; N = non-embedding parameters, V the
vocabulary, d the hidden size, d_a = heads x head_dim, L layers, S a sequence's length, R its
response length): a forward of a sequence costs 2*N*S + 2*V*d*R (the LM head runs on response
positions only) + 2*L*d_a*S^2 (causal attention: QK^T and AV, half the square); a forward and
backward 3x that. A pass that runs a group's shared prompt once (the old log-probs; the teacher)
counts that prompt once. The update's FLOPs = the training pass (3x) + the old log-probs (1x, when
--mini-batches > 1) + for SDPO the teacher's forward (1x, its LM head on the response tokens of
the samples with a teacher context). Recomputation inside the losses (the chunked SDPO head's
backward, the entropy/log-prob diagnostics) is not counted: it is overhead, as in any MFU.
MFU = FLOPs / (seconds x world x --peak-tflops), 989 TFLOP/s: H100 SXM bf16 dense.

Tokens/s = the batch's prompt + response tokens / the update's seconds (run.py's
throughput/tokens_per_s counts the same tokens, over the whole step). The first update is a
warm-up; the figures are medians over --repeats updates of the same batch. The last line:

    RESULT device=... params=... grpo_tokens_per_s=... grpo_mfu=... sdpo_tokens_per_s=... sdpo_mfu=...
           sdpo_teacher_s=... sdpo_over_grpo_update_time=...

Figures on one H100, and what limits them: bench/results/gpu.md.

Not a test and not imported by any: it needs torchrun, and a GPU for its figures.
"""
import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import types

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
try:  # run.py names tyro in one annotation; a machine without it can still run the loop's functions
    import tyro  # noqa: F401
except ImportError:
    sys.modules["tyro"] = types.SimpleNamespace(conf=types.SimpleNamespace(arg=lambda **kwargs: None))
import distributed  # noqa: E402
import microbatch  # noqa: E402
import objectives  # noqa: E402
import packing  # noqa: E402
import policy  # noqa: E402
import run  # noqa: E402
import update  # noqa: E402
from distributed import Dist  # noqa: E402
from microbatch import Rollout  # noqa: E402
from policy import CausalLM, load_policy  # noqa: E402
from update import rank_micro_batches  # noqa: E402

QWEN_PAD = 151643  # Qwen2's <|endoftext|>


def add_model_args(p, name: str, hidden: int, layers: int, heads: int, intermediate: int, kv_heads: int = 2):
    """The random model's shape flags (a Qwen2Config; model_config reads them), defaults: name's."""
    m = p.add_argument_group(f"model (Qwen2Config; defaults: {name})")
    m.add_argument("--hidden", type=int, default=hidden)
    m.add_argument("--layers", type=int, default=layers)
    m.add_argument("--heads", type=int, default=heads)
    m.add_argument("--kv-heads", type=int, default=kv_heads)
    m.add_argument("--intermediate", type=int, default=intermediate)
    m.add_argument("--vocab", type=int, default=151936)
    m.add_argument("--untied", action="store_true", help="a separate LM head (not tied to the embeddings)")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, "Qwen2.5-0.5B", hidden=896, layers=24, heads=14, intermediate=4864)
    b = p.add_argument_group("rollout batch")
    b.add_argument("--prompts", type=int, default=8, help="prompts per step")
    b.add_argument("--n", type=int, default=8, help="samples per prompt")
    b.add_argument("--prompt-len", default="128,512", help="uniform range of a prompt's tokens")
    b.add_argument("--response-len", default="256,1536", help="uniform range of a response's tokens")
    b.add_argument("--feedback-len", default="64,256", help="SDPO: tokens of a failure's feedback")
    b.add_argument("--success", type=float, default=0.5, help="chance that a sample succeeds (reward 1)")
    t = p.add_argument_group("update (run.py's --train.* and --sdpo.*)")
    t.add_argument("--mini-batches", type=int, default=4)
    t.add_argument("--micro-batch", type=int, default=32)
    t.add_argument("--micro-batch-tokens", type=int, default=16384)
    t.add_argument("--sdpo-chunk-size", type=int, default=None, help="--sdpo.chunk_size (default: run.py's)")
    t.add_argument("--head-chunk-size", type=int, default=None,
                   help="--train.head_chunk_size (default: run.py's; 0: [N, V] logits)")
    t.add_argument("--teacher-micro-batch", type=int, default=None, help="--sdpo.teacher_micro_batch")
    t.add_argument("--gradient-checkpointing", action="store_true")
    r = p.add_argument_group("measurement")
    r.add_argument("--algos", default="grpo,sdpo")
    r.add_argument("--repeats", type=int, default=3, help="timed updates after one warm-up")
    r.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU: H100 SXM bf16 dense")
    r.add_argument("--no-fsdp-at-world-1", dest="fsdp_at_world_1", action="store_false",
                   help="world size 1: run.py's own single-process path (no FSDP2, float32)")
    r.add_argument("--ceiling", action="store_true",
                   help="also: the same micro-batches' forward+backward through a plain bf16 copy (no FSDP2, "
                        "no optimizer, no old log-probs), GRPO's head; the MFU the model's kernels allow")
    r.add_argument("--profile", action="store_true", help="torch.profiler over one more update of each algo")
    r.add_argument("--profile-dir", default=os.environ.get("OUT", ""), help="where the profiles' tables go")
    r.add_argument("--model-dir", default="", help="the random model's HF directory (default: a temp dir)")
    r.add_argument("--json", default="", help="also write the figures here")
    r.add_argument("--tiny", action="store_true", help="a tiny model and batch: a smoke test")
    args = p.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab = 64, 2, 4, 2, 128, 512
        args.prompts, args.n, args.prompt_len, args.response_len, args.feedback_len = 2, 4, "8,16", "8,24", "4,8"
        args.micro_batch_tokens, args.mini_batches, args.repeats = 96, 2, 1
    for name in ("prompt_len", "response_len", "feedback_len"):
        setattr(args, name, tuple(int(x) for x in getattr(args, name).split(",")))
    return args


# ----------------------------------------------------------------------------------------
# The model and the batch


def model_config(args):
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       intermediate_size=args.intermediate, max_position_embeddings=32768, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_word_embeddings=not args.untied,
                       **({"bos_token_id": QWEN_PAD, "eos_token_id": QWEN_PAD} if args.vocab > QWEN_PAD else {}))


def write_model(args, d: Dist) -> str:
    """A random-weight Qwen2 model as an HF directory (float32, as load_policy reads it)."""
    config = model_config(args)
    key = hashlib.sha1(config.to_json_string().encode()).hexdigest()[:12]
    path = args.model_dir or os.path.join(tempfile.gettempdir(), f"bench-gpu-update-{key}")
    if d.rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        from transformers import AutoModelForCausalLM
        torch.manual_seed(0)
        with torch.device(d.device):  # initialised on the GPU: seconds, not a minute of CPU
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tmp = path + f".tmp{os.getpid()}"
        hf.save_pretrained(tmp)
        os.replace(tmp, path)
        del hf
    if d.world > 1:
        dist.barrier()
    return path


def synthetic_rollouts(args, pad_id: int) -> list:
    """One step's rollouts, the same on every rank: --prompts groups of --n samples, random ids,
    engine log-probs, rewards (success with chance --success) and, for a failure, feedback."""
    rng = random.Random(0)
    token = lambda: rng.randrange(0, args.vocab - 1 if pad_id == args.vocab - 1 else args.vocab)
    ids = lambda n: [t if t != pad_id else t - 1 for t in (token() for _ in range(n))]
    out = []
    for g in range(args.prompts):
        prompt = ids(rng.randint(*args.prompt_len))
        row = {"uid": f"prompt-{g}", "messages": [{"role": "user", "content": ""}]}
        for _ in range(args.n):
            response = ids(rng.randint(*args.response_len))
            success = rng.random() < args.success
            out.append(Rollout(row=row, prompt_ids=prompt, response_ids=response,
                               rollout_logprobs=[-abs(rng.gauss(0.0, 1.5)) for _ in response], text="",
                               truncated=False, reward=float(success),
                               feedback="" if success else "feedback"))
    return out


def add_teacher_contexts(args, rollouts: list):
    """SDPO's teacher ids as sdpo.build_teacher_batch builds them, with random
    template tokens: chat header + prompt + "Correct solution:" + the first successful
    sibling's response (not its own) + instruction + generation prompt, then the response;
    without a demonstration, a failure's feedback instead; a lone success: no context."""
    rng = random.Random(1)
    template = {name: [rng.randrange(args.vocab - 2) for _ in range(n)]
                for name, n in (("head", 12), ("solution", 8), ("feedback", 14), ("instruction", 14), ("gen", 3))}
    feedback = {}
    groups = objectives.dpo.prompt_groups(rollouts)
    microbatch.give_fields(rollouts, objectives.sdpo.Fields)
    for group in groups:
        successes = [r for r in group if r.reward >= 0.5]
        for r in group:
            demo = next((s for s in successes if s is not r), None)
            if demo is not None:
                context = template["solution"] + demo.response_ids[:-1]  # the decoded demonstration, no EOS
                r.fields.teacher_context = "demonstration"
            elif r.feedback:
                key = id(r)
                feedback[key] = [rng.randrange(args.vocab - 2) for _ in range(rng.randint(*args.feedback_len))]
                context = template["feedback"] + feedback[key]
                r.fields.teacher_context = "feedback"
            else:
                context, r.fields.teacher_context = None, ""
            prompt = r.prompt_ids if context is None else (
                template["head"] + r.prompt_ids[:-3] + context + template["instruction"] + template["gen"])
            r.fields.teacher_ids, r.fields.sdpo_mask = list(prompt) + list(r.response_ids), float(context is not None)


# ----------------------------------------------------------------------------------------
# FLOPs


def model_shapes(hf) -> dict:
    c = hf.config
    total = sum(p.numel() for p in hf.parameters())
    embed = c.vocab_size * c.hidden_size
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    non_embedding = total - embed * (1 if c.tie_word_embeddings else 2)
    return {"params": total, "non_embedding": non_embedding, "vocab": c.vocab_size, "hidden": c.hidden_size,
            "layers": c.num_hidden_layers, "attn_width": c.num_attention_heads * head_dim}


def forward_flops(shapes: dict, seqs: list, head_tokens: int, shared_prefix: bool) -> float:
    """One forward over seqs (lists of (prompt_len, total_len)), the LM head on head_tokens; a
    prompt shared by neighbours (shared_prefix) counted once."""
    n, v, d, layers, da = (shapes[k] for k in ("non_embedding", "vocab", "hidden", "layers", "attn_width"))
    tokens, squares, seen = 0, 0, set()
    for key, prompt_len, total in seqs:
        if shared_prefix:
            if key not in seen:
                seen.add(key)
                tokens += prompt_len
                squares += prompt_len ** 2
            tokens += total - prompt_len
            squares += total ** 2 - prompt_len ** 2
        else:
            tokens += total
            squares += total ** 2
    return 2 * n * tokens + 2 * v * d * head_tokens + 2 * layers * da * squares


def update_flops(shapes: dict, rollouts: list, cfg, algo: str) -> dict:
    """Model FLOPs of one update (see the module docstring), by pass."""
    # every rollout trains: SDPO's samples without a teacher context too (objectives.OBJECTIVES has
    # no counted_only for sdpo), with a zero loss; their passes count, as they run
    trained = rollouts
    trained_seqs = [(id(r.prompt_ids), len(r.prompt_ids), len(r.prompt_ids) + len(r.response_ids)) for r in trained]
    responses = sum(len(r.response_ids) for r in trained)
    out = {"train": 3 * forward_flops(shapes, trained_seqs, responses, shared_prefix=False)}
    if cfg.train.mini_batches > 1:
        out["old_logprobs"] = forward_flops(shapes, trained_seqs, responses, microbatch.share_prompts(cfg))
    if algo == "sdpo":
        used = [r for r in rollouts if r.fields.sdpo_mask > 0]
        teacher = [(tuple(r.fields.teacher_ids[:len(r.fields.teacher_ids) - len(r.response_ids)]),
                    len(r.fields.teacher_ids) - len(r.response_ids), len(r.fields.teacher_ids)) for r in used]
        out["teacher"] = forward_flops(shapes, teacher, sum(len(r.response_ids) for r in used),
                                       cfg.sdpo.share_teacher_prefix)
    return out


# ----------------------------------------------------------------------------------------
# Timing


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def timed_calls(module, name: str, into: list, device):
    """Wrap module.name so that each call's seconds (device-synchronised) are appended to into."""
    original = getattr(module, name)

    def wrapper(*a, **k):
        sync(device)
        t0 = time.perf_counter()
        result = original(*a, **k)
        sync(device)
        into.append(time.perf_counter() - t0)
        return result
    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, original)


def make_cfg(args, algo: str):
    cfg = run.Config()
    cfg.algo.name = algo
    cfg.optim.lr = 1e-6
    cfg.rollout.n = args.n
    cfg.train.mini_batches = args.mini_batches
    cfg.train.micro_batch = args.micro_batch
    cfg.train.micro_batch_tokens = args.micro_batch_tokens
    cfg.model.gradient_checkpointing = args.gradient_checkpointing
    if args.sdpo_chunk_size:
        cfg.sdpo.chunk_size = args.sdpo_chunk_size
    if args.head_chunk_size is not None:
        cfg.train.head_chunk_size = args.head_chunk_size
    if args.teacher_micro_batch:
        cfg.sdpo.teacher_micro_batch = args.teacher_micro_batch
    return cfg


def measure(args, algo: str, model_dir: str, d: Dist, shapes: dict, pad_id: int) -> dict:
    cfg, objective = make_cfg(args, algo), objectives.OBJECTIVES[algo]
    rollouts = synthetic_rollouts(args, pad_id)
    if algo == "sdpo":
        add_teacher_contexts(args, rollouts)
    else:
        objectives.grpo.prepare_advantages(rollouts, None, cfg)
    trainer = run.build_trainer(cfg, objective, model_dir, d)
    if d.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(d.device)
    flops = update_flops(shapes, rollouts, cfg, algo)
    tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    runs = []
    for step in range(args.repeats + 1):
        old_s, teacher_s = [], []
        with timed_calls(update, "before_update_logprobs", old_s, d.device), \
                timed_calls(objectives.sdpo, "cache_teacher_hidden", teacher_s, d.device):
            sync(d.device)
            t0 = time.perf_counter()
            metrics, stepped = run.update_policy(cfg, objective, trainer, rollouts, step, pad_id, d)
            sync(d.device)
            seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        objective.after_update(trainer.models, stepped, step + 1)  # SDPO: the EMA step
        sync(d.device)
        runs.append({"update_s": seconds, "old_logprobs_s": sum(old_s), "teacher_s": sum(teacher_s),
                     "ema_s": time.perf_counter() - t0, "stepped": stepped, "loss": metrics["actor/loss"],
                     "grad_norm": metrics["actor/grad_norm"]})
        if d.rank == 0:
            print(f"  {algo} update {step}{' (warm-up)' if step == 0 else ''}: {seconds:.3f} s "
                  f"(old log-probs {sum(old_s):.3f} s, teacher {sum(teacher_s):.3f} s, "
                  f"EMA {runs[-1]['ema_s']:.3f} s) loss {metrics['actor/loss']:.4g} "
                  f"grad norm {metrics['actor/grad_norm']:.3g}", flush=True)
    timed = runs[1:]
    med = {k: statistics.median(r[k] for r in timed) for k in ("update_s", "old_logprobs_s", "teacher_s", "ema_s")}
    peak = d.world * args.peak_tflops * 1e12
    total_flops = sum(flops.values())
    train_s = med["update_s"] - med["old_logprobs_s"] - med["teacher_s"]
    result = {
        "algo": algo, "tokens": tokens, **med, "train_s": train_s,
        "update_s_all": [round(r["update_s"], 4) for r in timed],
        "tokens_per_s": tokens / med["update_s"],
        "flops": flops, "flops_per_token": total_flops / tokens,
        "mfu": total_flops / med["update_s"] / peak,
        "train_pass_mfu": flops["train"] / train_s / peak,
        "old_logprobs_mfu": flops.get("old_logprobs", 0.0) / med["old_logprobs_s"] / peak if med["old_logprobs_s"] else None,
        "teacher_mfu": flops.get("teacher", 0.0) / med["teacher_s"] / peak if med["teacher_s"] else None,
        "teacher_coverage": sum(r.fields.sdpo_mask for r in rollouts) / len(rollouts) if algo == "sdpo" else None,
        "teacher_tokens": sum(len(r.fields.teacher_ids) for r in rollouts if r.fields.sdpo_mask) if algo == "sdpo" else None,
    }
    if d.device.type == "cuda":
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(d.device) / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(d.device) / 2**30
        # cudaMalloc failures the caching allocator recovered from by freeing its cache (each a
        # device synchronisation): a sign that a micro-batch's peak sits at the memory's limit
        result["alloc_retries"] = torch.cuda.memory_stats(d.device).get("num_alloc_retries", 0)
    if args.profile:
        result["profile"] = profile_update(args, cfg, objective, trainer, rollouts, pad_id, d, algo)
    del trainer
    if d.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def profile_update(args, cfg, objective, trainer, rollouts, pad_id, d: Dist, algo: str) -> dict:
    """One more update under torch.profiler: the top ops by device time, and how busy the
    device was (kernel time / wall time; the rest is the host launching and waiting)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if d.device.type == "cuda" else [])
    sync(d.device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        run.update_policy(cfg, objective, trainer, rollouts, 99, pad_id, d)
        sync(d.device)
    wall = time.perf_counter() - t0
    sort = "self_cuda_time_total" if d.device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60)
    # kernels only (device events), grouped by kind
    kinds = {"gemm": 0.0, "attention": 0.0, "nccl": 0.0, "other": 0.0}
    busy = 0.0
    for e in prof.events():
        if d.device.type != "cuda" or getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        name = e.name.lower()
        kind = ("nccl" if "nccl" in name else
                "attention" if any(s in name for s in ("attention", "fmha", "flash", "attn")) else
                "gemm" if any(s in name for s in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "ampere_", "sm80"))
                else "other")
        kinds[kind] += us / 1e6
        busy += us / 1e6
    if args.profile_dir and d.rank == 0:
        os.makedirs(args.profile_dir, exist_ok=True)
        with open(os.path.join(args.profile_dir, f"profile_{algo}.txt"), "w") as f:
            f.write(table)
    if d.rank == 0:
        print(f"--- profile of one {algo} update (wall {wall:.3f} s under the profiler) ---")
        print("\n".join(table.splitlines()[:24]))
    return {"wall_s": wall, "kernel_s": busy, "busy_frac": busy / wall if wall else 0.0,
            "kernel_s_by_kind": kinds}


def ceiling(args, model_dir: str, d: Dist, shapes: dict, pad_id: int, with_head: bool = True) -> dict:
    """The GRPO batch's micro-batches (as rank_micro_batches packs them, one rank) through
    a plain bf16 copy of the model: forward with GRPO's head (microbatch.logprob_head at
    --head-chunk-size, run.py's by default: log-probs and entropy), sum of log-probs,
    backward. No FSDP2, no optimizer, no old log-probs, no loss arithmetic: what the kernels
    allow. with_head=False: the decoder alone (the sum of the final hidden states; no LM
    head, and no head FLOPs)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    if args.gradient_checkpointing:
        hf.gradient_checkpointing_enable()
    model = CausalLM(hf).to(d.device)
    rollouts = synthetic_rollouts(args, pad_id)
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rollouts]
    micro = rank_micro_batches([[i] for i in range(len(rollouts))], args.micro_batch, Dist(0, 1, d.device),
                                   lengths, args.micro_batch_tokens)
    chunk_size = make_cfg(args, "grpo").train.head_chunk_size
    head = (lambda packed: microbatch.logprob_head(packed.targets, 1.0, chunk_size)) if with_head else (
        lambda packed: lambda hidden, weight: (hidden.float().sum(), None))
    packs = [packing.pack([rollouts[i].prompt_ids + rollouts[i].response_ids for i in part],
                       [len(rollouts[i].response_ids) for i in part], pad_id, d.device) for part in micro]
    times = []
    for _ in range(args.repeats + 1):
        sync(d.device)
        t0 = time.perf_counter()
        for packed in packs:
            logprobs, _ = microbatch.forward(model, packed, head(packed))
            logprobs.sum().backward()
        sync(d.device)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    seconds = statistics.median(times[1:])
    seqs = [(id(r.prompt_ids), len(r.prompt_ids), len(r.prompt_ids) + len(r.response_ids)) for r in rollouts]
    flops = 3 * forward_flops(shapes, seqs, sum(len(r.response_ids) for r in rollouts) if with_head else 0,
                              shared_prefix=False)
    tokens = sum(lengths)
    padded = sum(p.input_ids.numel() for p in packs)
    del model, hf
    if d.device.type == "cuda":
        torch.cuda.empty_cache()
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "mfu": flops / seconds / (args.peak_tflops * 1e12),
            "micro_batches": len(packs), "padding_frac": 1 - tokens / padded}


# ----------------------------------------------------------------------------------------


def main():
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and not dist.is_initialized() and (world > 1 or args.fsdp_at_world_1):
        # run.setup_distributed's group for world > 1: host values through gloo, GPU tensors through NCCL
        dist.init_process_group(distributed.BACKENDS["cuda" if cuda else "cpu"])
    d = run.setup_distributed()
    if d.world == 1 and args.fsdp_at_world_1:
        if not dist.is_initialized():
            raise SystemExit("FSDP2 at world size 1 needs a process group: run under torchrun "
                             "(or pass --no-fsdp-at-world-1)")
        shard = policy.shard  # shards only when world > 1: shard the one-rank mesh as each of N ranks would
        policy.shard = lambda model, world, device: shard(model, max(world, 2), device)
    pad_id = QWEN_PAD if args.vocab > QWEN_PAD else 0
    model_dir = write_model(args, d)
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        shapes = model_shapes(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)))
    device_name = torch.cuda.get_device_name(d.device) if cuda else "cpu"
    mode = "FSDP2 bf16 params, fp32 reduce" if (d.world > 1 or args.fsdp_at_world_1) and cuda else (
        "FSDP2 (CPU: fp32)" if d.world > 1 or args.fsdp_at_world_1 else "no FSDP: fp32 weights, bf16 autocast on GPU (run.py at world 1)")
    if d.rank == 0:
        print(f"device={device_name} x{d.world} torch={torch.__version__} mode: {mode}")
        print(f"model: {shapes['params'] / 1e6:.1f} M params ({shapes['non_embedding'] / 1e6:.1f} M non-embedding), "
              f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; batch {args.prompts} x {args.n}, "
              f"prompt {args.prompt_len}, response {args.response_len}; mini_batches {args.mini_batches}, "
              f"micro_batch {args.micro_batch}, micro_batch_tokens {args.micro_batch_tokens}", flush=True)
    results = {}
    for algo in [a for a in args.algos.split(",") if a]:
        results[algo] = measure(args, algo, model_dir, d, shapes, pad_id)
    if args.ceiling and d.rank == 0:
        results["ceiling"] = ceiling(args, model_dir, d, shapes, pad_id)
        results["ceiling_no_head"] = ceiling(args, model_dir, d, shapes, pad_id, with_head=False)
    if d.rank != 0:
        return
    print(f"\n{'':<8} {'update s':>9} {'old lp s':>9} {'teacher s':>9} {'EMA s':>7} {'tokens/s':>10} "
          f"{'GFLOP/tok':>9} {'MFU':>7} {'train MFU':>9} {'peak GiB':>9}")
    for algo in (a for a in results if not a.startswith("ceiling")):
        r = results[algo]
        print(f"{algo:<8} {r['update_s']:>9.3f} {r['old_logprobs_s']:>9.3f} {r['teacher_s']:>9.3f} {r['ema_s']:>7.3f} "
              f"{r['tokens_per_s']:>10.0f} {r['flops_per_token'] / 1e9:>9.2f} {r['mfu']:>7.1%} "
              f"{r['train_pass_mfu']:>9.1%} {r.get('peak_allocated_gib', float('nan')):>9.1f}")
    for name, what in (("ceiling", "GRPO's head"), ("ceiling_no_head", "no LM head")):
        if name in results:
            c = results[name]
            print(f"ceiling (plain bf16 fwd+bwd, {what}, {c['micro_batches']} micro-batches, "
                  f"{c['padding_frac']:.1%} padding): {c['seconds']:.3f} s, {c['tokens_per_s']:.0f} tokens/s, "
                  f"MFU {c['mfu']:.1%}")
    print(json.dumps(results, indent=1, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device_name, "world": d.world, "mode": mode, "shapes": shapes,
                       "results": results}, f, indent=1, default=str)
    fields = [f"device={device_name.replace(' ', '_')}x{d.world}", f"params={shapes['params'] / 1e6:.0f}M"]
    for algo in ("grpo", "sdpo"):
        if algo in results:
            fields += [f"{algo}_tokens_per_s={results[algo]['tokens_per_s']:.0f}", f"{algo}_mfu={results[algo]['mfu']:.3f}"]
    if "sdpo" in results:
        fields.append(f"sdpo_teacher_s={results['sdpo']['teacher_s']:.3f}")
    if "grpo" in results and "sdpo" in results:
        fields.append(f"sdpo_over_grpo_update_time={results['sdpo']['update_s'] / results['grpo']['update_s']:.3f}")
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

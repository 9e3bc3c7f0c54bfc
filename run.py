"""Train a causal LM with SDPO, GRPO, GSPO, the λ-hybrid or SFT, on rollouts from vLLM.

    python run.py                                          # the default job: tiny model, CPU
    torchrun --nproc_per_node=2 run.py --algo grpo         # FSDP2 over two ranks
    python run.py --model.path /models/Qwen3-8B --data.task /data/train.parquet \
        --data.fields prompt=question,answer=solution --rollout.placement separate

Every knob is a flag (`python run.py --help`), also as `--section.name=value`.
The loop in `train` reads top to bottom as the algorithm: sample prompts, generate,
score, build teacher contexts, update (mini-batches of micro-batches, losses normalised
by the optimizer step's global token counts), update the teacher, sync weights into the
engine (verified), log, evaluate, checkpoint.
"""
import contextlib
import copy
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch
import torch.distributed as dist

import data
import feedback
import losses
import sdpo
from teacher import Teacher, full_tensor, reshard

# ----------------------------------------------------------------------------------------
# Configuration (tyro): python run.py --help


@dataclass
class ModelConfig:
    path: str = ""  # a local HF model directory; empty: the tiny model built from the task corpus
    tiny: data.TinyModelConfig = field(default_factory=data.TinyModelConfig)
    gradient_checkpointing: bool = False


@dataclass
class DataConfig(data.TaskConfig):
    task: str = "strops"  # a synthetic task (arith, strops) or a .jsonl/.parquet file
    eval_path: str = ""  # held-out file (default: the task's test split / a hash split of the file)
    fields: str = ""  # column mapping for files, e.g. prompt=question,answer=solution
    reward: str = ""  # reward function: math, strops, code, mc or module:function (default: the row's)
    train_rows: int = 4000  # rows drawn from a synthetic task
    eval_rows: int = 256  # avg@4 on 256 rows: a standard error of ~1.4 points at 27%
    max_prompt_len: int = 1024


@dataclass
class RolloutConfig:
    placement: Literal["colocated", "separate"] = "colocated"
    engine_process: Literal["auto", "inprocess", "own"] = "auto"
    dtype: str = ""  # engine dtype; empty: float32 on CPU (exact sync checks), bfloat16 on GPU
    n: int = 8  # samples per prompt
    temperature: float = 1.0
    max_tokens: int = 32
    gpu_memory_utilization: float = 0.3  # GPU memory fraction (on CPU only without kv_cache_tokens)
    kv_cache_tokens: int = 0  # on CPU: tokens the engine's KV cache holds; 0: sized from the run's batches
    max_model_len: int = 2048
    sync_tol: float = 0.0  # max |engine - trainer| probe log-prob (nats) after a sync; 0: 1e-3 for a
    # float32 engine, 1.0 for bfloat16 (README: what holds)
    is_correction: bool = True  # truncated IS weights for the engine-vs-trainer mismatch
    is_cap: float = 2.0
    is_level: Literal["token", "sequence"] = "token"
    eval_temperature: float = 0.6
    eval_k: int = 4  # avg@k


@dataclass
class AlgoConfig:
    name: Annotated[Literal["sdpo", "grpo", "gspo", "hybrid", "sft"],
                    __import__("tyro").conf.arg(name="algo", prefix_name=False)] = "sdpo"
    lam: float = 0.9  # hybrid: A = lam * A_grpo + (1 - lam) * A_sdpo
    norm_adv_by_std: bool = False  # GRPO std normalisation (False: Dr. GRPO, as in the SDPO runs)
    eps_low: float = 0.2  # PPO clip
    eps_high: float = 0.2  # 0.28 for DAPO's clip-higher
    gspo_eps_low: float = 3e-4  # GSPO clips a sequence-level ratio: far narrower ranges
    gspo_eps_high: float = 4e-4
    loss_agg_mode: Literal["auto", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "auto"  # auto: seq-mean-token-mean for GSPO, else token-mean


@dataclass
class SdpoArgs(sdpo.SdpoConfig):
    distill: Literal["topk", "full", "token"] = "topk"
    topk: int = 100
    add_tail: bool = True
    alpha: float = 0.5  # 0 forward KL, 1 reverse KL, between: generalized JSD
    is_clip: float = 2.0
    chunked: bool = True  # top-K loss from hidden states, never materialising [tokens, vocab]
    chunk_size: int = 512
    teacher: Literal["ema", "frozen", "trust-region", "live"] = "ema"
    teacher_rate: float = 0.05
    teacher_micro_batch: int = 32
    share_teacher_prefix: bool = True  # run each distinct teacher prompt once per micro-batch (KV cache reuse)


@dataclass
class OptimConfig:
    lr: float = 1e-4  # the paper's 1e-5 is for 8B models; the tiny model needs more
    warmup_steps: int = 2
    decay: Literal["none", "linear"] = "none"  # linear: to 0 at train.steps (the warm start always decays)
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.999


@dataclass
class TrainConfig:
    steps: int = 40
    prompts_per_step: int = 16
    mini_batches: int = 4  # optimizer steps per rollout batch (SPEC 8: 1 without feedback, 32 with rich feedback)
    micro_batch: int = 32  # sequences per forward/backward on each rank
    seed: int = 0
    warm_start_steps: int = 300  # built-in SFT of the tiny model on the task's references (cached)
    warm_start_batch: int = 32
    warm_start_lr: float = 2e-3
    warm_start_seed: int = 0  # one warm start serves every RL seed
    # Shares of warm-start examples whose prompt is a teacher context (sdpo.py's templates)
    # with the reference as the correct solution, or with a wrong attempt's feedback: they
    # teach the tiny model to use what SDPO's teacher is shown.
    warm_start_demo_frac: float = 0.7
    warm_start_feedback_frac: float = 0.1
    eval_every: int = 20  # and at the start and the end; 0: never
    save_every: int = 0  # torch.distributed.checkpoint every N steps; 0: only the final HF model
    resume: str = ""  # a checkpoint directory written by save_every
    max_nonfinite_steps: int = 3  # consecutive optimizer steps with a NaN/inf loss before stopping


@dataclass
class LogConfig:
    out_dir: str = "runs/default"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "sdpo"
    run_name: str = ""
    progress: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    sdpo: SdpoArgs = field(default_factory=SdpoArgs)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval_only: bool = False  # evaluate --model.path (avg@k, length, truncation) and exit
    teacher_gap: bool = False  # with eval_only: also success with the reference as a demonstration / with feedback
    # Test-time self-distillation (paper section 5): train on each of this many held-out prompts
    # that the initial model fails, alone, and compare discovery with best-of-k; 0: off
    ttt_prompts: int = 0


# ----------------------------------------------------------------------------------------
# Distributed setup and the policy module


def setup_distributed():
    """(rank, world_size, device). Under torchrun: gloo on CPU, NCCL on GPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        from datetime import timedelta
        # A dead peer must surface as an error, not an endless wait.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=30))
    return (dist.get_rank() if world > 1 else 0), world, device


class CausalLM(torch.nn.Module):
    """An HF causal LM whose forward ends in a caller's head(hidden [N, H], lm_head weight).

    The head runs inside forward so that FSDP2 has the root's (possibly tied) LM-head
    weight unsharded while the loss uses it, and reduce-scatters its gradient after.
    """

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids, attention_mask, hidden_index, head, prefix=None):
        """prefix: (ids, mask, positions, row) of prompts shared by several sequences (see
        pack_shared_prefix): run once, their KV cache copied to each sequence's row."""
        past, positions = None, None
        if prefix is not None:
            prefix_ids, prefix_mask, prefix_positions, row = prefix
            past = self.hf.model(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=prefix_positions,
                                 use_cache=True).past_key_values
            past.reorder_cache(row)
            positions = prefix_mask.sum(1)[row, None] + torch.arange(input_ids.shape[1], device=input_ids.device)
            attention_mask = torch.cat([prefix_mask[row], attention_mask], dim=1)
        hidden = self.hf.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                               past_key_values=past, use_cache=prefix is not None).last_hidden_state
        return head(hidden.flatten(0, 1)[hidden_index], self.hf.lm_head.weight)


def load_policy(model_dir: str, cfg: Config, world: int, device):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if cfg.model.gradient_checkpointing:
        hf.gradient_checkpointing_enable()
    model = CausalLM(hf).to(device)
    return shard(model, world, device)


def shard(model: CausalLM, world: int, device):
    """FSDP2: one unit per decoder layer, then the root (embeddings, norm, LM head)."""
    if world == 1:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
    kwargs = {"mp_policy": mp} if mp else {}
    for layer in model.hf.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_state_dict(model: CausalLM, world: int) -> dict:
    """The whole HF-named state dict on rank 0 (every rank calls this), float32 on CPU."""
    if world == 1:
        state = {k: v.detach() for k, v in model.hf.state_dict().items()}
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(model.hf, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if model.hf.config.tie_word_embeddings and state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # the engine needs it (rollout.py)
    return state


@dataclass
class Packed:
    """A micro-batch of prompt+response sequences laid out for the model (data.pack_responses)."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    hidden_index: torch.Tensor
    targets: torch.Tensor
    token_index: torch.Tensor
    shape: tuple  # [B, R] of the response matrix


def pack(seqs, response_lens, pad_id, device) -> Packed:
    ids, mask, hidden_index, targets, token_index = data.pack_responses(seqs, response_lens, pad_id, device)
    return Packed(ids, mask, hidden_index, targets, token_index, (len(seqs), max(max(response_lens), 1)))


def pack_shared_prefix(seqs, response_lens, pad_id, device) -> tuple:
    """Model inputs for sequences many of which share their prompt: each distinct prompt
    (less its last token) once, left-padded, as the prefix; every sequence's suffix (its
    prompt's last token and response, right-padded) attends to its prefix's KV cache.
    The response positions are the same as pack()'s: one hidden state per response token."""
    prompts, row = {}, []
    for s, r in zip(seqs, response_lens):
        row.append(prompts.setdefault(tuple(s[:len(s) - r - 1]), len(prompts)))
    prefix_ids, prefix_mask = data.pad_left([list(p) for p in prompts], pad_id, min_width=1)
    prefix_positions = (prefix_mask.cumsum(1) - 1).clamp(min=0)
    suffixes = [s[len(s) - r - 1:] for s, r in zip(seqs, response_lens)]
    ids, mask, hidden_index, _, _ = data.pack_responses(suffixes, response_lens, pad_id, device)
    prefix = (prefix_ids.to(device), prefix_mask.to(device), prefix_positions.to(device),
              torch.tensor(row, dtype=torch.long, device=device))
    return ids, mask, hidden_index, prefix


def to_matrix(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Per-token values [N] -> the [B, R] right-padded response matrix (zeros elsewhere)."""
    out = values.new_zeros(packed.shape[0] * packed.shape[1])
    return out.index_copy(0, packed.token_index, values).view(packed.shape)


@torch.no_grad()
def token_stats(hidden, weight, targets, temperature, chunk=1024):
    """Log-probs of targets and entropies [N] without a gradient, chunk by chunk."""
    logprobs, entropies = [], []
    for i in range(0, hidden.shape[0], chunk):
        logits = (hidden[i:i + chunk] @ weight.T).float()
        logprobs.append(losses.token_logprobs(logits, targets[i:i + chunk], temperature))
        entropies.append(losses.entropy_from_logits(logits, temperature))
    empty = hidden.new_zeros(0, dtype=torch.float32)
    return (torch.cat(logprobs) if logprobs else empty), (torch.cat(entropies) if entropies else empty)


def token_logprobs_with_grad(hidden, weight, targets, temperature):
    return losses.token_logprobs(hidden @ weight.T, targets, temperature)


# ----------------------------------------------------------------------------------------
# Rollouts


@dataclass
class Rollout:
    row: dict
    prompt_ids: list
    response_ids: list
    rollout_logprobs: list  # from the engine, at the sampling temperature
    text: str
    truncated: bool
    reward: float = 0.0
    feedback: str = ""
    reward_error: str = ""
    advantage: float = 0.0
    teacher_ids: list | None = None  # teacher prompt + the same response ids
    sdpo_mask: float = 0.0


def rank0_call(rank: int, world: int, fn, share: bool = True):
    """Run fn on rank 0 and hand its result (when share), or its error, to every rank.

    Without this, an engine that dies on rank 0 leaves the other ranks waiting forever.
    """
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except Exception as e:  # re-raised below, on every rank
            error = e
    if world > 1:
        box = [(result if share else None, None if error is None else f"{type(error).__name__}: {error}")]
        dist.broadcast_object_list(box, src=0)
        shared, message = box[0]
        result = shared if share or rank != 0 else result
        if message and rank != 0:
            raise RuntimeError(f"rank 0 failed: {message}")
    if error is not None:
        raise error
    return result


def generate_and_score(engine, tokenizer, rows, cfg: Config, seed: int, n: int, temperature: float,
                       prompts: list | None = None):
    """Sample n responses per row and score them; one Rollout per sample, grouped by row.
    prompts: token ids to use instead of the rows' chat prompts."""
    prompts = prompts or [data.chat_prompt_ids(tokenizer, r["messages"], cfg.data.max_prompt_len) for r in rows]
    groups = engine.generate(prompts, n=n, temperature=temperature, max_tokens=cfg.rollout.max_tokens, seed=seed)
    rollouts = [Rollout(row=row, prompt_ids=s.prompt_ids, response_ids=s.response_ids, rollout_logprobs=s.logprobs,
                        text=s.text, truncated=s.truncated) for row, samples in zip(rows, groups) for s in samples]
    rewards = feedback.score_batch(
        feedback.get_reward_fn(cfg.data.reward or rows[0]["reward"]),
        [r.text for r in rollouts], [r.row for r in rollouts], [r.truncated for r in rollouts])
    for rollout, reward in zip(rollouts, rewards):
        rollout.reward, rollout.feedback, rollout.reward_error = reward.score, reward.feedback, reward.error
    return rollouts


def evaluate(engine, tokenizer, rows, cfg: Config, seed: int) -> dict:
    """avg@k success and its standard error, mean response length and truncation rate on
    held-out rows."""
    rollouts = generate_and_score(engine, tokenizer, rows, cfg, seed, cfg.rollout.eval_k, cfg.rollout.eval_temperature)
    n = max(len(rollouts), 1)
    return {
        "eval/success_rate": success_rate(rollouts, cfg),
        "eval/success_stderr": success_stderr(rollouts, cfg.rollout.eval_k, cfg),
        "eval/reward_mean": sum(r.reward for r in rollouts) / n,
        "eval/response_length": sum(len(r.response_ids) for r in rollouts) / n,
        "eval/truncated_frac": sum(r.truncated for r in rollouts) / n,
    }


def teacher_context_ids(tokenizer, row: dict, kind: str, rng: random.Random, cfg: Config) -> list[int] | None:
    """The row's prompt as SDPO's teacher sees it: with the reference as the demonstration
    ("demonstration"), or with the feedback on a plausible wrong attempt ("feedback"; None
    when the task has no wrong-answer generator or the feedback is empty)."""
    if kind == "demonstration":
        return sdpo.teacher_prompt_ids(tokenizer, row["messages"], row["reference"], None, cfg.sdpo)
    wrong = data.wrong_response(row, rng)
    if wrong is None:
        return None
    reward = feedback.score(feedback.get_reward_fn(cfg.data.reward or row["reward"]), wrong, row, False)
    return sdpo.teacher_prompt_ids(tokenizer, row["messages"], None, reward.feedback, cfg.sdpo) if reward.feedback else None


def teacher_gap(engine, tokenizer, rows, cfg: Config, seed: int) -> dict:
    """What SDPO relies on (the paper: it needs in-context ability): eval success of the
    model shown the reference as a demonstration, and shown a wrong attempt's feedback,
    next to eval/success_rate on the bare prompts."""
    rng, out = random.Random(seed), {}
    for kind in ("demonstration", "feedback"):
        pairs = [(row, teacher_context_ids(tokenizer, row, kind, rng, cfg)) for row in rows if row.get("reference")]
        pairs = [(row, ids) for row, ids in pairs if ids is not None]
        if pairs:
            rollouts = generate_and_score(engine, tokenizer, [r for r, _ in pairs], cfg, seed, cfg.rollout.eval_k,
                                          cfg.rollout.eval_temperature, prompts=[ids for _, ids in pairs])
            out[f"eval/success_rate_with_{kind}"] = success_rate(rollouts, cfg)
            out[f"eval/rows_with_{kind}"] = len(pairs)
    return out


def success_rate(rollouts, cfg: Config) -> float:
    return sum(r.reward >= cfg.sdpo.success_threshold for r in rollouts) / max(len(rollouts), 1)


def success_stderr(rollouts, k: int, cfg: Config) -> float:
    """Standard error of avg@k success over rows: the rows are the independent draws (a row's
    k samples are not), so it is the spread of per-row success over the square root of the rows."""
    rows = [success_rate(rollouts[i:i + k], cfg) for i in range(0, len(rollouts), k)]
    if len(rows) < 2:
        return float("nan")
    mean = sum(rows) / len(rows)
    return math.sqrt(sum((s - mean) ** 2 for s in rows) / (len(rows) - 1) / len(rows))


def sft_rollouts(tokenizer, rows, cfg: Config, step: int) -> list[Rollout]:
    """Reference responses as rollouts, for --algo sft and the tiny model's warm start.

    A share of the prompts (--train.warm_start_*_frac) are SDPO teacher contexts: the
    reference shown as the correct solution, or the feedback on a wrong attempt.
    """
    rng = random.Random(cfg.train.seed * 15485863 + step)
    out = []
    for row in rows:
        if not row.get("reference"):
            raise ValueError(f"{row['source']}: --algo sft needs a reference response (field 'teacher_response')")
        response = tokenizer(row["reference"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        draw, prompt = rng.random(), None
        if draw < cfg.train.warm_start_demo_frac:
            prompt = teacher_context_ids(tokenizer, row, "demonstration", rng, cfg)
        elif draw < cfg.train.warm_start_demo_frac + cfg.train.warm_start_feedback_frac:
            prompt = teacher_context_ids(tokenizer, row, "feedback", rng, cfg)
        if prompt is None:
            prompt = data.chat_prompt_ids(tokenizer, row["messages"], cfg.data.max_prompt_len)
        out.append(Rollout(row=row, prompt_ids=prompt, response_ids=response, rollout_logprobs=[0.0] * len(response),
                           text=row["reference"], truncated=False, reward=1.0))
    return out


# ----------------------------------------------------------------------------------------
# The loss of one micro-batch


def microbatch_loss(cfg: Config, policy, teacher: Teacher | None, batch: list[Rollout], counts: dict,
                    pad_id: int, device, old_logprobs: list | None):
    """Loss of a micro-batch, normalised by the optimizer step's global counts, and the
    sums of what is logged. old_logprobs: per-rollout trainer log-probs from before the
    update (None when this is the only optimizer step: the current ones, detached)."""
    algo = cfg.algo.name
    temperature = 1.0 if algo == "sft" else cfg.rollout.temperature  # SFT fits the plain distribution
    packed = pack([r.prompt_ids + r.response_ids for r in batch], [len(r.response_ids) for r in batch], pad_id, device)
    per_token = lambda values: torch.tensor([v for r in batch for v in values(r)], dtype=torch.float32, device=device)
    rollout_lp = per_token(lambda r: r.rollout_logprobs)
    seq_mask = per_token(lambda r: [r.sdpo_mask if algo == "sdpo" else 1.0] * len(r.response_ids))

    teacher_hidden = None
    t0 = time.perf_counter()
    if algo in ("sdpo", "hybrid"):
        teacher_hidden = teacher_hidden_states(cfg, policy, teacher, batch, pad_id, device,
                                               dist.get_world_size() if dist.is_initialized() else 1)
    teacher_seconds = time.perf_counter() - t0

    def head(hidden, weight):
        if algo != "sdpo":  # one pass over the logits gives the log-probs, their detached copy and the entropy
            logits = (hidden @ weight.T).float()
            logprobs = losses.token_logprobs(logits, packed.targets, temperature)
            out = {"logprobs": logprobs, "current_lp": logprobs.detach(),
                   "entropy": losses.entropy_from_logits(logits.detach(), temperature)}
            if algo == "hybrid":
                teacher_weight = teacher.head_weight(weight).to(hidden.dtype)
                out["teacher_lp"], _ = token_stats(teacher_hidden.to(hidden.dtype), teacher_weight, packed.targets,
                                                   temperature, cfg.sdpo.chunk_size)
            return out
        current_lp, entropy = token_stats(hidden, weight, packed.targets, temperature, cfg.sdpo.chunk_size)
        out = {"current_lp": current_lp, "entropy": entropy}
        teacher_weight = teacher.head_weight(weight).to(hidden.dtype)
        th = teacher_hidden.to(hidden.dtype)
        if cfg.sdpo.distill == "topk" and cfg.sdpo.chunked:
            out["loss"] = losses.sdpo_topk_loss_from_hidden(
                hidden, weight, th, teacher_weight, k=cfg.sdpo.topk, alpha=cfg.sdpo.alpha,
                add_tail=cfg.sdpo.add_tail, temperature=temperature, chunk_size=cfg.sdpo.chunk_size)
        elif cfg.sdpo.distill in ("topk", "full"):
            student_logits = hidden @ weight.T
            with torch.no_grad():
                teacher_logits = th @ teacher_weight.T
            if cfg.sdpo.distill == "topk":
                s, t, _ = losses.topk_with_tail(student_logits, teacher_logits, cfg.sdpo.topk,
                                                cfg.sdpo.add_tail, temperature=temperature)
            else:
                s = (student_logits.float() / temperature).log_softmax(-1)
                t = (teacher_logits.float() / temperature).log_softmax(-1)
            out["loss"] = losses.sdpo_divergence(s, t, cfg.sdpo.alpha)
        else:
            student_tok = token_logprobs_with_grad(hidden, weight, packed.targets, temperature)
            teacher_tok, _ = token_stats(th, teacher_weight, packed.targets, temperature, cfg.sdpo.chunk_size)
            out["loss"] = losses.sdpo_token_loss(student_tok, teacher_tok)
        return out

    out = policy(*_model_inputs(packed), head)
    current_lp = out["current_lp"]
    old_lp = current_lp if old_logprobs is None else per_token_list(old_logprobs, device)
    mat = lambda v: to_matrix(v, packed)
    mask = mat(seq_mask)
    # Engine-vs-trainer correction: truncated IS weights on the rollout log-probs.
    if cfg.rollout.is_correction and algo != "sft":
        is_weight = losses.importance_weights(mat(old_lp), mat(rollout_lp), cfg.rollout.is_cap,
                                              level=cfg.rollout.is_level, mask=mat(torch.ones_like(rollout_lp)))
    else:
        is_weight = torch.ones_like(mask)

    if algo == "sdpo":
        is_clip = losses.importance_weights(mat(current_lp), mat(old_lp), cfg.sdpo.is_clip)
        per_token_loss = mat(out["loss"]) * is_clip * is_weight
    elif algo == "sft":
        per_token_loss = -mat(out["logprobs"])
    else:
        advantages = torch.tensor([r.advantage for r in batch], dtype=torch.float32, device=device)
        logprobs = mat(out["logprobs"])
        if algo == "hybrid":
            # A_SDPO = T - S only where there is a teacher context; 0 elsewhere
            has_teacher = torch.tensor([r.sdpo_mask > 0 for r in batch], device=device)[:, None]
            teacher_lp = torch.where(has_teacher, mat(out["teacher_lp"]), mat(current_lp))
            advantages = losses.hybrid_advantages(advantages, teacher_lp, mat(current_lp), cfg.algo.lam)
        if algo == "gspo":
            per_token_loss, _ = losses.gspo_loss(logprobs, mat(old_lp), advantages, mask,
                                                 cfg.algo.gspo_eps_low, cfg.algo.gspo_eps_high)
        else:
            per_token_loss, _ = losses.ppo_clip_loss(logprobs, mat(old_lp), advantages, cfg.algo.eps_low, cfg.algo.eps_high)
        per_token_loss = per_token_loss * is_weight
    mode = cfg.algo.loss_agg_mode if cfg.algo.loss_agg_mode != "auto" else \
        ("seq-mean-token-mean" if algo == "gspo" else "token-mean")
    loss = losses.aggregate(per_token_loss, mask, mode, global_tokens=counts["tokens"],
                            global_sequences=counts["sequences"], max_len=counts["max_len"])

    response_mask = mat(torch.ones_like(rollout_lp))
    log_ratio = (mat(old_lp) - mat(rollout_lp)) * response_mask
    stats = {
        "loss_sum": loss.item(),
        "tokens": response_mask.sum().item(),
        "entropy_sum": out["entropy"].sum().item(),
        "mismatch_kl_sum": (losses.kl_estimate(mat(rollout_lp), mat(old_lp), "k3") * response_mask).sum().item(),
        "is_ratio_sum": (log_ratio.clamp(-20, 20).exp() * response_mask).sum().item(),
        "is_ratio_max": (log_ratio.clamp(-20, 20).exp() * response_mask).max().item() if response_mask.numel() else 0.0,
        "teacher_seconds": teacher_seconds,
    }
    if algo == "sdpo":
        stats["divergence_sum"] = (mat(out["loss"]).detach() * mask).sum().item()
        stats["distill_tokens"] = mask.sum().item()
    return loss, stats


def teacher_hidden_states(cfg: Config, policy, teacher: Teacher, batch: list[Rollout], pad_id: int, device,
                          world: int):
    """Teacher hidden states [N, H'] at every response token of the batch. Samples without
    a teacher context (mask 0) get zeros instead of a forward: their loss is masked out."""
    used = [r for r in batch if r.sdpo_mask > 0]
    calls = torch.tensor([math.ceil(len(used) / cfg.sdpo.teacher_micro_batch)])
    if world > 1:  # ranks differ in how many of their samples have a teacher context
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    if cfg.sdpo.share_teacher_prefix and not cfg.model.gradient_checkpointing:  # HF drops the KV cache under it
        forward = lambda model, seqs, lens, head: _call_shared(model, pack_shared_prefix(seqs, lens, pad_id, device), head)
    else:
        forward = lambda model, seqs, lens, head: model(*_model_inputs(pack(seqs, lens, pad_id, device)), head)
    hidden = teacher.hidden(policy, forward, [r.teacher_ids for r in used], [len(r.response_ids) for r in used],
                            cfg.sdpo.teacher_micro_batch, calls=int(calls), dummy_seq=[pad_id, pad_id])
    if len(used) == len(batch):
        return hidden
    width = hidden.shape[-1] if len(used) else teacher.hidden_size(policy)
    parts, start = [], 0
    for r in batch:
        if r.sdpo_mask > 0:
            parts.append(hidden[start:start + len(r.response_ids)])
            start += len(r.response_ids)
        else:
            parts.append(torch.zeros(len(r.response_ids), width, device=device, dtype=hidden.dtype if len(used) else torch.float32))
    return torch.cat(parts)


def _call_shared(model, inputs, head):
    ids, mask, hidden_index, prefix = inputs
    return model(ids, mask, hidden_index, head, prefix)


def _model_inputs(packed: Packed):
    return packed.input_ids, packed.attention_mask, packed.hidden_index


def _spans(batch):
    start = 0
    for r in batch:
        yield start, start + len(r.response_ids)
        start += len(r.response_ids)


def per_token_list(values: list, device) -> torch.Tensor:
    return torch.tensor([v for vs in values for v in vs], dtype=torch.float32, device=device)


def step_counts(rollouts: list[Rollout], algo: str) -> dict:
    """Global token / sequence counts of one optimizer step (all micro-batches, all ranks)."""
    weight = lambda r: (r.sdpo_mask if algo == "sdpo" else 1.0) if r.response_ids else 0.0
    return {"tokens": sum(len(r.response_ids) * (weight(r) > 0) for r in rollouts),
            "sequences": sum(weight(r) > 0 for r in rollouts),
            "max_len": max((len(r.response_ids) for r in rollouts), default=1)}


# ----------------------------------------------------------------------------------------
# The training loop


def train(cfg: Config, model_dir: str, rank: int, world: int, device) -> dict:
    """Run cfg.algo on the model in model_dir; returns the last logged metrics."""
    from transformers import AutoTokenizer
    from rollout import Engine
    algo = cfg.algo.name
    torch.manual_seed(cfg.train.seed)
    os.makedirs(cfg.log.out_dir, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_rows, eval_rows = load_data(cfg)

    # Engine first: an in-process engine sets up its own single-process distributed state.
    engine = None
    if algo != "sft" or cfg.eval_only:
        own = {"auto": None, "inprocess": False, "own": True}[cfg.rollout.engine_process]
        engine = rank0_call(rank, world, lambda: Engine(
            model_dir, placement=cfg.rollout.placement, dtype=engine_dtype(cfg, device), seed=cfg.train.seed,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, max_model_len=cfg.rollout.max_model_len,
            own_process=own, kv_cache_tokens=kv_cache_tokens(cfg, tokenizer, train_rows + eval_rows)), share=False)
    logger = Logger(cfg, rank)
    if cfg.eval_only:
        metrics = rank0_call(rank, world, lambda: evaluate(engine, tokenizer, eval_rows, cfg, cfg.train.seed))
        if cfg.teacher_gap:
            metrics.update(rank0_call(rank, world, lambda: teacher_gap(engine, tokenizer, eval_rows, cfg, cfg.train.seed)))
        logger.log(0, metrics)
        logger.close()
        return metrics

    if cfg.ttt_prompts:
        return test_time_self_distillation(cfg, model_dir, engine, tokenizer, eval_rows, logger, rank, world, device)
    policy, optimizer, scheduler, teacher = build_trainer(cfg, model_dir, world, device)
    start_step = 0
    if cfg.train.resume:
        start_step = load_checkpoint(cfg.train.resume, policy, optimizer, teacher)
    sync = lambda: sync_engine(cfg, engine, policy, tokenizer, rank, world, device)

    if start_step > 0 and algo != "sft":
        sync()
    metrics = {}
    if algo != "sft" and cfg.train.eval_every and start_step == 0:
        metrics = rank0_call(rank, world, lambda: evaluate(engine, tokenizer, eval_rows, cfg, cfg.train.seed))
        logger.log(0, metrics)

    nonfinite = [0]  # consecutive optimizer steps skipped for a NaN/inf loss or gradient
    progress = logger.progress(start_step, cfg.train.steps)
    for step in range(start_step, cfg.train.steps):
        t_step = time.perf_counter()
        metrics = {"step": step + 1}
        # 1. sample prompts
        rows = batch_rows(train_rows, step, cfg.train.prompts_per_step, cfg.train.seed)
        # 2-4. generate, score, build teacher contexts (rank 0), then share with every rank
        t0 = time.perf_counter()
        if algo == "sft":
            rollouts = sft_rollouts(tokenizer, rows, cfg, step)
        else:
            rollouts = rank0_call(rank, world, lambda: prepare_rollouts(engine, tokenizer, rows, cfg, step, metrics))
            if rank == 0:
                metrics.update(rollouts[1])
            rollouts = rollouts[0]
        metrics["time/rollout_s"] = time.perf_counter() - t0

        # 5. update: mini-batches of micro-batches, this rank's share of each
        t0 = time.perf_counter()
        sums, stepped, grad_norms, teacher_seconds = update_policy(
            cfg, policy, optimizer, scheduler, teacher, rollouts, step, pad_id, device, rank, world, nonfinite)
        metrics["time/train_s"] = time.perf_counter() - t0 - teacher_seconds
        metrics["time/teacher_s"] = teacher_seconds

        # 6. update the teacher (EMA only after a real optimizer step)
        if teacher is not None:
            teacher.update(policy, stepped)
        # 7. sync weights into the engine, with proof
        if algo != "sft":
            metrics.update(sync())
        # 8. log
        metrics.update(reduce_stats(sums, world, algo, len(grad_norms)))
        metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["actor/lr"] = scheduler.get_last_lr()[0]
        metrics["time/step_s"] = time.perf_counter() - t_step
        metrics["throughput/tokens_per_s"] = sum(len(r.prompt_ids) + len(r.response_ids) for r in rollouts) / metrics["time/step_s"]
        if algo != "sft" and cfg.train.eval_every and ((step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps):
            metrics.update(rank0_call(rank, world, lambda: evaluate(engine, tokenizer, eval_rows, cfg, cfg.train.seed)))
        logger.log(step + 1, metrics)
        progress.update(metrics)
        if cfg.train.save_every and (step + 1) % cfg.train.save_every == 0:
            save_checkpoint(os.path.join(cfg.log.out_dir, f"checkpoint-{step + 1}"), policy, optimizer, teacher, step + 1)
    progress.close()
    save_hf(os.path.join(cfg.log.out_dir, "final"), policy, tokenizer, world, rank)
    logger.close()
    if engine is not None:
        engine.close()
    return metrics


def test_time_self_distillation(cfg: Config, model_dir: str, engine, tokenizer, rows: list, logger, rank: int,
                                world: int, device) -> dict:
    """Paper section 5: repeated SDPO steps on one hard question alone, against best-of-k.

    Hard questions: the first --ttt_prompts held-out rows with no success among
    --rollout.eval_k samples of the initial model at --rollout.temperature. For each, from
    the initial weights: best-of-k draws k = train.steps * rollout.n samples; self-distillation
    runs up to train.steps steps of rollout.n samples on the question alone (teacher contexts
    from the feedback, and from a success once there is one). Each logs the generations
    until its first success (-1: none within k); the summary is discovery@k, the fraction of
    questions solved within k generations, for k = n, 2n, ..., train.steps * n.
    """
    n, steps = cfg.rollout.n, cfg.train.steps
    budget, pad_id = n * steps, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    first_success = lambda rollouts: next((i + 1 for i, r in enumerate(rollouts)
                                           if r.reward >= cfg.sdpo.success_threshold), None)
    screen = rank0_call(rank, world, lambda: generate_and_score(
        engine, tokenizer, rows, cfg, cfg.train.seed * 1000 + 999_999, cfg.rollout.eval_k, cfg.rollout.temperature))
    k = cfg.rollout.eval_k
    hard = [row for i, row in enumerate(rows) if first_success(screen[i * k:(i + 1) * k]) is None][:cfg.ttt_prompts]
    if rank == 0 and len(hard) < cfg.ttt_prompts:
        print(f"ttt: only {len(hard)} of {len(rows)} held-out prompts have no success in {k} samples", file=sys.stderr)
    found = {"ttt": [], "best_of_k": []}
    for i, row in enumerate(hard):
        policy, optimizer, scheduler, teacher = build_trainer(cfg, model_dir, world, device)
        metrics = sync_engine(cfg, engine, policy, tokenizer, rank, world, device)  # the initial weights again
        best = rank0_call(rank, world, lambda: generate_and_score(
            engine, tokenizer, [row], cfg, cfg.train.seed * 1000 + 500_000 + i, budget, cfg.rollout.temperature))
        found["best_of_k"].append(first_success(best))
        found["ttt"].append(None)
        nonfinite = [0]  # consecutive non-finite optimizer steps on this prompt
        for step in range(steps):
            rollouts, step_metrics = rank0_call(rank, world, lambda: prepare_rollouts(
                engine, tokenizer, [row], cfg, (i + 1) * 1000 + step, {}))
            at = first_success(rollouts)
            if at is not None:
                found["ttt"][-1] = step * n + at
                break
            _, stepped, _, _ = update_policy(cfg, policy, optimizer, scheduler, teacher, rollouts, step, pad_id,
                                             device, rank, world, nonfinite)
            if teacher is not None:
                teacher.update(policy, stepped)
            metrics.update(sync_engine(cfg, engine, policy, tokenizer, rank, world, device))
        logger.log(i + 1, {"ttt/prompt": i, "ttt/discovered_at": found["ttt"][-1] or -1,
                           "best_of_k/discovered_at": found["best_of_k"][-1] or -1,
                           "sync/probe_max_abs_diff": metrics["sync/probe_max_abs_diff"]})
    summary = {"ttt/prompts": len(hard)}
    for kind, ats in found.items():
        for j in range(1, steps + 1):
            summary[f"{kind}/discovery@{j * n}"] = sum(a is not None and a <= j * n for a in ats) / max(len(ats), 1)
    logger.log(len(hard) + 1, summary)
    logger.close()
    engine.close()
    return summary


def build_trainer(cfg: Config, model_dir: str, world: int, device):
    """Policy (FSDP2-sharded when world > 1), AdamW with linear warmup, and the teacher."""
    policy = load_policy(model_dir, cfg, world, device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.optim.lr,
                                  betas=(cfg.optim.beta1, cfg.optim.beta2), weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    teacher = None
    if cfg.algo.name in ("sdpo", "hybrid"):
        needs_copy = cfg.sdpo.teacher != "live"
        teacher_copy = load_policy(model_dir, cfg, world, device) if needs_copy else None
        teacher = Teacher(cfg.sdpo.teacher, cfg.sdpo.teacher_rate, teacher_copy)
    return policy, optimizer, scheduler, teacher


def lr_factor(cfg: Config, step: int) -> float:
    """The learning rate's multiplier at optimizer step `step` (0-based): linear warmup, then
    constant or a linear decay that reaches 0 after the last of train.steps x mini_batches."""
    warmup = min(1.0, (step + 1) / max(cfg.optim.warmup_steps, 1))
    if cfg.optim.decay == "none":
        return warmup
    total = cfg.train.steps * cfg.train.mini_batches
    return warmup * max(0.0, 1.0 - step / total)


def sync_engine(cfg: Config, engine, policy, tokenizer, rank: int, world: int, device) -> dict:
    """Load the policy's weights into the engine and prove it: the engine's log-probs of a
    fixed probe must match the trainer's within --rollout.sync_tol (rollout.py)."""
    from rollout import probe_ids
    t0 = time.perf_counter()
    state = full_state_dict(policy, world)
    probe = probe_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    probe_packed = pack([probe], [len(probe) - 1], pad_id, device)
    with torch.no_grad():
        probe_lp = policy(*_model_inputs(probe_packed), lambda h, w: token_stats(h, w, probe_packed.targets, 1.0)[0])
    reshard(policy)
    tol = cfg.rollout.sync_tol or (1e-3 if engine_dtype(cfg, device) == "float32" else 1.0)
    result = rank0_call(rank, world, lambda: engine.update_weights(state, probe, probe_lp.cpu(), tol))
    return {"sync/seconds": time.perf_counter() - t0, "sync/probe_max_abs_diff": result.probe_max_abs_diff}


def kv_cache_tokens(cfg: Config, tokenizer, rows: list) -> int:
    """Tokens of KV cache the run's generations need at once: vLLM runs at most
    MAX_CONCURRENT_SEQS sequences together, each a prompt and its response. Teacher-gap
    prompts carry a demonstration or feedback, so prompts are counted three times over.
    Too small a cache only makes vLLM schedule fewer sequences at a time."""
    if cfg.rollout.kv_cache_tokens:
        return cfg.rollout.kv_cache_tokens
    longest = max(len(data.chat_prompt_ids(tokenizer, r["messages"], cfg.data.max_prompt_len)) for r in rows[:256])
    per_sequence = min(3 * longest + cfg.rollout.max_tokens, cfg.rollout.max_model_len)
    sequences = max(cfg.train.prompts_per_step * cfg.rollout.n, cfg.data.eval_rows * cfg.rollout.eval_k)
    return min(sequences, MAX_CONCURRENT_SEQS) * per_sequence


MAX_CONCURRENT_SEQS = 256  # vLLM's default max_num_seqs


def engine_dtype(cfg: Config, device) -> str:
    # Never vLLM's "auto": it silently runs a float32 checkpoint in half precision.
    return cfg.rollout.dtype or ("bfloat16" if device.type == "cuda" else "float32")


def update_policy(cfg: Config, policy, optimizer, scheduler, teacher, rollouts: list[Rollout], step: int, pad_id: int,
                  device, rank: int, world: int, nonfinite: list):
    """One rollout batch's update: cfg.train.mini_batches optimizer steps, each accumulating
    this rank's micro-batches. Returns (summed stats, whether any step was taken, grad norms,
    teacher seconds)."""
    algo = cfg.algo.name
    policy.train()
    order = list(range(len(rollouts)))
    random.Random(cfg.train.seed * 1000003 + step).shuffle(order)
    old_logprobs = compute_old_logprobs(cfg, policy, rollouts, pad_id, device, rank, world) \
        if cfg.train.mini_batches > 1 else None
    sums, stepped, grad_norms, teacher_seconds = {}, False, [], 0.0
    if teacher is not None:
        teacher.head_weight_source()  # a collective under FSDP2: gathered here, on every rank at once
    for mb_indices in split_evenly(order, cfg.train.mini_batches):
        counts = step_counts([rollouts[i] for i in mb_indices], algo)
        # The order of micro-batches within an optimizer step does not change its gradient:
        # keep each prompt's samples together so they share their teacher prompt's forward.
        mb_indices = sorted(mb_indices)
        mine = rank_share(mb_indices, rank, world)
        micro = [mine[i:i + cfg.train.micro_batch] for i in range(0, len(mine), cfg.train.micro_batch)]
        micro = pad_microbatch_count(micro, mb_indices, cfg.train.micro_batch, world)
        finite = True
        for j, idx in enumerate(micro):
            batch = [rollouts[i] for i in idx]
            with no_sync_unless(policy, world, last=j == len(micro) - 1):
                if not batch:  # this rank has fewer rollouts: take part with a zero loss
                    if teacher is not None:  # and in the teacher's collectives
                        teacher_hidden_states(cfg, policy, teacher, [], pad_id, device, world)
                    loss, stats = zero_loss(policy, device, pad_id)
                else:
                    loss, stats = microbatch_loss(cfg, policy, teacher, batch, counts, pad_id, device,
                                                  None if old_logprobs is None else [old_logprobs[i] for i in idx])
                finite &= bool(torch.isfinite(loss).item())
                (loss * world).backward()  # FSDP2 averages gradients over ranks; the counts are global
            teacher_seconds += stats.pop("teacher_seconds", 0.0)
            for k, v in stats.items():
                sums[k] = max(sums.get(k, 0.0), v) if k.endswith("_max") else sums.get(k, 0.0) + v
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.optim.grad_clip)
        grad_norm = float(full_tensor(grad_norm))
        grad_norms.append(grad_norm)
        if finite and math.isfinite(grad_norm):
            optimizer.step()
            scheduler.step()
            stepped = True
            nonfinite[0] = 0
        else:
            nonfinite[0] += 1
            if nonfinite[0] >= cfg.train.max_nonfinite_steps:
                raise FloatingPointError(
                    f"step {step + 1}: loss or gradient norm not finite for {nonfinite[0]} optimizer steps "
                    f"in a row (last grad norm {grad_norm}); lower --optim.lr or check the data")
        optimizer.zero_grad(set_to_none=True)
    return sums, stepped, grad_norms, teacher_seconds


def prepare_rollouts(engine, tokenizer, rows, cfg: Config, step: int, metrics: dict):
    """Rank 0's part of a step: generate, score, advantages, teacher contexts; and its metrics."""
    algo = cfg.algo.name
    rollouts = generate_and_score(engine, tokenizer, rows, cfg, cfg.train.seed * 1000 + step,
                                  cfg.rollout.n, cfg.rollout.temperature)
    uids = [r.row["uid"] for r in rollouts]
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    group_ids = torch.tensor([uids.index(u) for u in uids])
    advantages = losses.grpo_advantages(rewards, group_ids, norm_by_std=cfg.algo.norm_adv_by_std)
    for r, a in zip(rollouts, advantages.tolist()):
        r.advantage = a
    out = {
        "reward/mean": rewards.mean().item(),
        "reward/success_rate": (rewards >= cfg.sdpo.success_threshold).float().mean().item(),
        "reward/errors": sum(bool(r.reward_error) for r in rollouts),
        "response/length_mean": sum(len(r.response_ids) for r in rollouts) / len(rollouts),
        "response/truncated_frac": sum(r.truncated for r in rollouts) / len(rollouts),
    }
    errors = [r for r in rollouts if r.reward_error]
    if errors:
        print(f"[step {step + 1}] {len(errors)} reward errors, e.g. {errors[0].row['source']}: {errors[0].reward_error}",
              file=sys.stderr)
    if algo in ("sdpo", "hybrid"):
        tb = sdpo.build_teacher_batch(tokenizer, [r.row for r in rollouts], [r.response_ids for r in rollouts],
                                      [r.text for r in rollouts], [r.reward for r in rollouts],
                                      [r.feedback for r in rollouts], cfg.sdpo)
        for r, ids, m in zip(rollouts, tb.input_ids, tb.mask):
            r.teacher_ids, r.sdpo_mask = ids, float(m)
        out.update(tb.metrics)
    return rollouts, out


def compute_old_logprobs(cfg, policy, rollouts, pad_id, device, rank, world) -> list:
    """Trainer log-probs of every rollout before the update (needed with several mini-batches)."""
    mine = list(range(len(rollouts)))[rank::world]
    local = {}
    with torch.no_grad():
        for i in range(0, len(mine), cfg.train.micro_batch):
            batch = [rollouts[j] for j in mine[i:i + cfg.train.micro_batch]]
            packed = pack([r.prompt_ids + r.response_ids for r in batch], [len(r.response_ids) for r in batch], pad_id, device)
            lp = policy(*_model_inputs(packed), lambda h, w: token_stats(h, w, packed.targets, cfg.rollout.temperature)[0])
            for j, (s, e) in zip(mine[i:i + cfg.train.micro_batch], _spans(batch)):
                local[j] = lp[s:e].tolist()
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
        for g in gathered:
            local.update(g)
    return [local[i] for i in range(len(rollouts))]


def zero_loss(policy, device, pad_id):
    """A forward/backward with zero loss, so a rank without data still joins FSDP's collectives."""
    packed = pack([[pad_id, pad_id]], [1], pad_id, device)
    out = policy(*_model_inputs(packed), lambda h, w: (h @ w.T).sum() * 0.0)
    return out, {}


def rank_share(items: list, rank: int, world: int) -> list:
    """This rank's contiguous part of items (sizes differ by at most one; may be empty)."""
    size, extra = divmod(len(items), world)
    start = rank * size + min(rank, extra)
    return items[start:start + size + (rank < extra)]


def pad_microbatch_count(micro, mb_indices, size, world):
    """Every rank must run the same number of forward/backward passes (FSDP collectives)."""
    most = max(math.ceil(len(rank_share(mb_indices, r, world)) / size) for r in range(world)) or 1
    return micro + [[] for _ in range(most - len(micro))]


@contextlib.contextmanager
def no_sync_unless(policy, world, last: bool):
    """Skip FSDP2's gradient reduce-scatter on all but the last micro-batch."""
    if world > 1:
        policy.set_requires_gradient_sync(last)
    yield


def split_evenly(items: list, parts: int) -> list[list]:
    if parts < 1 or parts > len(items):
        raise ValueError(f"--train.mini_batches={parts} must be between 1 and the {len(items)} rollouts of a step")
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + size + (p < extra)
        out.append(items[start:end])
        start = end
    return out


SUMMED = ("loss_sum", "tokens", "entropy_sum", "mismatch_kl_sum", "is_ratio_sum", "divergence_sum", "distill_tokens")


def reduce_stats(sums: dict, world: int, algo: str, optimizer_steps: int) -> dict:
    """Token-weighted means of the micro-batch sums over all ranks."""
    totals = torch.tensor([sums.get(k, 0.0) for k in SUMMED], dtype=torch.float64)
    is_max = torch.tensor([sums.get("is_ratio_max", 0.0)], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(totals)
        dist.all_reduce(is_max, op=dist.ReduceOp.MAX)
    total = dict(zip(SUMMED, totals.tolist()))
    tokens = max(total["tokens"], 1.0)
    out = {"actor/loss": total["loss_sum"] / optimizer_steps, "actor/entropy": total["entropy_sum"] / tokens, "rollout/mismatch_kl": total["mismatch_kl_sum"] / tokens,
           "is/ratio_mean": total["is_ratio_sum"] / tokens, "is/ratio_max": is_max.item()}
    if algo == "sdpo":
        out["sdpo/divergence"] = total["divergence_sum"] / max(total["distill_tokens"], 1.0)
    if algo == "sft":  # references have no engine log-probs to compare with
        out = {k: out[k] for k in ("actor/loss", "actor/entropy")}
    return out


def batch_rows(rows: list, step: int, n: int, seed: int) -> list:
    """The prompts of a step: epochs of seeded permutations, so a resumed run sees the same order."""
    start = step * n
    out = []
    while len(out) < n:
        epoch, offset = divmod(start + len(out), len(rows))
        order = list(range(len(rows)))
        random.Random(seed * 7919 + epoch).shuffle(order)
        out.append(rows[order[offset]])
    return out


def load_data(cfg: Config):
    d = cfg.data
    if d.task in data.TASKS:
        return (data.task_rows(d.task, "train", d.train_rows, seed=cfg.train.seed, cfg=d),
                data.task_rows(d.task, "test", d.eval_rows, cfg=d))
    rows = data.load_rows(d.task, d.fields, d.reward or "math")
    if d.eval_path:
        return rows, data.load_rows(d.eval_path, d.fields, d.reward or "math", limit=d.eval_rows)
    split = lambda r: data._split_of(r["uid"], d.heldout_percent)
    return [r for r in rows if split(r) == "train"], [r for r in rows if split(r) == "test"][:d.eval_rows]


# ----------------------------------------------------------------------------------------
# Checkpoints and logging


def save_checkpoint(path, policy, optimizer, teacher, step):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optim_state = get_state_dict(policy, optimizer)
    state = {"policy": model_state, "optimizer": optim_state,
             "meta": {"step": step, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}}
    if teacher is not None and teacher.copy is not None:
        state["teacher"] = teacher.copy.state_dict()
    dcp.save(state, checkpoint_id=path)


def load_checkpoint(path, policy, optimizer, teacher) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optim_state = get_state_dict(policy, optimizer)
    state = {"policy": model_state, "optimizer": optim_state, "meta": {"step": 0, "torch_rng": torch.get_rng_state(),
                                                                         "python_rng": random.getstate()}}
    if teacher is not None and teacher.copy is not None:
        state["teacher"] = teacher.copy.state_dict()
    dcp.load(state, checkpoint_id=path)
    set_state_dict(policy, optimizer, model_state_dict=state["policy"], optim_state_dict=state["optimizer"])
    if "teacher" in state:
        teacher.copy.load_state_dict(state["teacher"])
        teacher._head = None
    torch.set_rng_state(state["meta"]["torch_rng"])
    random.setstate(state["meta"]["python_rng"])
    return int(state["meta"]["step"])


def save_hf(path, policy, tokenizer, world, rank):
    """An ordinary HF directory (transformers and vLLM load it)."""
    state = full_state_dict(policy, world)
    if rank == 0:
        policy.hf.save_pretrained(path, state_dict=state)
        tokenizer.save_pretrained(path)
    if world > 1:
        dist.barrier()


class Logger:
    """metrics.jsonl, wandb (offline unless asked) and a progress bar, on rank 0."""

    def __init__(self, cfg: Config, rank: int):
        self.rank, self.cfg, self.run = rank, cfg, None
        if rank != 0:
            return
        os.makedirs(cfg.log.out_dir, exist_ok=True)
        self.file = open(os.path.join(cfg.log.out_dir, "metrics.jsonl"), "a")
        if cfg.log.wandb_mode != "disabled":
            import wandb
            self.run = wandb.init(project=cfg.log.wandb_project, name=cfg.log.run_name or None, mode=cfg.log.wandb_mode,
                                  dir=cfg.log.out_dir, config=dataclasses.asdict(cfg), reinit="finish_previous")

    def log(self, step: int, metrics: dict):
        if self.rank != 0:
            return
        record = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.run is not None:
            self.run.log(record, step=step)

    def progress(self, start, total):
        return Progress(start, total, self.rank == 0 and self.cfg.log.progress, self.cfg.algo.name)

    def close(self):
        if self.rank == 0:
            self.file.close()
            if self.run is not None:
                self.run.finish()


class Progress:
    SHOWN = {"reward/mean": "reward", "reward/success_rate": "success", "eval/success_rate": "eval",
             "sdpo/teacher_coverage": "coverage", "sdpo/divergence": "div", "time/step_s": "s/step"}

    def __init__(self, start, total, enabled, desc):
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True)

    def update(self, metrics):
        if self.bar is not None:
            self.bar.set_postfix({short: f"{metrics[k]:.3g}" for k, short in self.SHOWN.items() if k in metrics})
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------------------
# Entry point


def resolve_model(cfg: Config, rank: int, world: int, device) -> str:
    """The model to train: --model.path, or the tiny model after its cached SFT warm start."""
    if cfg.model.path:
        return cfg.model.path
    tiny = rank0_call(rank, world, lambda: data.tiny_model_dir(cfg.model.tiny))
    if not cfg.train.warm_start_steps or cfg.algo.name == "sft":
        return tiny
    # The warm start is `--algo sft` with the train.warm_start_* values, one optimizer step per
    # batch; the cache key holds only what it reads, so runs that differ in RL-only flags (the
    # RL lr, seed, prompts per step, mini-batches, eval rows, ...) share one warm start.
    warm_train = dict(steps=cfg.train.warm_start_steps, prompts_per_step=cfg.train.warm_start_batch,
                      micro_batch=cfg.train.micro_batch, seed=cfg.train.warm_start_seed, mini_batches=1,
                      eval_every=0, save_every=0, resume="",
                      **{f.name: getattr(cfg.train, f.name) for f in dataclasses.fields(TrainConfig)
                         if f.name.startswith("warm_start")})
    warm = dataclasses.replace(
        cfg, algo=AlgoConfig(name="sft"), rollout=RolloutConfig(),
        # decayed to 0: the warm start's last weights are all that is kept
        optim=dataclasses.replace(cfg.optim, lr=cfg.train.warm_start_lr, decay="linear"),
        train=dataclasses.replace(cfg.train, **warm_train), log=dataclasses.replace(cfg.log, wandb_mode="disabled"),
        eval_only=False, ttt_prompts=0)  # those modes are for the RL run, not its warm start
    templates = {k: getattr(cfg.sdpo, k) for k in ("reprompt_template", "solution_template", "feedback_template",
                                                     "max_reprompt_len")}
    train_data = {k: v for k, v in dataclasses.asdict(warm.data).items() if k not in ("eval_rows", "eval_path")}
    recipe = json.dumps([tiny, templates, train_data, warm_train, dataclasses.asdict(warm.optim)], sort_keys=True)
    import hashlib
    path = tiny + "-sft-" + hashlib.sha1(recipe.encode()).hexdigest()[:10]
    if not os.path.exists(os.path.join(path, "final", "config.json")):
        if rank == 0:
            print(f"warm start: {cfg.train.warm_start_steps} SFT steps on the task's references -> {path}")
        train(dataclasses.replace(warm, log=dataclasses.replace(warm.log, out_dir=path)), tiny, rank, world, device)
    return os.path.join(path, "final")


def parse_config(argv=None) -> Config:
    """Flags -> Config. Booleans take a value (--sdpo.add_tail=False), as sweep agents pass them."""
    import re
    import tyro
    argv = sys.argv[1:] if argv is None else list(argv)
    argv = [re.sub(r"=(true|false)$", lambda m: "=" + m.group(1).capitalize(), a, flags=re.I) for a in argv]
    return tyro.cli(Config, args=argv, config=(tyro.conf.FlagConversionOff,))


def main(argv=None):
    cfg = parse_config(argv)
    rank, world, device = setup_distributed()
    t0 = time.perf_counter()
    model_dir = resolve_model(cfg, rank, world, device)
    metrics = train(cfg, model_dir, rank, world, device)
    if rank == 0:
        shown = {k: round(v, 4) for k, v in metrics.items() if k.startswith(("eval/", "reward/"))}
        print(f"done in {time.perf_counter() - t0:.0f}s: {shown} -> {cfg.log.out_dir}")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return metrics


if __name__ == "__main__":
    main()

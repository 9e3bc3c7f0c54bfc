"""Train a causal LM with SDPO, GRPO, GSPO, the λ-hybrid, online DPO / SPIN or SFT, on rollouts from vLLM.

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
import functools
import gc
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch
import torch.distributed as dist

import data
import feedback
import losses
import objectives
import sdpo
from objectives import Dist, Models, Rollout
from rollout import EngineError, engine_state
from discriminator import Critic
from teacher import Reference, Teacher, full_tensor, reshard

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
    reward_kwargs: str = ""  # JSON keyword arguments of the reward function, e.g. '{"cpu_seconds": 10}' (code)
    allow_weak_sandbox: bool = False  # run model-written code even where the sandbox cannot isolate it
    # (no bubblewrap, no namespaces: README, The code sandbox); without it --data.reward code refuses
    train_rows: int = 4000  # rows drawn from a synthetic task
    # held-out rows (a synthetic task: at most this many, fewer where its split has fewer). The rows are
    # the draws: at 2048 the paired standard error of a 40-step gain is ~0.8 points (README: Quick start)
    eval_rows: int = 2048
    max_prompt_len: int = 1024


@dataclass
class RolloutConfig:
    placement: Literal["colocated", "separate"] = "colocated"
    engine_process: Literal["auto", "inprocess", "own"] = "auto"
    dtype: str = ""  # engine dtype; empty: float32 on CPU (exact sync checks), bfloat16 on GPU
    n: int = 8  # samples per prompt
    temperature: float = 1.0
    # A chat model's direct answer (no long reasoning) fits in 256 (TRL's default): 32 truncated
    # 98% of SmolLM2-135M-Instruct's strops answers, and truncation scores 0. The tiny model's
    # answers end after a few tokens, so its runs do not pay for the larger limit.
    max_tokens: int = 256
    gpu_memory_utilization: float = 0.3  # GPU memory fraction (on CPU only without kv_cache_tokens)
    kv_cache_tokens: int = 0  # on CPU: tokens the engine's KV cache holds; 0: sized from the run's batches
    max_model_len: int = 2048
    sync_tol: float = 0.0  # max |engine - trainer| probe log-prob (nats) after a sync; 0: 1e-3 for a
    # float32 engine, 1.0 for bfloat16 (README: what holds)
    is_correction: bool = True  # truncated IS weights for the engine-vs-trainer mismatch (and the staleness
    # of --train.off_policy_steps 1)
    is_cap: float = 2.0
    is_level: Literal["token", "sequence"] = "token"
    eval_temperature: float = 0.6
    eval_k: int = 4  # avg@k
    # The held-out evaluation's sampling seed, not --train.seed: runs of every training seed then
    # draw the same samples from the same weights at step 0, so their curves start together and
    # differ by what training did (the seed spread of bench/learning.py), not by the eval's draws
    eval_seed: int = 0
    rpc_timeout_s: float = 600.0  # longest wait for a weight load into the engine


@dataclass
class AlgoConfig:
    # the choices are the rows of objectives.OBJECTIVES
    name: Annotated[Literal[tuple(objectives.OBJECTIVES)],
                    __import__("tyro").conf.arg(name="algo", prefix_name=False)] = "sdpo"
    lam: float = 0.9  # hybrid: A = lam * A_grpo + (1 - lam) * A_sdpo
    # GRPO std normalisation; default: off (Dr. GRPO, as in the SDPO runs), except for GAD, whose
    # discriminator score has no fixed scale
    norm_adv_by_std: bool | None = None
    eps_low: float = 0.2  # PPO clip
    eps_high: float = 0.2  # 0.28 for DAPO's clip-higher
    gspo_eps_low: float = 3e-4  # GSPO clips a sequence-level ratio: far narrower ranges
    gspo_eps_high: float = 4e-4
    kl_coef: float = 0.001  # GAD: weight of the KL to the initial policy (SPEC 6: k3, 0.001)
    kl_type: Literal[tuple(k + p for k in losses.KL_KINDS for p in ("", "+"))] = "k3"  # "+": k2's gradient
    kl_in_reward: bool = False  # GAD: subtract kl_coef * the sequence's KL from the reward instead of a loss term
    loss_agg_mode: Literal["auto", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "auto"  # auto: seq-mean-token-mean for GSPO, else token-mean


@dataclass
class SdpoArgs(sdpo.SdpoConfig):
    distill: Literal["topk", "full", "token"] = "topk"
    topk: int = 100
    add_tail: bool = True
    # 0 forward KL, 1 reverse KL, between: generalized JSD. Unset (None): the task's, SDPO_ALPHAS
    # (quiz 1.0, the paper's rich-feedback choice, SPEC 8), else 0.5 (its no-feedback one)
    alpha: float | None = None
    is_clip: float = 2.0
    chunked: bool = True  # top-K loss from hidden states, never materialising [tokens, vocab]
    chunk_size: int = 512
    teacher: Literal["ema", "frozen", "trust-region", "live"] = "ema"
    teacher_rate: float = 0.05
    teacher_micro_batch: int = 32
    share_teacher_prefix: bool = True  # run each distinct teacher prompt once per micro-batch (KV cache reuse)


@dataclass
class DpoConfig:
    """Online DPO (pairs among a prompt's samples) and SPIN (the row's reference over each sample)."""
    pairs: Literal["best_worst", "all"] = "best_worst"  # per prompt: best sample over worst, or every pair
    # with a reward difference
    chosen: Literal["sample", "reference"] = "sample"  # reference: SPIN, the row's reference is always chosen
    loss_type: Literal[losses.DPO_KINDS] = "sigmoid"  # sigmoid, ipo (length-normalised log-probs), hinge, robust
    beta: float = 0.1
    label_smoothing: float = 0.0  # ε of sigmoid (conservative DPO) and robust; < 0.5
    ref_update_every: int = 0  # the reference becomes the policy every N steps (SPIN's iterations); 0: never
    reference_free: bool = False  # no reference model: the log-ratios are the policy's log-probs alone

    def __post_init__(self):
        if self.beta <= 0 or not 0 <= self.label_smoothing < 0.5 or self.ref_update_every < 0:
            raise ValueError(f"--dpo: need beta > 0 (got {self.beta}), 0 <= label_smoothing < 0.5 "
                             f"(got {self.label_smoothing}), ref_update_every >= 0 (got {self.ref_update_every})")
        if self.reference_free and self.ref_update_every:
            raise ValueError("--dpo.reference_free has no reference to refresh: drop --dpo.ref_update_every")


@dataclass
class GadConfig:
    """GAD (--algo gad): the discriminator and the two stages (README: GAD)."""
    disc_path: str = ""  # a local HF directory for the discriminator's backbone; empty: the student's start
    # The discriminator's AdamW lr (the paper's 1e-6 is for 8B models); weight decay and betas are --optim's
    lr: float = 1e-4
    grad_clip: float = 1.0  # the discriminator's gradient-norm clip
    policy_loss: Literal["ppo", "gspo"] = "ppo"  # the student's clipped surrogate
    warmup_steps: int = 0  # stage 1: SFT of the student on the teacher's responses while the discriminator trains
    critic_warmup: int = 0  # then this many steps train only the discriminator
    # On a synthetic task the rows have no teacher_response: the project makes a black-box teacher,
    # the tiny model after this many SFT steps on the task's references (the student's start has
    # train.warm_start_steps), and writes its sampled text to a JSONL file (cached, README: GAD).
    teacher_steps: int = 1000
    teacher_temperature: float = 0.6  # the self-made teacher's sampling temperature

    def __post_init__(self):
        if self.lr <= 0 or self.grad_clip <= 0 or self.warmup_steps < 0 or self.critic_warmup < 0:
            raise ValueError(f"--gad: need lr > 0 (got {self.lr}), grad_clip > 0 (got {self.grad_clip}), "
                             f"warmup_steps, critic_warmup >= 0 (got {self.warmup_steps}, {self.critic_warmup})")


@dataclass
class OptimConfig:
    # Unset (None): the task's and objective's, RL_LRS (quiz: SDPO 1.2e-4, GRPO 6e-5, others
    # 3e-5), else 1e-4. The paper's 1e-5 is for 8B models; the tiny model needs more.
    lr: float | None = None
    warmup_steps: int = 2
    decay: Literal["none", "linear"] = "none"  # linear: to 0 at train.steps (the warm start always decays)
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8  # AdamW's; larger damps the steps of parameters whose gradient is ~0 and noisy


@dataclass
class TrainConfig:
    steps: int = 40
    prompts_per_step: int = 16
    mini_batches: int = 4  # optimizer steps per rollout batch (SPEC 8: 1 without feedback, 32 with rich feedback)
    micro_batch: int = 32  # sequences per forward/backward on each rank
    # > 0: each rank's micro-batches are filled in order of length up to this many padded
    # tokens (sequences x the longest), micro_batch sequences at most: less padding when
    # lengths vary. The gradient is the same (the loss is normalised by the step's counts).
    micro_batch_tokens: int = 0
    share_prompt_prefix: bool = True  # old/reference log-probs: a group's prompt runs once (KV cache reuse)
    # GRPO/GSPO/DPO/SFT/GAD log-probs from hidden states this many rows of logits at a time, never
    # [tokens, vocab] (losses.token_logprobs_from_hidden); 0: plain autograd on the full logits
    head_chunk_size: int = 512
    seed: int = 0
    # Unset (None): the task's recipe, WARM_START_RECIPES (strops 200 steps, 0.7, 0.1; quiz 2000, 0.3, 0.5,
    # target 0.3, 300 context steps)
    warm_start_steps: int | None = None  # built-in SFT of the tiny model on the task's references (cached)
    # > 0: the warm start ends early, at the first check (every warm_start_check_every steps)
    # where the bare student's held-out success, estimated without sampling
    # (run.reference_success), reaches this. A step count alone lands where float rounding
    # takes it: 1,000 quiz steps left the student at 38.7% in one build and 88.5% in another.
    warm_start_target: float | None = None
    warm_start_check_every: int = 10
    # The first this many warm-start steps show every prompt as a teacher context (the shares
    # above, rescaled to sum to 1): copying what a context shows forms before the facts are
    # learnt, instead of in a race with them (quiz: README, Does it work?)
    warm_start_context_steps: int | None = None
    warm_start_batch: int = 32
    warm_start_lr: float = 2e-3
    warm_start_seed: int = 0  # one warm start serves every RL seed
    # its micro_batch_tokens: teacher contexts beside plain prompts leave a batch ~40% padding
    warm_start_micro_batch_tokens: int = 4096
    # Shares of warm-start examples whose prompt is a teacher context (sdpo.py's templates)
    # with the reference as the correct solution, or with a wrong attempt's feedback: they
    # teach the tiny model to use what SDPO's teacher is shown.
    warm_start_demo_frac: float | None = None
    warm_start_feedback_frac: float | None = None
    eval_every: int = 40  # and at the start and the end; 0: never
    # 1: the engine generates the next batch, with the weights before this update, while the
    # trainer learns from this one (one step stale; the engine correction covers it: README)
    off_policy_steps: Literal[0, 1] = 0
    save_every: int = 0  # torch.distributed.checkpoint every N steps; 0: only the final HF model
    resume: str = ""  # a checkpoint directory written by save_every, or a run's out_dir (its latest one)
    max_nonfinite_steps: int = 3  # consecutive optimizer steps with a NaN/inf loss before stopping

    def __post_init__(self):
        if self.warm_start_target is not None and not 0 <= self.warm_start_target <= 1:
            raise ValueError(f"--train.warm_start_target={self.warm_start_target}: a success rate, 0 to 1 (0: off)")
        if self.warm_start_context_steps is not None and self.warm_start_context_steps < 0:
            raise ValueError(f"--train.warm_start_context_steps={self.warm_start_context_steps}: must be >= 0")
        if self.warm_start_check_every < 1:
            raise ValueError(f"--train.warm_start_check_every={self.warm_start_check_every}: must be at least 1")


@dataclass
class LogConfig:
    out_dir: str = "runs/default"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "sdpo"
    run_name: str = ""
    progress: bool = True
    # Generated samples (prompt, response, reward, feedback) logged each step to
    # <out_dir>/samples.jsonl and to the wandb run as a table, one per prompt from the first; 0: none
    samples_per_step: int = 4


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    sdpo: SdpoArgs = field(default_factory=SdpoArgs)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    gad: GadConfig = field(default_factory=GadConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval_only: bool = False  # evaluate --model.path (avg@k, length, truncation) and exit
    teacher_gap: bool = False  # with eval_only: also success with the reference as a demonstration / with feedback,
    # and teacher vs student entropy on the model's own samples (context_entropies)
    # Test-time self-distillation (paper section 5): train on each of this many held-out prompts
    # that the initial model fails, alone, and compare discovery with best-of-k; 0: off
    ttt_prompts: int = 0


# ----------------------------------------------------------------------------------------
# Distributed setup and the policy module


def setup_distributed() -> Dist:
    """Under torchrun: gloo on CPU, NCCL on GPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        from datetime import timedelta
        # A dead peer must surface as an error, not an endless wait.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=30))
    return Dist(dist.get_rank() if world > 1 else 0, world, device)


def end_distributed(d: Dist):
    """The end of a torchrun process: every rank here, then the process group destroyed.

    Called once the models are out of scope: gc first, so that FSDP2's states and the
    collectives' work handles caught in reference cycles are freed while the process group
    is alive, not during interpreter teardown, where gloo's threads can abort the process.
    """
    if d.world > 1:
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


class CausalLM(torch.nn.Module):
    """An HF causal LM whose forward ends in a caller's head(hidden [N, H], lm_head weight).

    The head runs inside forward so that FSDP2 has the root's (possibly tied) LM-head
    weight unsharded while the loss uses it, and reduce-scatters its gradient after.
    """

    def __init__(self, hf, vision: data.ImagePrompts | None = None):
        super().__init__()
        self.hf = hf
        self.vision = vision  # a vision-language model's image processor; None for a text model
        self.sharded = False  # FSDP2 (set by shard)

    def forward(self, packed: data.Packed, head):
        """Hidden states at packed's response positions, through head. packed.prefix: prompts
        shared by several sequences (data.pack_shared_prefix), run once, their KV cache
        copied to each sequence's row. packed.images: the sequences' pictures (see embed)."""
        if packed.images and self.vision is None:
            raise ValueError("sequences with images need a vision-language model")
        weight = self.hf.lm_head.weight
        if not self.unsharded_on_gpu():
            return head(self.response_hidden(packed), weight)
        # One process leaves the model unsharded, so FSDP2's MixedPrecisionPolicy (bf16 parameters)
        # never applies, and it trained in float32: 2.4x slower on an H100 at 0.5B
        # (bench/results/gpu.md). bf16 autocast over the network, and the head in bf16 as FSDP2
        # runs it; parameters, gradients and AdamW stay float32.
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = self.response_hidden(packed)
        return head(hidden.to(torch.bfloat16), weight.to(torch.bfloat16))

    def unsharded_on_gpu(self) -> bool:
        weight = self.hf.lm_head.weight
        return not self.sharded and weight.device.type == "cuda" and weight.dtype == torch.float32

    def response_hidden(self, packed: data.Packed) -> torch.Tensor:
        """The last hidden states [N, H] at packed's response positions."""
        if self.vision is not None:
            if packed.prefix is not None:
                raise ValueError("a vision-language model runs without a shared prefix (objectives.pack)")
            hidden = self.hf.model(attention_mask=packed.attention_mask, **self.embed(packed)).last_hidden_state
            return hidden.flatten(0, 1)[packed.hidden_index]
        past, positions, attention_mask = None, None, packed.attention_mask
        if packed.prefix is not None:
            prefix_ids, prefix_mask, prefix_positions, row = packed.prefix
            past = self.hf.model(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=prefix_positions,
                                 use_cache=True).past_key_values
            past.reorder_cache(row)
            positions = prefix_mask.sum(1)[row, None] + torch.arange(packed.input_ids.shape[1],
                                                                     device=packed.input_ids.device)
            attention_mask = torch.cat([prefix_mask[row], attention_mask], dim=1)
        hidden = self.hf.model(input_ids=packed.input_ids, attention_mask=attention_mask, position_ids=positions,
                               past_key_values=past, use_cache=packed.prefix is not None).last_hidden_state
        return hidden.flatten(0, 1)[packed.hidden_index]

    def embed(self, packed: data.Packed) -> dict:
        """A vision-language model's inputs: token embeddings with the vision tower's outputs
        in place of the pictures' tokens (packed.image_mask), and Qwen2-VL's 3-D rope
        positions. Built here rather than by the HF forward, which would put picture features
        on every image token, including ones the policy generated in a response; vLLM embeds
        those as text, and so does this."""
        model, ids = self.hf.model, packed.input_ids
        embeds = model.get_input_embeddings()(ids)
        if packed.images:
            pixels = self.vision.pixel_inputs(packed.image_mask, packed.images)
            features = model.get_image_features(pixels["pixel_values"].to(ids.device),
                                                pixels["image_grid_thw"].to(ids.device)).pooler_output
            embeds = embeds.masked_scatter(packed.image_mask[..., None].to(ids.device),
                                           torch.cat(features).to(embeds.dtype))
            positions, _ = model.get_rope_index(ids, mm_token_type_ids=packed.image_mask.long().to(ids.device),
                                                image_grid_thw=pixels["image_grid_thw"].to(ids.device),
                                                attention_mask=packed.attention_mask)
            return {"inputs_embeds": embeds, "position_ids": positions}
        if self.sharded:
            # FSDP2: each vision-tower block's all-gather and gradient reduce-scatter are
            # collectives, so a rank whose sequences have no picture (an idle rank, a text row)
            # runs the tower too, on a blank picture, and keeps it in the graph with weight 0.
            pixels = self.vision.pixel_inputs(*self.vision.blank())
            features = model.get_image_features(pixels["pixel_values"].to(ids.device),
                                                pixels["image_grid_thw"].to(ids.device)).pooler_output
            embeds = embeds + 0.0 * features[0].sum()
        return {"inputs_embeds": embeds}


def load_policy(model_dir: str, cfg: Config, world: int, device):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    vision = data.ImagePrompts(model_dir) if data.is_vision_language(model_dir) else None
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    hf = auto.from_pretrained(model_dir, dtype=torch.float32)
    if cfg.model.gradient_checkpointing:
        hf.gradient_checkpointing_enable()
    model = CausalLM(hf, vision).to(device)
    return shard(model, world, device)


def shard(model: CausalLM, world: int, device):
    """FSDP2: one unit per decoder layer and per vision-tower block, then the root
    (embeddings, norm, LM head, the vision tower's patch embedding and merger)."""
    if world == 1:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
    kwargs = {"mp_policy": mp} if mp else {}
    visual = getattr(model.hf.model, "visual", None)
    for layer in list(model.hf.get_decoder().layers) + list(visual.blocks if visual is not None else []):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    model.sharded = True
    return model


def full_state_dict(model: CausalLM, world: int) -> dict:
    """The whole HF-named state dict on rank 0 (every rank calls this), float32 on CPU."""
    if world == 1:
        state = {k: v.detach() for k, v in model.hf.state_dict().items()}
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(model.hf, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return engine_state(model.hf, state)  # the engine's names, and a tied lm_head.weight


# ----------------------------------------------------------------------------------------
# Rollouts


def rank0_call(d: Dist, fn, share: bool = True):
    """Run fn on rank 0 and hand its result (when share), or its error, to every rank (an
    EngineError stays one).

    Without this, an engine that dies on rank 0 leaves the other ranks waiting forever.
    """
    rank, world = d.rank, d.world
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except Exception as e:  # re-raised below, on every rank
            error = e
            if world > 1:
                # Now, not after unwinding: the other ranks exit first, and torchrun then stops
                # this one while it closes the engine, before Python prints the traceback.
                import traceback
                print("rank 0 failed:", "".join(traceback.format_exception(e)), file=sys.stderr, flush=True)
    if world > 1:
        box = [(result if share else None, None if error is None else f"{type(error).__name__}: {error}",
                isinstance(error, EngineError))]
        dist.broadcast_object_list(box, src=0)
        shared, message, engine_failed = box[0]
        result = shared if share or rank != 0 else result
        if message and rank != 0:
            raise (EngineError if engine_failed else RuntimeError)(f"rank 0 failed: {message}")
    if error is not None:
        raise error
    return result


def generate_and_score(engine, tokenizer, rows, cfg: Config, seed: int, n: int, temperature: float,
                       prompts: list | None = None):
    """Sample n responses per row and score them; one Rollout per sample, grouped by row.
    prompts: token ids to use instead of the rows' chat prompts."""
    prompts = prompts or [data.chat_prompt_ids(tokenizer, r["messages"], cfg.data.max_prompt_len) for r in rows]
    images = [r.get("images") for r in rows] if any(r.get("images") for r in rows) else None
    groups = engine.generate(prompts, n=n, temperature=temperature, max_tokens=cfg.rollout.max_tokens, seed=seed,
                             images=images)
    rollouts = [Rollout(row=row, prompt_ids=s.prompt_ids, response_ids=s.response_ids, rollout_logprobs=s.logprobs,
                        text=s.text, truncated=s.truncated, policy_version=s.policy_version)
                for row, samples in zip(rows, groups) for s in samples]
    rewards = feedback.score_batch(
        reward_function(cfg, rows[0]),
        [r.text for r in rollouts], [r.row for r in rollouts], [r.truncated for r in rollouts])
    for rollout, reward in zip(rollouts, rewards):
        rollout.reward, rollout.feedback, rollout.reward_error = reward.score, reward.feedback, reward.error
    return rollouts


def reward_function(cfg: Config, row: dict):
    """--data.reward (or the row's own), with --data.reward_kwargs bound."""
    fn = feedback.get_reward_fn(cfg.data.reward or row["reward"])
    if not cfg.data.reward_kwargs:
        return fn
    import functools
    try:
        kwargs = json.loads(cfg.data.reward_kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"--data.reward_kwargs is not a JSON object: {e}") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--data.reward_kwargs must be a JSON object, got {cfg.data.reward_kwargs!r}")
    return functools.partial(fn, **kwargs)


def evaluate(engine, tokenizer, rows, cfg: Config, before: list | None = None) -> tuple[dict, list]:
    """avg@k success and its standard error, mean response length and truncation rate on
    held-out rows; and each row's success. before: each row's success at an earlier
    evaluation of the same rows; then also the gain since and its paired standard error."""
    rollouts = generate_and_score(engine, tokenizer, rows, cfg, cfg.rollout.eval_seed, cfg.rollout.eval_k,
                                  cfg.rollout.eval_temperature)
    n = max(len(rollouts), 1)
    per_row = row_success(rollouts, cfg.rollout.eval_k, cfg)
    metrics = {
        "eval/success_rate": success_rate(rollouts, cfg),
        "eval/success_stderr": stderr(per_row),
        "eval/reward_mean": sum(r.reward for r in rollouts) / n,
        "eval/response_length": sum(len(r.response_ids) for r in rollouts) / n,
        "eval/truncated_frac": sum(r.truncated for r in rollouts) / n,
    }
    if before is not None and len(before) == len(per_row):
        metrics["eval/gain"], metrics["eval/gain_stderr"] = paired_gain(per_row, before)
    return metrics, per_row


def paired_gain(after: list[float], before: list[float]) -> tuple[float, float]:
    """Mean gain of per-row success between two evaluations of the same rows, and its
    standard error over the rows' differences (a row's difficulty is in both and cancels)."""
    gains = [a - b for a, b in zip(after, before)]
    return sum(gains) / max(len(gains), 1), stderr(gains)


def teacher_context_ids(tokenizer, row: dict, kind: str, rng: random.Random, cfg: Config) -> list[int] | None:
    """The row's prompt as SDPO's teacher sees it: with the reference as the demonstration
    ("demonstration"), or with the feedback on a plausible wrong attempt ("feedback"; None
    when the task has no wrong-answer generator or the feedback is empty)."""
    if kind == "demonstration":
        return sdpo.teacher_prompt_ids(tokenizer, row["messages"], row["reference"], None, cfg.sdpo)
    wrong = data.wrong_response(row, rng)
    if wrong is None:
        return None
    reward = feedback.score(reward_function(cfg, row), wrong, row, False)
    return sdpo.teacher_prompt_ids(tokenizer, row["messages"], None, reward.feedback, cfg.sdpo) if reward.feedback else None


def teacher_gap(engine, tokenizer, rows, cfg: Config) -> dict:
    """What SDPO relies on (the paper: it needs in-context ability): eval success of the
    model shown the reference as a demonstration, and shown a wrong attempt's feedback,
    next to eval/success_rate on the bare prompts. Sampled with --rollout.eval_seed."""
    seed = cfg.rollout.eval_seed
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


@torch.no_grad()
def context_entropies(engine, tokenizer, rows, cfg: Config, model_dir: str, device) -> dict:
    """SDPO's teacher on the model's own samples (the paper: SDPO needs in-context ability).

    Samples --rollout.n responses per row at the training temperature, builds their teacher
    contexts as a training step would (objectives.prepare_teacher_contexts: a successful
    sibling, else the feedback), and scores the same response tokens under the bare prompt
    (the student) and under each teacher context, with the model in model_dir as both. Per
    kind of context: the mean token entropy of student and teacher on those tokens, and the
    mean teacher-minus-student log-prob of the sampled tokens. A teacher flatter than the
    student (positive eval/teacher_minus_student_entropy) pulls the student towards a flatter
    distribution: distillation then raises the policy's entropy instead of sharpening it.
    """
    rollouts = generate_and_score(engine, tokenizer, rows, cfg, cfg.rollout.eval_seed, cfg.rollout.n,
                                  cfg.rollout.temperature)
    coverage = objectives.prepare_teacher_contexts(rollouts, tokenizer, cfg)["sdpo/teacher_coverage"]
    model = load_policy(model_dir, cfg, 1, device).eval()
    pad_id = pad_token_id(tokenizer)

    def score(seqs: list, response_lens: list) -> list:
        """(log-probs, entropies) of each sequence's response tokens."""
        out, size = [], cfg.train.micro_batch
        for i in range(0, len(seqs), size):
            packed = data.pack(seqs[i:i + size], response_lens[i:i + size], pad_id, device)
            lp, ent = objectives.forward(model, packed, lambda h, w: losses.logprobs_and_entropy_from_hidden(
                h, w, packed.targets, cfg.rollout.temperature, cfg.sdpo.chunk_size))
            ends = torch.tensor(response_lens[i:i + size]).cumsum(0).tolist()
            out += [(lp[e - n:e], ent[e - n:e]) for n, e in zip(response_lens[i:i + size], ends)]
        return out

    rollouts = [r for r in rollouts if r.response_ids]
    student = score([r.prompt_ids + r.response_ids for r in rollouts], [len(r.response_ids) for r in rollouts])
    out = {"eval/entropy_student": float(torch.cat([e for _, e in student]).mean()) if student else 0.0}
    used = [j for j, r in enumerate(rollouts) if r.sdpo_mask > 0]
    teacher = dict(zip(used, score([rollouts[j].teacher_ids for j in used], [len(rollouts[j].response_ids) for j in used])))
    cat = lambda pairs, k: torch.cat([p[k] for p in pairs])
    for kind in ("demonstration", "feedback", "any"):
        chosen = [j for j in used if kind in ("any", rollouts[j].teacher_context)]
        if not chosen:
            continue
        s_pairs, t_pairs = [student[j] for j in chosen], [teacher[j] for j in chosen]
        suffix = "" if kind == "any" else f"_{kind}"
        if kind != "any":
            out[f"eval/entropy_student_on{suffix}"] = float(cat(s_pairs, 1).mean())
            out[f"eval/entropy_teacher{suffix}"] = float(cat(t_pairs, 1).mean())
        out[f"eval/teacher_minus_student_entropy{suffix}"] = float((cat(t_pairs, 1) - cat(s_pairs, 1)).mean())
        out[f"eval/teacher_minus_student_logprob{suffix}"] = float((cat(t_pairs, 0) - cat(s_pairs, 0)).mean())
    out["eval/teacher_coverage"] = coverage
    return out


def success_rate(rollouts, cfg: Config) -> float:
    return sum(r.reward >= cfg.sdpo.success_threshold for r in rollouts) / max(len(rollouts), 1)


def row_success(rollouts, k: int, cfg: Config) -> list[float]:
    """Success of each row's k consecutive samples."""
    return [success_rate(rollouts[i:i + k], cfg) for i in range(0, len(rollouts), k)]


def success_stderr(rollouts, k: int, cfg: Config) -> float:
    """Standard error of avg@k success over rows: the rows are the independent draws (a row's
    k samples are not), so it is the spread of per-row success over the square root of the rows."""
    return stderr(row_success(rollouts, k, cfg))


def stderr(values: list[float]) -> float:
    """Standard error of the mean of independent values (nan for fewer than two)."""
    if len(values) < 2:
        return float("nan")
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


# The tiny model's warm start per task: (SFT steps, demonstration share, feedback share, target,
# context steps).
# strops: induction-style copying of a shown solution forms after ~100-150 mostly-demonstration
# steps; at 200 the bare student is at ~29% and the demonstration teacher at ~98%, with room
# for 40 RL steps to gain (at 300: 33%, and 40 SDPO steps gained 0.2-2 points). quiz: a model
# that can compute most lines never needs to copy the ones the feedback marks right, so the
# copying forms only with half the examples feedback contexts and lines it cannot all compute
# (--data.quiz_max 20). The student's success then climbs steeply (in 1,000 steps: estimated 1%
# at step 550, 32% at 760, 87% at 1,000), so it stops at an estimated 30%, inside the 5-40% band
# where RL has room; and copying a shown answer would form in the same race (at step 760 the
# demonstration teacher was at 46%), so its first 300 steps are teacher contexts only: copying
# forms before the facts (estimated with a demonstration 0.54 at step 600, 0.89 at 800; bare
# 0.01, 0.16) and the target comes at step 860 (--data.quiz_feedback=values: copying by step 450,
# the target at 1,330; README: Does it work?).
WARM_START_RECIPES = {"strops": (200, 0.7, 0.1, 0.0, 0), "quiz": (2000, 0.3, 0.5, 0.3, 300)}
DEFAULT_WARM_START = (300, 0.7, 0.1, 0.0, 0)
# The RL learning rate where --optim.lr is unset: per task and objective ((task, algo)), else
# per task, else DEFAULT_RL_LR. quiz: each objective at the best of an lr grid on its warm start
# (README: Does it work?, "Each at its own learning rate"): SDPO is best at 1.2e-4, where GRPO
# falls behind its own best, 6e-5; the rest keep 3e-5 (on the 2026-11-24 build the memorised
# lines broke under Adam steps of 1e-4: GRPO 19-20% -> 4-11% held-out in 40 steps).
RL_LRS = {"quiz": 3e-5, ("quiz", "grpo"): 6e-5, ("quiz", "sdpo"): 1.2e-4}
DEFAULT_RL_LR = 1e-4
# --sdpo.alpha where unset: reverse KL on the quiz reached GRPO's final in 0.50 of its
# generations, JSD in 0.59, both at 1.2e-4 (README: Does it work?)
SDPO_ALPHAS = {"quiz": 1.0}
DEFAULT_SDPO_ALPHA = 0.5


def warm_start_recipe(cfg: Config) -> tuple[int, float, float, float, int]:
    """(steps, demo_frac, feedback_frac, target, context_steps) of --train.warm_start_*, the
    task's recipe where unset."""
    given = (cfg.train.warm_start_steps, cfg.train.warm_start_demo_frac, cfg.train.warm_start_feedback_frac,
             cfg.train.warm_start_target, cfg.train.warm_start_context_steps)
    recipe = WARM_START_RECIPES.get(cfg.data.task, DEFAULT_WARM_START)
    return tuple(r if g is None else g for g, r in zip(given, recipe))


def warm_start_checks(cfg: Config, objective, tokenizer) -> tuple[list, list] | None:
    """For an SFT run with --train.warm_start_target on a synthetic task: the held-out rows its
    target is checked on, 256 after the first 2,048 (the most any evaluation here reads, so that
    the stopping point is not chosen on the rows that then measure the RL run; they overlap
    only at a difficulty with fewer distinct rows), and the same rows shown their reference
    (whether copying a demonstration has formed). None otherwise."""
    if not (objective.references and cfg.train.warm_start_target and cfg.data.task in data.TASKS):
        return None
    rows = data.task_rows(cfg.data.task, "test", 2048 + 256, cfg=cfg.data, at_most=True)[-256:]
    return rows, [teacher_context_ids(tokenizer, row, "demonstration", None, cfg) for row in rows]


def warm_start_estimates(cfg: Config, policy, tokenizer, checks: tuple[list, list], d: Dist) -> dict:
    rows, demonstrations = checks
    return {"warm_start/reference_success": reference_success(cfg, policy, tokenizer, rows, d),
            "warm_start/reference_success_with_demonstration":
                reference_success(cfg, policy, tokenizer, rows, d, demonstrations)}


def reference_success(cfg: Config, policy, tokenizer, rows: list[dict], d: Dist, prompts: list | None = None) -> float:
    """The bare student's expected success on rows, without sampling: the mean over rows of the
    probability that sampling at --rollout.eval_temperature writes the reference exactly,
    exp(sum_t log softmax(z_t / T)[reference_t]), EOS included. A lower bound where other
    texts also pass (a result written with other whitespace); on the quiz it tracks the
    sampled success (README: Does it work?). prompts: each row's prompt ids (a teacher
    context), else its bare prompt. Every rank runs it (FSDP2's collectives)."""
    prompts = prompts or [data.chat_prompt_ids(tokenizer, row["messages"], cfg.data.max_prompt_len) for row in rows]
    rollouts = [Rollout(row=row, prompt_ids=prompt,
                        response_ids=data.reference_response_ids(tokenizer, row, tokenizer.eos_token_id,
                                                                 "--train.warm_start_target"),
                        rollout_logprobs=[], text=row["reference"], truncated=False, generated=False)
                for row, prompt in zip(rows, prompts)]
    logprobs = objectives.response_logprobs(policy, rollouts, pad_token_id(tokenizer), d, cfg.train.micro_batch,
                                            cfg.rollout.eval_temperature)
    return sum(math.exp(sum(values)) for values in logprobs) / max(len(logprobs), 1)


def sft_rollouts(tokenizer, rows, cfg: Config, step: int) -> list[Rollout]:
    """Reference responses as rollouts, for --algo sft and the tiny model's warm start.

    A share of the prompts (--train.warm_start_*_frac) are SDPO teacher contexts: the
    reference shown as the correct solution, or the feedback on a wrong attempt.
    """
    rng = random.Random(stream_seed("references", cfg.train.seed, step))
    _, demo_frac, feedback_frac, _, context_steps = warm_start_recipe(cfg)
    if step < context_steps:
        demo_frac, feedback_frac = demo_frac / (demo_frac + feedback_frac), feedback_frac / (demo_frac + feedback_frac)
    out = []
    for row in rows:
        response = data.reference_response_ids(tokenizer, row, tokenizer.eos_token_id, "--algo sft")
        draw, prompt = rng.random(), None
        if draw < demo_frac:
            prompt = teacher_context_ids(tokenizer, row, "demonstration", rng, cfg)
        elif draw < demo_frac + feedback_frac:
            prompt = teacher_context_ids(tokenizer, row, "feedback", rng, cfg)
        if prompt is None:
            prompt = data.chat_prompt_ids(tokenizer, row["messages"], cfg.data.max_prompt_len)
        out.append(Rollout(row=row, prompt_ids=prompt, response_ids=response, rollout_logprobs=[0.0] * len(response),
                           text=row["reference"], truncated=False, reward=1.0, generated=False))
    return out


# ----------------------------------------------------------------------------------------
# Seeds: every random stream of a run derives from --train.seed and a step (or epoch), so that a
# resumed run repeats an uninterrupted one. Each purpose scales the seed by its own stride, so
# that streams of different purposes and seeds do not coincide.

SEED_STRIDE = {"prompts": 7919, "generation": 1000, "shuffle": 1000003, "references": 15485863}


def stream_seed(purpose: str, seed: int, index: int) -> int:
    return seed * SEED_STRIDE[purpose] + index


def batch_rows(rows: list, step: int, n: int, seed: int) -> list:
    """The prompts of a step: epochs of seeded permutations, so a resumed run sees the same order."""
    start = step * n
    return [rows[epoch_order(len(rows), seed, epoch)[offset]]
            for epoch, offset in (divmod(start + i, len(rows)) for i in range(n))]


@functools.lru_cache(maxsize=4)
def epoch_order(n_rows: int, seed: int, epoch: int) -> tuple:
    # cached: shuffling a 7,000-row list per prompt took a tenth of the warm start
    order = list(range(n_rows))
    random.Random(stream_seed("prompts", seed, epoch)).shuffle(order)
    return tuple(order)


def load_data(cfg: Config, announce: bool = False):
    """(train rows, held-out rows), with the fields the objective needs (e.g. GAD's
    teacher_response) checked in every training row before any work."""
    train_rows, eval_rows = read_rows(cfg, announce)
    for field_name in objectives.OBJECTIVES[cfg.algo.name].row_fields:
        for row in train_rows:
            if not row.get(field_name):
                raise data.DataError(f"{row['source']}, field '{field_name}': missing or empty, and --algo "
                                     f"{cfg.algo.name} needs it in every training row")
    return train_rows, eval_rows


def read_rows(cfg: Config, announce: bool = False):
    """A data file without --data.eval_path is split by a hash of each row's uid,
    --data.heldout_percent held out; announce says so (users have trained on 90% of a file
    without knowing)."""
    d = cfg.data
    if d.reward == "code" or d.allow_weak_sandbox:  # refuse a sandbox that cannot isolate, before any work
        from feedback import sandbox
        sandbox.require_isolation(d.allow_weak_sandbox)
    if d.task in data.TASKS:
        held_out = data.task_rows(d.task, "test", d.eval_rows, cfg=d, at_most=True)
        if announce and len(held_out) < d.eval_rows:
            print(f"data: {d.task} has {len(held_out)} distinct held-out rows at this difficulty, fewer than "
                  f"--data.eval_rows={d.eval_rows}: evaluating all of them", file=sys.stderr)
        return data.task_rows(d.task, "train", d.train_rows, seed=cfg.train.seed, cfg=d), held_out
    rows = data.load_rows(d.task, d.fields, d.reward or "math")
    if d.eval_path:
        held_out = data.load_rows(d.eval_path, d.fields, d.reward or "math", limit=d.eval_rows)
        if announce:
            print(f"data: {len(rows)} training rows from {d.task}, {len(held_out)} held-out rows from {d.eval_path}",
                  file=sys.stderr)
        return rows, held_out
    split = lambda r: data.split_of(r["uid"], d.heldout_percent)
    train_rows, held_out = [r for r in rows if split(r) == "train"], [r for r in rows if split(r) == "test"]
    if announce:
        print(f"data: {d.task} has {len(rows)} rows: {len(train_rows)} train, {len(held_out)} held out for "
              f"evaluation (a hash of each uid, --data.heldout_percent={d.heldout_percent}"
              f"{f'; evaluating the first --data.eval_rows={d.eval_rows}' if len(held_out) > d.eval_rows else ''}). "
              f"Pass --data.eval_path FILE to evaluate on a file of your own instead.", file=sys.stderr)
    if not train_rows or not held_out:
        raise data.DataError(f"{d.task}: the {len(rows)} rows split into {len(train_rows)} train and {len(held_out)} "
                             f"held out (--data.heldout_percent={d.heldout_percent}); both must be non-empty: "
                             f"add rows, change --data.heldout_percent, or pass --data.eval_path")
    return train_rows, held_out[:d.eval_rows]


# ----------------------------------------------------------------------------------------
# One step: collect rollouts (steps 2-4 of the loop), then learn from them (steps 5-7)


@dataclass
class Trainer:
    """What the updates change: the models, the optimizer and its schedule."""
    models: Models
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    nonfinite_streak: int = 0  # consecutive optimizer steps skipped for a NaN/inf loss or gradient


def collect(cfg: Config, objective, engine, tokenizer, rows: list, step: int, d: Dist):
    """Rank 0 generates and scores n responses per row (or takes the rows' references) and the
    objective writes what its loss needs onto them; every rank gets the rollouts."""
    t0 = time.perf_counter()
    if objective.references:
        rollouts, metrics = sft_rollouts(tokenizer, rows, cfg, step), {}
    else:
        rollouts, metrics = rank0_call(d, lambda: prepare_rollouts(engine, tokenizer, rows, cfg, objective, step))
    metrics["time/rollout_s"] = time.perf_counter() - t0
    return rollouts, metrics


class Batches:
    """The rollout batch of each step, in step order.

    --train.off_policy_steps 0: each batch is generated when it is taken. 1: taking batch t
    starts generating batch t+1 on rank 0 in the background, with the weights the engine
    holds (version t), while every rank learns from batch t; the engine finishes it before it
    loads version t+1 (rollout.Engine.in_background). So batch t > 0 comes from version t-1,
    one update stale, and the engine correction (truncated IS weights on the engine's
    log-probs against the trainer's at update time) covers the staleness as it covers the
    engine-vs-trainer mismatch.
    """

    def __init__(self, cfg: Config, objective, engine, tokenizer, train_rows: list, d: Dist, ahead=None):
        self.cfg, self.objective, self.engine, self.train_rows, self.d = cfg, objective, engine, train_rows, d
        self.generates_ahead = cfg.train.off_policy_steps > 0 and not objective.references
        # the background thread's own copy: a fast tokenizer used by two threads at once can
        # fail ("Already borrowed") while the trainer's thread encodes the sync's probe
        self.tokenizer = copy.deepcopy(tokenizer) if self.generates_ahead else tokenizer
        # the next batch, being generated: a callable that returns it on rank 0 (waiting for the
        # background job), or ignored on the other ranks; None: nothing ahead
        self.ahead = ahead

    def take(self, step: int):
        """Batch `step` (rollouts on every rank, and its metrics); starts the next one ahead."""
        t0 = time.perf_counter()
        if self.ahead is None:
            rollouts, metrics = self.collect(step, self.d)
        else:
            rollouts, metrics = rank0_call(self.d, self.ahead)
        self.ahead = None
        if self.generates_ahead and step + 1 < self.cfg.train.steps:
            # rank 0 alone (world 1): the other ranks get the batch when it is taken
            self.ahead = (self.engine.in_background(lambda: self.collect(step + 1, dataclasses.replace(self.d, world=1)),
                                                    name=f"generation of batch {step + 1}").result
                          if self.d.rank == 0 else lambda: None)
        metrics["time/wait_rollout_s"] = time.perf_counter() - t0
        generated = [r for r in rollouts if r.generated]  # a reference answer (SFT, SPIN) has no weights to be stale
        if generated:
            metrics["async/staleness"] = sum(step - r.policy_version for r in generated) / len(generated)
        return rollouts, metrics

    def collect(self, step: int, d: Dist):
        rows = batch_rows(self.train_rows, step, self.cfg.train.prompts_per_step, self.cfg.train.seed)
        return collect(self.cfg, self.objective, self.engine, self.tokenizer, rows, step, d)

    def next_batch(self):
        """Rank 0: the batch generated ahead (finished after a sync), for a checkpoint; else None."""
        return self.ahead() if self.ahead is not None and self.d.rank == 0 else None


def prepare_rollouts(engine, tokenizer, rows, cfg: Config, objective, step: int):
    """Rank 0's part of a step: generate, score, the objective's prepare; and their metrics."""
    rollouts = generate_and_score(engine, tokenizer, rows, cfg, stream_seed("generation", cfg.train.seed, step),
                                  cfg.rollout.n, cfg.rollout.temperature)
    n = len(rollouts)
    metrics = {
        "reward/mean": sum(r.reward for r in rollouts) / n,
        "reward/success_rate": success_rate(rollouts, cfg),
        "reward/errors": sum(bool(r.reward_error) for r in rollouts),
        "response/length_mean": sum(len(r.response_ids) for r in rollouts) / n,
        "response/truncated_frac": sum(r.truncated for r in rollouts) / n,
    }
    errors = [r for r in rollouts if r.reward_error]
    if errors:
        print(f"[step {step + 1}] {len(errors)} reward errors, e.g. {errors[0].row['source']}: {errors[0].reward_error}",
              file=sys.stderr)
    metrics.update(objective.prepare(rollouts, tokenizer, cfg))
    return rollouts, metrics


def learn(cfg: Config, objective, trainer: Trainer, engine, tokenizer, rollouts: list, step: int, d: Dist) -> dict:
    """Update the policy on the rollouts, update the teacher, sync the engine's weights (the
    weights of step + 1 updates; the engine first finishes a batch it generates ahead)."""
    t0 = time.perf_counter()
    metrics, stepped = update_policy(cfg, objective, trainer, rollouts, step, pad_token_id(tokenizer), d)
    # the policy's own forward and backward: the teacher's and the reference's forwards are timed apart
    metrics["time/train_s"] = (time.perf_counter() - t0 - metrics["time/teacher_s"]
                               - metrics.get("time/reference_s", 0.0))
    if trainer.models.teacher is not None:  # EMA only after a real optimizer step
        trainer.models.teacher.update(trainer.models.policy, stepped)
    if trainer.models.reference is not None:
        metrics["reference/refreshed"] = float(trainer.models.reference.refresh(trainer.models.policy, step + 1))
    if not objective.references:  # not `engine is not None`: only rank 0 holds the engine, all ranks sync
        metrics.update(sync_engine(cfg, engine, trainer.models.policy, tokenizer, d, version=step + 1))
    return metrics


def update_policy(cfg: Config, objective, trainer: Trainer, rollouts: list, step: int, pad_id: int, d: Dist):
    """One rollout batch's update: --train.mini_batches optimizer steps, each accumulating this
    rank's micro-batches. Returns (metrics, whether any optimizer step was taken).

    An optimizer step with nothing to learn from (no counted token, e.g. SDPO with no teacher
    context; or an exactly zero gradient, e.g. GRPO when every reward of every group ties) is
    skipped: AdamW's momentum and weight decay would otherwise move the weights, and an EMA
    teacher would follow them."""
    models = trainer.models
    models.policy.train()
    before = objective.before_update(rollouts, models, cfg, pad_id, d)
    units = micro_batch_units(rollouts, objective)
    random.Random(stream_seed("shuffle", cfg.train.seed, step)).shuffle(units)
    # Each optimizer step: its global counts and this rank's micro-batches (None: nothing to learn)
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rollouts]
    plan = [(counts, rank_micro_batches(mini_batch, cfg.train.micro_batch, d, lengths, cfg.train.micro_batch_tokens)
             if counts["tokens"] else None)
            for mini_batch in split_evenly(units, cfg.train.mini_batches)
            for counts in [step_counts([rollouts[i] for unit in mini_batch for i in unit], objective)]]
    old_logprobs = before_update_logprobs(cfg, models.policy, rollouts, units, pad_id, d)
    teacher_seconds = 0.0
    if models.teacher is not None:
        mine = sorted(i for _, micro in plan if micro for part in micro for i in part)
        teacher_seconds = objectives.cache_teacher_hidden(cfg, models, [rollouts[i] for i in mine], pad_id, d)
    stats, seconds, step_losses, grad_norms, skipped, stepped = {}, {}, [], [], 0, False
    for counts, micro in plan:
        if micro is None:  # every rank sees the same rollouts, so all skip together
            skipped += 1
            continue
        loss, finite = accumulate_gradients(cfg, objective, models, rollouts, micro, old_logprobs, counts, pad_id,
                                            d, stats, seconds)
        step_losses.append(loss)
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(models.policy.parameters(), cfg.optim.grad_clip)))
        grad_norms.append(grad_norm)
        if not (finite and math.isfinite(grad_norm)):
            trainer.nonfinite_streak += 1
            if trainer.nonfinite_streak >= cfg.train.max_nonfinite_steps:
                raise FloatingPointError(
                    f"step {step + 1}: loss or gradient norm not finite for {trainer.nonfinite_streak} optimizer "
                    f"steps in a row (last grad norm {grad_norm}); lower --optim.lr or check the data")
        elif grad_norm == 0.0:
            skipped += 1
        else:
            trainer.optimizer.step()
            trainer.scheduler.step()
            stepped, trainer.nonfinite_streak = True, 0
        trainer.optimizer.zero_grad(set_to_none=True)
    metrics = {**before, **reduce_stats(stats, step_losses, d.world)}
    metrics.update({"actor/grad_norm": sum(grad_norms) / max(len(grad_norms), 1), "actor/skipped_steps": skipped,
                    "actor/lr": trainer.scheduler.get_last_lr()[0],
                    "time/teacher_s": teacher_seconds + seconds.get("teacher", (0.0,))[0]})
    return metrics, stepped


def before_update_logprobs(cfg: Config, policy, rollouts: list, units: list, pad_id: int, d: Dist) -> list | None:
    """Log-probs of the rollouts that train (those in units), before the first optimizer step
    of the batch (None elsewhere); None when there is a single optimizer step."""
    if cfg.train.mini_batches == 1:
        return None
    trained = sorted(i for unit in units for i in unit)
    logprobs = objectives.response_logprobs(policy, [rollouts[i] for i in trained], pad_id, d, cfg.train.micro_batch,
                                            cfg.rollout.temperature, objectives.share_prompts(cfg))
    out = [None] * len(rollouts)
    for i, values in zip(trained, logprobs):
        out[i] = values
    return out


def accumulate_gradients(cfg: Config, objective, models: Models, rollouts: list, micro: list, old_logprobs,
                         counts: dict, pad_id: int, d: Dist, stats: dict, seconds: dict):
    """Forward and backward over this rank's micro-batches of one optimizer step (micro: lists
    of rollout indices, [] where this rank idles); adds their statistics into stats. Returns
    (the summed loss, whether every loss was finite)."""
    total, finite = 0.0, True
    for j, part in enumerate(micro):
        with no_sync_unless(models.policy, d.world, last=j == len(micro) - 1):
            if part:
                mb = objectives.micro_batch(models.policy, [rollouts[i] for i in part], counts, pad_id, d.device,
                                            None if old_logprobs is None else [old_logprobs[i] for i in part], d.world)
                loss, mb_stats = objective.loss(mb, models, cfg)
                add_stats(stats, mb_stats)
                add_stats(seconds, mb.seconds)
            else:  # this rank has fewer rollouts: take part in the collectives with a zero loss
                loss = idle_loss(cfg, models, pad_id, d)
            finite &= bool(torch.isfinite(loss).item())
            (loss * d.world).backward()  # FSDP2 averages gradients over ranks; the counts are global
        total += loss.item()
    return total, finite


def rank_micro_batches(units: list, micro_batch: int, d: Dist, lengths: list | None = None,
                       token_budget: int = 0) -> list[list[int]]:
    """This rank's micro-batches (lists of rollout indices) of one optimizer step, padded with
    empty ones to the busiest rank's count: every rank runs as many forward/backward passes
    (FSDP2's collectives). With a token budget (lengths: each rollout's sequence length), a
    rank's units are packed shortest first, up to token_budget padded tokens each."""
    # The order of micro-batches within an optimizer step does not change its gradient:
    # keeping each prompt's samples together lets them share their teacher prompt's forward.
    units = sorted(unit for unit in units if unit)  # an objective may leave a prompt with nothing to train
    longest = lambda unit: max(lengths[i] for i in unit)
    per_rank = []
    for r in range(d.world):
        share, widths = rank_share(units, r, d.world), None  # by index, so that ranks get alike lengths
        if token_budget:
            share = sorted(share, key=longest)
            widths = [longest(u) for u in share]
        per_rank.append(pack_units(share, micro_batch, widths, token_budget))
    return per_rank[d.rank] + [[]] * (max(max(len(m) for m in per_rank), 1) - len(per_rank[d.rank]))


def idle_loss(cfg: Config, models: Models, pad_id: int, d: Dist):
    """A zero loss with a forward through the policy (FSDP2's collectives) and, when there is
    a teacher, through its forwards (collectives too)."""
    if models.teacher is not None and models.teacher.reads_policy:
        objectives.teacher_hidden_states(cfg, models, [], pad_id, d.device, d.world)
    packed = data.pack([[pad_id, pad_id]], [1], pad_id, d.device)
    return objectives.forward(models.policy, packed, lambda h, w: (h @ w.T).sum() * 0.0)


def micro_batch_units(rollouts: list, objective) -> list[list[int]]:
    """Lists of rollout indices that must share a micro-batch: each sample alone, or a prompt's
    samples together (objectives that compare siblings, e.g. preference pairs). With
    counted_only, uncounted rollouts are left out; a unit may then be empty, so that the
    mini-batches still split the step's prompts the same way whatever their counts."""
    keep = (lambda i: objective.counted(rollouts[i])) if objective.counted_only else (lambda i: True)
    if not objective.keep_prompts_together:
        return [[i] if keep(i) else [] for i in range(len(rollouts))]
    groups = {}
    for i, r in enumerate(rollouts):
        groups.setdefault(r.row["uid"], [])
        if keep(i):
            groups[r.row["uid"]].append(i)
    return list(groups.values())


def pack_units(units: list[list[int]], size: int, lengths: list | None = None, token_budget: int = 0) -> list[list[int]]:
    """Consecutive units in micro-batches of at most `size` sequences and, with lengths (each
    unit's longest sequence), at most token_budget padded tokens (a larger unit alone)."""
    out, current, width = [], [], 0
    for k, unit in enumerate(units):
        grown = max(width, lengths[k]) if lengths else 0
        rows = len(current) + len(unit)
        if current and (rows > size or (token_budget and rows * grown > token_budget)):
            out.append(current)
            current, grown = [], lengths[k] if lengths else 0
        current, width = current + unit, grown
    return out + ([current] if current else [])


def step_counts(rollouts: list, objective) -> dict:
    """Global token / sequence counts of one optimizer step (all micro-batches, all ranks)."""
    counted = [r for r in rollouts if r.response_ids and objective.counted(r)]
    return {"tokens": sum(len(r.response_ids) for r in counted), "sequences": len(counted),
            "max_len": max((len(r.response_ids) for r in rollouts), default=1), **objective.counts(counted)}


def add_stats(into: dict, stats: dict):
    """Accumulate (sum, count) statistics; names ending in _max keep the maximum."""
    for name, value in stats.items():
        if not isinstance(value, tuple):
            value = (value, 1.0)
        total, count = into.get(name, (0.0, 0.0))
        into[name] = (max(total, value[0]), 1.0) if name.endswith("_max") else (total + value[0], count + value[1])


def reduce_stats(stats: dict, step_losses: list, world: int) -> dict:
    """Means of the objective's (sum, count) statistics over micro-batches and ranks (maxima
    for *_max), and the loss averaged over the optimizer steps taken."""
    names = sorted(stats)
    if world > 1:  # a rank without micro-batches has no statistics: agree on the names first
        gathered = [None] * world
        dist.all_gather_object(gathered, names)
        names = sorted(set().union(*gathered))
    sums = torch.tensor([stats.get(n, (0.0, 0.0))[0] for n in names] + [sum(step_losses)], dtype=torch.float64)
    counts = torch.tensor([stats.get(n, (0.0, 0.0))[1] for n in names], dtype=torch.float64)
    maxima = torch.tensor([stats.get(n, (0.0, 0.0))[0] if n.endswith("_max") else 0.0 for n in names],
                          dtype=torch.float64)
    if world > 1:
        dist.all_reduce(sums)
        dist.all_reduce(counts)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    out = {"actor/loss": sums[-1].item() / max(len(step_losses), 1)}
    for i, name in enumerate(names):
        out[name] = maxima[i].item() if name.endswith("_max") else sums[i].item() / max(counts[i].item(), 1.0)
    return out


def rank_share(items: list, rank: int, world: int) -> list:
    """This rank's contiguous part of items (sizes differ by at most one; may be empty)."""
    size, extra = divmod(len(items), world)
    start = rank * size + min(rank, extra)
    return items[start:start + size + (rank < extra)]


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


# ----------------------------------------------------------------------------------------
# The training loop


def train(cfg: Config, model_dir: str, d: Dist) -> dict:
    """Run cfg.algo on the model in model_dir; returns the last logged metrics."""
    objective = objectives.OBJECTIVES[cfg.algo.name]
    torch.manual_seed(cfg.train.seed)
    resume = rank0_call(d, lambda: checkpoint_path(cfg.train.resume)) if cfg.train.resume else ""
    rank0_call(d, lambda: check_out_dir(cfg, bool(resume), model_dir, objective))  # not after minutes of start-up
    tokenizer = load_tokenizer(model_dir)
    train_rows, eval_rows = load_data(cfg, announce=d.rank == 0)
    generates = cfg.eval_only or not objective.references  # the same on every rank; only rank 0 holds the engine
    engine = start_engine(cfg, model_dir, tokenizer, train_rows + eval_rows, d) if generates else None
    logger = Logger(cfg, d.rank)
    try:  # the engine's processes end with the run, also on an error or Ctrl-C
        if cfg.eval_only:
            return evaluate_only(cfg, model_dir, engine, tokenizer, eval_rows, logger, d)
        if cfg.ttt_prompts:
            return test_time_self_distillation(cfg, objective, model_dir, engine, tokenizer, eval_rows, logger, d)
        trainer = build_trainer(cfg, objective, model_dir, d)
        start_step, ahead, first_eval = load_checkpoint(resume, trainer, cfg, d) if resume else (0, None, None)
        if resume:
            logger.truncate(start_step)  # a killed run logged steps past its checkpoint
        if generates and start_step > 0:
            sync_engine(cfg, engine, trainer.models.policy, tokenizer, d, version=start_step)
        evaluate_now = lambda step: generates and cfg.train.eval_every and (
            step % cfg.train.eval_every == 0 or step == cfg.train.steps)
        metrics = {}  # first_eval: each held-out row's success at step 0; later gains are paired with it
        if evaluate_now(0) and start_step == 0:
            metrics, first_eval = rank0_call(d, lambda: evaluate(engine, tokenizer, eval_rows, cfg))
            logger.log(0, metrics)

        batches = Batches(cfg, objective, engine, tokenizer, train_rows, d, ahead)
        progress = logger.progress(start_step, cfg.train.steps)
        checks = warm_start_checks(cfg, objective, tokenizer)  # rows and prompts, where a target may stop it
        for step in range(start_step, cfg.train.steps):
            t_step = time.perf_counter()
            # 1-4. sample prompts; generate, score, write what the objective needs (advantages, teacher
            # contexts). With --train.off_policy_steps 1 this batch was generated during the last
            # update, and the engine starts on the next one now
            rollouts, metrics = batches.take(step)
            # 5-7. update the policy (mini-batches of micro-batches), the teacher; sync the engine, with proof
            learned = learn(cfg, objective, trainer, engine, tokenizer, rollouts, step, d)
            metrics["time/wait_rollout_s"] += learned.pop("time/wait_rollout_s", 0.0)  # generating ahead: at the sync
            metrics.update(learned)
            metrics["time/step_s"] = time.perf_counter() - t_step
            metrics["throughput/tokens_per_s"] = sum(len(r.prompt_ids) + len(r.response_ids) for r in rollouts) / metrics["time/step_s"]
            # 8. evaluate, log, checkpoint
            if evaluate_now(step + 1):
                metrics.update(rank0_call(d, lambda: evaluate(engine, tokenizer, eval_rows, cfg, first_eval))[0])
            if checks and (step + 1) % cfg.train.warm_start_check_every == 0:
                metrics.update(warm_start_estimates(cfg, trainer.models.policy, tokenizer, checks, d))
            logger.log(step + 1, metrics)
            if generates:
                logger.log_samples(step + 1, rollouts)
            progress.update(metrics)
            if cfg.train.save_every and (step + 1) % cfg.train.save_every == 0:
                save_checkpoint(os.path.join(cfg.log.out_dir, f"checkpoint-{step + 1}"), trainer, step + 1,
                                batches.next_batch(), d, first_eval)
            if checks and metrics.get("warm_start/reference_success", 0.0) >= cfg.train.warm_start_target:
                if d.rank == 0:
                    estimate, target = metrics["warm_start/reference_success"], cfg.train.warm_start_target
                    print(f"warm start: the student's estimated held-out success {estimate:.3f} reached "
                          f"--train.warm_start_target={target} at step {step + 1}; stopping there")
                break
        progress.close()
        save_hf(os.path.join(cfg.log.out_dir, "final"), trainer.models.policy, tokenizer, d)
        return metrics
    finally:
        logger.close()
        if engine is not None:
            engine.close()


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def start_engine(cfg: Config, model_dir: str, tokenizer, rows: list, d: Dist):
    """Rank 0's vLLM engine (None on other ranks). Started before the trainer: an in-process
    engine sets up its own single-process distributed state."""
    from rollout import Engine
    # Generating ahead runs the engine beside the trainer's computation: in its own process,
    # not in a thread of the trainer's (the GIL, and on CPU the trainer's OpenMP threads).
    ahead = cfg.train.off_policy_steps > 0
    if ahead and cfg.rollout.engine_process == "inprocess":
        raise ValueError("--train.off_policy_steps 1 needs the engine in its own process "
                         "(--rollout.engine_process own or auto)")
    own = {"auto": True if ahead else None, "inprocess": False, "own": True}[cfg.rollout.engine_process]
    return rank0_call(d, lambda: Engine(
        model_dir, placement=cfg.rollout.placement, dtype=engine_dtype(cfg, d.device), seed=cfg.train.seed,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, max_model_len=cfg.rollout.max_model_len,
        own_process=own, rpc_timeout_s=cfg.rollout.rpc_timeout_s,
        kv_cache_tokens=kv_cache_tokens(cfg, model_dir, tokenizer, rows, d.device)), share=False)


def evaluate_only(cfg: Config, model_dir: str, engine, tokenizer, eval_rows: list, logger, d: Dist) -> dict:
    """--eval_only: avg@k on the held-out rows (and, with --teacher_gap, what SDPO's teacher can do)."""
    metrics = rank0_call(d, lambda: evaluate(engine, tokenizer, eval_rows, cfg))[0]
    if cfg.teacher_gap:
        metrics.update(rank0_call(d, lambda: teacher_gap(engine, tokenizer, eval_rows, cfg)))
        metrics.update(rank0_call(d, lambda: context_entropies(engine, tokenizer, eval_rows, cfg, model_dir, d.device)))
        if d.rank == 0:
            for warning in teacher_gap_warnings(metrics):
                print(f"WARNING: {warning}", file=sys.stderr)
    logger.log(0, metrics)
    return metrics


def teacher_gap_warnings(metrics: dict) -> list[str]:
    """What --eval_only --teacher_gap says about SDPO's prospects, in words: a teacher context
    that does no better than the bare student (by two of its standard errors) gives SDPO
    nothing to teach in the groups that use it, and a teacher flatter than the student on
    the student's own tokens raises the policy's entropy. Measured cases: SmolLM2 on word
    problems (feedback 5.0% vs bare 23.7%, +0.214 nats), the quiz near its ceiling
    (demonstration 67.6%, feedback 79.5% vs bare 87.9%); the default quiz warns of nothing."""
    bare, margin = metrics["eval/success_rate"], 2 * metrics.get("eval/success_stderr", 0.0)
    out = []
    for kind, groups in (("demonstration", "groups with a successful sibling"),
                         ("feedback", "groups where every sample failed")):
        shown = metrics.get(f"eval/success_rate_with_{kind}")
        if shown is not None and shown <= bare + margin:
            out.append(f"the model shown a {kind} solves {shown:.1%} of held-out rows, no better than the bare "
                       f"student's {bare:.1%} (+- {margin:.1%}): SDPO's teacher has nothing to teach in {groups} "
                       f"(README 'Near the ceiling'); GRPO or --algo hybrid may do better here.")
    flatter = metrics.get("eval/teacher_minus_student_entropy")
    if flatter is not None and flatter > 0:
        out.append(f"eval/teacher_minus_student_entropy={flatter:+.3f} nats: the teacher is flatter than the "
                   f"student on its own tokens, so self-distillation will raise the policy's entropy "
                   f"(README 'On a real pretrained model').")
    return out


def test_time_self_distillation(cfg: Config, objective, model_dir: str, engine, tokenizer, rows: list, logger,
                                d: Dist) -> dict:
    """Paper section 5: repeated SDPO steps on one hard question alone, against best-of-k.

    Hard questions: the first --ttt_prompts held-out rows with no success among
    --rollout.eval_k samples of the initial model at --rollout.temperature. For each, from
    the initial weights: best-of-k draws k = train.steps * rollout.n samples; self-distillation
    runs up to train.steps steps of rollout.n samples on the question alone (teacher contexts
    from the feedback, and from a success once there is one). Each logs the generations
    until its first success (-1: none within k); the summary is discovery@k, the fraction of
    questions solved within k generations, for k = n, 2n, ..., train.steps * n.
    """
    n, steps, k = cfg.rollout.n, cfg.train.steps, cfg.rollout.eval_k
    first_success = lambda rollouts: next((i + 1 for i, r in enumerate(rollouts)
                                           if r.reward >= cfg.sdpo.success_threshold), None)
    screen = rank0_call(d, lambda: generate_and_score(
        engine, tokenizer, rows, cfg, stream_seed("generation", cfg.train.seed, 999_999), k, cfg.rollout.temperature))
    hard = [row for i, row in enumerate(rows) if first_success(screen[i * k:(i + 1) * k]) is None][:cfg.ttt_prompts]
    if d.rank == 0 and len(hard) < cfg.ttt_prompts:
        print(f"ttt: only {len(hard)} of {len(rows)} held-out prompts have no success in {k} samples", file=sys.stderr)
    found = {"ttt": [], "best_of_k": []}
    for i, row in enumerate(hard):
        trainer = build_trainer(cfg, objective, model_dir, d)
        metrics = sync_engine(cfg, engine, trainer.models.policy, tokenizer, d, version=0)  # the initial weights again
        best = rank0_call(d, lambda: generate_and_score(
            engine, tokenizer, [row], cfg, stream_seed("generation", cfg.train.seed, 500_000 + i), n * steps,
            cfg.rollout.temperature))
        found["best_of_k"].append(first_success(best))
        found["ttt"].append(None)
        for step in range(steps):
            rollouts, _ = collect(cfg, objective, engine, tokenizer, [row], (i + 1) * 1000 + step, d)
            at = first_success(rollouts)
            if at is not None:
                found["ttt"][-1] = step * n + at
                break
            metrics.update(learn(cfg, objective, trainer, engine, tokenizer, rollouts, step, d))
        logger.log(i + 1, {"ttt/prompt": i, "ttt/discovered_at": found["ttt"][-1] or -1,
                           "best_of_k/discovered_at": found["best_of_k"][-1] or -1,
                           "sync/probe_max_abs_diff": metrics["sync/probe_max_abs_diff"]})
    summary = {"ttt/prompts": len(hard)}
    for kind, ats in found.items():
        for j in range(1, steps + 1):
            summary[f"{kind}/discovery@{j * n}"] = sum(a is not None and a <= j * n for a in ats) / max(len(ats), 1)
    logger.log(len(hard) + 1, summary)
    return summary


def build_trainer(cfg: Config, objective, model_dir: str, d: Dist) -> Trainer:
    """Policy (FSDP2-sharded when world > 1), AdamW with linear warmup, and the optional
    models the objective asks for."""
    policy = load_policy(model_dir, cfg, d.world, d.device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.optim.lr,
                                  betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
                                  weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    models = Models(policy)
    if "teacher" in objective.models:
        copy = load_policy(model_dir, cfg, d.world, d.device) if cfg.sdpo.teacher != "live" else None
        models.teacher = Teacher(cfg.sdpo.teacher, cfg.sdpo.teacher_rate, copy)
    if "reference" in objective.models and not cfg.dpo.reference_free:
        models.reference = Reference(load_policy(model_dir, cfg, d.world, d.device), cfg.dpo.ref_update_every)
    if "discriminator" in objective.models:
        import discriminator
        o, g = cfg.optim, cfg.gad
        models.discriminator = Critic(discriminator.load(g.disc_path or model_dir, cfg.train.seed, d.world, d.device),
                                      g.lr, o.weight_decay, g.grad_clip, (o.beta1, o.beta2))
    return Trainer(models, optimizer, scheduler)


def lr_factor(cfg: Config, step: int) -> float:
    """The learning rate's multiplier at optimizer step `step` (0-based): linear warmup, then
    constant or a linear decay that reaches 0 after the last of train.steps x mini_batches."""
    warmup = min(1.0, (step + 1) / max(cfg.optim.warmup_steps, 1))
    if cfg.optim.decay == "none":
        return warmup
    total = cfg.train.steps * cfg.train.mini_batches
    return warmup * max(0.0, 1.0 - step / total)


def sync_engine(cfg: Config, engine, policy, tokenizer, d: Dist, version: int) -> dict:
    """Load the policy's weights (the version-th) into the engine and prove it: the engine's
    log-probs of a fixed probe must match the trainer's within --rollout.sync_tol (rollout.py).
    Also times the waits: the trainer's for a batch the engine generates ahead, and the
    engine's, idle since its last generation."""
    from rollout import image_probe, probe_ids
    t0 = time.perf_counter()
    state = full_state_dict(policy, d.world)
    # a vision-language model's probe holds a picture: a sync that missed the vision tower fails it
    probe, pictures = image_probe(tokenizer) if policy.vision is not None else (probe_ids(tokenizer), None)
    scored = policy.vision.expand(probe, pictures)[0] if pictures else probe  # the engine scores the expanded ids
    packed = objectives.pack(policy, [scored], [len(scored) - 1], pad_token_id(tokenizer), d.device,
                             images=[pictures] if pictures else None)
    with torch.no_grad():
        probe_lp = objectives.forward(policy, packed, lambda h, w: losses.logprobs_and_entropy_from_hidden(
            h, w, packed.targets)[0])
    reshard(policy)
    tol = cfg.rollout.sync_tol or (1e-3 if engine_dtype(cfg, d.device) == "float32" else 1.0)
    result = rank0_call(d, lambda: engine.update_weights(state, probe, probe_lp.cpu(), tol, version,
                                                                 probe_images=pictures))
    return {"sync/seconds": time.perf_counter() - t0 - result.waited_s, "sync/probe_max_abs_diff": result.probe_max_abs_diff,
            "time/wait_rollout_s": result.waited_s, "time/wait_sync_s": result.engine_idle_s,
            "sync/megabytes": sum(t.numel() * t.element_size() for t in (state or {}).values()) / 1e6}


def kv_cache_tokens(cfg: Config, model_dir: str, tokenizer, rows: list, device) -> int:
    """Tokens of KV cache the run's generations need at once: vLLM runs at most
    MAX_CONCURRENT_SEQS sequences together, each a prompt and its response. Teacher-gap
    prompts carry a demonstration or feedback, so prompts are counted three times over. On
    CPU the cache is capped at CPU_KV_CACHE_BYTES: more concurrent sequences do not make a
    CPU generate faster, and too small a cache only makes vLLM schedule fewer at a time."""
    if cfg.rollout.kv_cache_tokens:
        return cfg.rollout.kv_cache_tokens
    from rollout import kv_bytes_per_token
    longest = max(len(data.chat_prompt_ids(tokenizer, r["messages"], cfg.data.max_prompt_len)) for r in rows[:256])
    per_sequence = min(3 * longest + cfg.rollout.max_tokens, cfg.rollout.max_model_len)
    sequences = max(cfg.train.prompts_per_step * cfg.rollout.n, cfg.data.eval_rows * cfg.rollout.eval_k)
    need = min(sequences, MAX_CONCURRENT_SEQS) * per_sequence
    if device.type == "cpu":
        need = min(need, CPU_KV_CACHE_BYTES // kv_bytes_per_token(model_dir, engine_dtype(cfg, device)))
    return need


MAX_CONCURRENT_SEQS = 256  # vLLM's default max_num_seqs
CPU_KV_CACHE_BYTES = 1 << 30


def engine_dtype(cfg: Config, device) -> str:
    # Never vLLM's "auto": it silently runs a float32 checkpoint in half precision.
    return cfg.rollout.dtype or ("bfloat16" if device.type == "cuda" else "float32")


# ----------------------------------------------------------------------------------------
# Checkpoints and logging


FIRST_EVAL = "first_eval.json"  # in a checkpoint: the held-out rows' success at step 0
NEXT_BATCH = "next_batch.pt"  # in a checkpoint of a run generating ahead: the batch of its next step


def save_checkpoint(path: str, trainer: Trainer, step: int, next_batch, d: Dist, first_eval: list | None = None):
    """Policy, optimizer, the optional models and the RNG state (torch.distributed.checkpoint:
    every rank writes its shards) and, generating ahead, the next step's batch (rank 0's
    next_batch: its rollouts were generated with the weights before this step's update, which
    a resumed run no longer has), and the held-out rows' success at step 0 (first_eval: later
    evaluations pair their gain with it). Written as path.partial and renamed when complete, so that
    a run killed during a save leaves no checkpoint under a name that `--train.resume` takes."""
    import torch.distributed.checkpoint as dcp
    partial = path + ".partial"
    if d.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
    barrier(d)
    dcp.save(checkpoint_state(trainer, step), checkpoint_id=partial)  # fsyncs its files
    if d.rank == 0:
        if first_eval is not None:
            with open(os.path.join(partial, FIRST_EVAL), "w") as f:
                json.dump(first_eval, f)
        if next_batch is not None:
            with open(os.path.join(partial, NEXT_BATCH), "wb") as f:
                torch.save(next_batch, f)
                f.flush()
                os.fsync(f.fileno())
        replace_dir(partial, path)
    barrier(d)


def load_checkpoint(path: str, trainer: Trainer, cfg: Config, d: Dist):
    """Restore what save_checkpoint wrote into trainer. Returns the step to continue from,
    when generating ahead and the checkpoint holds it, the next batch for Batches (else None),
    and the held-out rows' success at step 0 (None if the checkpoint has none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    state = checkpoint_state(trainer, 0)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(trainer.models.policy, trainer.optimizer, model_state_dict=state["policy"],
                   optim_state_dict=state["optimizer"])
    for name in ("teacher", "reference", "discriminator"):
        if name in state:
            getattr(trainer.models, name).load_state_dict(state[name])
    torch.set_rng_state(state["meta"]["torch_rng"])
    random.setstate(state["meta"]["python_rng"])
    first_eval = None
    if os.path.exists(os.path.join(path, FIRST_EVAL)):
        with open(os.path.join(path, FIRST_EVAL)) as f:
            first_eval = json.load(f)
    file = os.path.join(path, NEXT_BATCH)
    if not (cfg.train.off_policy_steps and rank0_call(d, lambda: os.path.exists(file))):
        return int(state["meta"]["step"]), None, first_eval
    batch = torch.load(file, weights_only=False) if d.rank == 0 else None
    return int(state["meta"]["step"]), lambda: batch, first_eval


def checkpoint_path(resume: str) -> str:
    """--train.resume: a checkpoint directory, or a run's out_dir (its latest complete checkpoint)."""
    import re
    if os.path.exists(os.path.join(resume, ".metadata")):  # torch.distributed.checkpoint's index
        return resume
    steps = [int(m.group(1)) for m in map(re.compile(r"checkpoint-(\d+)").fullmatch,
                                           os.listdir(resume) if os.path.isdir(resume) else []) if m]
    if not steps:
        raise FileNotFoundError(f"--train.resume {resume}: neither a checkpoint nor a run directory holding one "
                                "(checkpoint-N, written by --train.save_every)")
    return os.path.join(resume, f"checkpoint-{max(steps)}")


def replace_dir(src: str, dst: str):
    """Rename the directory src to dst, replacing dst; durable once it returns."""
    old = dst + ".old"
    if os.path.exists(dst):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(os.path.dirname(os.path.abspath(dst)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def barrier(d: Dist):
    if d.world > 1:
        dist.barrier()


def checkpoint_state(trainer: Trainer, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optim_state = get_state_dict(trainer.models.policy, trainer.optimizer)
    state = {"policy": model_state, "optimizer": optim_state,
             "meta": {"step": step, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}}
    if trainer.models.teacher is not None and trainer.models.teacher.copy is not None:
        state["teacher"] = trainer.models.teacher.state_dict()
    if trainer.models.reference is not None:
        state["reference"] = trainer.models.reference.state_dict()
    if trainer.models.discriminator is not None:  # with its optimizer and step count
        state["discriminator"] = trainer.models.discriminator.state_dict()
    return state


def save_hf(path: str, policy, tokenizer, d: Dist):
    """An ordinary HF directory (transformers and vLLM load it), written whole or not at all
    (the warm-start cache takes a directory with a config.json as complete)."""
    state = full_state_dict(policy, d.world)
    if d.rank == 0:
        partial = path + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        policy.hf.save_pretrained(partial, state_dict=state)
        tokenizer.save_pretrained(partial)
        if policy.vision is not None:
            policy.vision.processor.save_pretrained(partial)
        replace_dir(partial, path)
    barrier(d)


def check_out_dir(cfg: Config, resuming: bool, model_dir: str = "", objective=None):
    """Fail at the start, naming the path, when --log.out_dir cannot be written, holds an
    earlier run's checkpoints (which `--train.resume OUT_DIR` would take for this run's), or
    (given the model) lacks the space for the final model and a first checkpoint."""
    out = cfg.log.out_dir
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise OSError(e.errno, f"--log.out_dir {out} is not writable: {e.strerror}") from e
    earlier = sorted(name for name in os.listdir(out) if name.startswith("checkpoint-") and "." not in name)
    if earlier and not resuming:
        raise FileExistsError(f"--log.out_dir {out} holds checkpoints of an earlier run ({', '.join(earlier[-3:])}): "
                              f"continue it with --train.resume {out}, or choose another --log.out_dir")
    if not model_dir:
        return
    model = 4 * parameter_count(model_dir)  # float32, as the trainer holds and saves it
    copies = 3 + ("teacher" in objective.models and cfg.sdpo.teacher != "live")  # + AdamW's two moments, the teacher
    saves = cfg.train.steps // cfg.train.save_every if cfg.train.save_every else 0
    need, total = model + min(saves, 1) * copies * model, model + saves * copies * model
    free = shutil.disk_usage(out).free
    if free < need:
        raise OSError(28, f"--log.out_dir {out} has {free / 2**30:.3g} GiB free; the run writes at least "
                          f"{need / 2**30:.3g} GiB (the final model and a checkpoint)")  # 28: ENOSPC
    if free < total:
        print(f"warning: --log.out_dir {out} has {free / 2**30:.3g} GiB free; the run's {saves} checkpoints "
              f"and final model take {total / 2**30:.3g} GiB", file=sys.stderr)


def parameter_count(model_dir: str) -> int:
    from safetensors import safe_open
    count = 0
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), "pt") as f:
                count += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return count


# A teacher flatter than its student pulls the student towards a flatter distribution. On
# SmolLM2-135M-Instruct's own word-problem samples the teacher is +0.18 (demonstration) to +0.22
# (feedback) nats flatter and SDPO collapses it in 4 steps: one step above 0.1 warns. On the quiz
# near its ceiling (--data.quiz_max 12 --data.quiz_questions 4) every step logs +0.003..+0.035 and
# SDPO loses 8 points over 80 steps, while on the default quiz (SDPO gains 11) every step logs
# -0.073..-0.035 and on the default strops job -0.19..-0.01: a mean above 0 over 5 steps warns.
FLAT_TEACHER_METRIC, FLAT_TEACHER_NATS = "sdpo/teacher_minus_student_entropy", 0.1
FLAT_TEACHER_WINDOW = 5


class Logger:
    """metrics.jsonl, wandb (offline unless asked) and a progress bar, on rank 0."""

    def __init__(self, cfg: Config, rank: int):
        self.rank, self.cfg, self.run, self.samples, self.warned = rank, cfg, None, None, set()
        self.recent_gaps = []  # the last FLAT_TEACHER_WINDOW steps' teacher-minus-student entropy
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
        self.warn_once(step, record)

    def warn_once(self, step: int, record: dict):
        """Early warnings on stderr, each the first time its metric crosses its threshold: a
        teacher flatter than the student by more than FLAT_TEACHER_NATS in one step, or by
        any margin on average over FLAT_TEACHER_WINDOW steps."""
        gap = record.get(FLAT_TEACHER_METRIC)
        if gap is None or FLAT_TEACHER_METRIC in self.warned:
            return
        self.recent_gaps = (self.recent_gaps + [gap])[-FLAT_TEACHER_WINDOW:]
        window_mean = sum(self.recent_gaps) / len(self.recent_gaps)
        if gap > FLAT_TEACHER_NATS:
            why = f"{gap:+.3f} nats (> {FLAT_TEACHER_NATS})"
        elif len(self.recent_gaps) == FLAT_TEACHER_WINDOW and window_mean > 0:
            why = f"{window_mean:+.3f} nats on average over the last {FLAT_TEACHER_WINDOW} steps (> 0)"
        else:
            return
        self.warned.add(FLAT_TEACHER_METRIC)
        print(f"WARNING step {step}: {FLAT_TEACHER_METRIC}={why}: the teacher is flatter than the student on "
              f"the student's own tokens, so self-distillation will raise the policy's entropy instead of "
              f"sharpening it. The model likely cannot use its teacher contexts in-context, or they add nothing "
              f"to what it already solves (README 'On a real pretrained model', 'Near the ceiling'); check "
              f"--eval_only --teacher_gap, and compare with --algo grpo. (Shown once.)", file=sys.stderr)

    def log_samples(self, step: int, rollouts: list):
        """The first sample of each of the first --log.samples_per_step prompts of a step."""
        if self.rank != 0 or not self.cfg.log.samples_per_step:
            return
        firsts = rollouts[::self.cfg.rollout.n][:self.cfg.log.samples_per_step]  # rollouts come n per prompt
        records = [{"step": step, "prompt": r.row["messages"][-1]["content"], "response": r.text, "reward": r.reward,
                    "feedback": r.feedback, "truncated": r.truncated, "uid": r.row["uid"]} for r in firsts]
        if self.samples is None:
            self.samples = open(os.path.join(self.cfg.log.out_dir, "samples.jsonl"), "a")
        self.samples.write("".join(json.dumps(rec) + "\n" for rec in records))
        self.samples.flush()
        if self.run is not None and records:
            import wandb
            columns = list(records[0])
            self.run.log({"samples": wandb.Table(columns=columns, data=[[rec[c] for c in columns] for rec in records])},
                         step=step)

    def progress(self, start, total):
        return Progress(start, total, self.rank == 0 and self.cfg.log.progress, self.cfg.algo.name)

    def truncate(self, step: int):
        """Drop the records after step (a resumed run logs them again)."""
        if self.rank != 0:
            return
        path = self.file.name
        self.file.close()
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        with open(path + ".partial", "w") as f:
            f.writelines(kept)
        os.replace(path + ".partial", path)
        self.file = open(path, "a")

    def close(self):
        if self.rank == 0 and not self.file.closed:
            self.file.close()
            if self.samples is not None:
                self.samples.close()
            if self.run is not None:
                self.run.finish()


class Progress:
    SHOWN = {"reward/mean": "reward", "reward/success_rate": "success", "eval/success_rate": "eval",
             "sdpo/teacher_coverage": "coverage", "sdpo/divergence": "div", "dpo/accuracy": "pref_acc",
             "gad/d_acc": "d_acc",
             "time/step_s": "s/step"}

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


def resolve_model(cfg: Config, d: Dist) -> str:
    """The model to train: --model.path, or the tiny model after its cached SFT warm start."""
    if cfg.model.path:
        return cfg.model.path
    if cfg.data.task in data.IMAGE_TASKS:
        tiny = rank0_call(d, lambda: data.tiny_vlm_dir(data.TinyVLMConfig(**dataclasses.asdict(cfg.model.tiny))))
    else:
        tiny = rank0_call(d, lambda: data.tiny_model_dir(cfg.model.tiny))
    steps, demo_frac, feedback_frac, target, context_steps = warm_start_recipe(cfg)
    if not steps or objectives.OBJECTIVES[cfg.algo.name].references:
        return tiny
    # The warm start is `--algo sft` with the train.warm_start_* values, one optimizer step per
    # batch; the cache key holds only what it reads, so runs that differ in RL-only flags (the
    # RL lr, seed, prompts per step, mini-batches, eval rows, ...) share one warm start.
    warm_train = dict(steps=steps, prompts_per_step=cfg.train.warm_start_batch,
                      micro_batch=cfg.train.micro_batch, micro_batch_tokens=cfg.train.warm_start_micro_batch_tokens,
                      seed=cfg.train.warm_start_seed, mini_batches=1,
                      eval_every=0, save_every=0, resume="",
                      **{f.name: getattr(cfg.train, f.name) for f in dataclasses.fields(TrainConfig)
                         if f.name.startswith("warm_start")})
    # the resolved values: the cache key of an unset flag is its task's recipe
    warm_train.update(warm_start_steps=steps, warm_start_demo_frac=demo_frac, warm_start_feedback_frac=feedback_frac,
                      warm_start_target=target, warm_start_context_steps=context_steps)
    warm = dataclasses.replace(
        cfg, algo=AlgoConfig(name="sft"), rollout=RolloutConfig(),
        # decayed towards 0 at its last step (a target may stop it sooner): its last weights are all that is kept
        optim=dataclasses.replace(cfg.optim, lr=cfg.train.warm_start_lr, decay="linear", eps=OptimConfig.eps),
        train=dataclasses.replace(cfg.train, **warm_train), log=dataclasses.replace(cfg.log, wandb_mode="disabled"),
        eval_only=False, ttt_prompts=0)  # those modes are for the RL run, not its warm start
    templates = {k: getattr(cfg.sdpo, k) for k in ("reprompt_template", "solution_template", "feedback_template",
                                                     "max_reprompt_len")}
    train_data = {k: v for k, v in dataclasses.asdict(warm.data).items() if k not in ("eval_rows", "eval_path")}
    # the wording that predates the flag is out of the key, and so is every other task's: their caches stand
    if cfg.data.task != "quiz" or cfg.data.quiz_feedback == "values":
        train_data.pop("quiz_feedback")
    # --optim.eps is RL-only (the warm start keeps AdamW's default), and out of the key, which
    # predates the flag
    warm_optim = {k: v for k, v in dataclasses.asdict(warm.optim).items() if k != "eps"}
    # without a target, out of the key, which predates the flags (a strops warm start keeps its cache)
    warm_key = {k: v for k, v in warm_train.items()
                if target or k not in ("warm_start_target", "warm_start_check_every")}
    if not context_steps:
        warm_key.pop("warm_start_context_steps")
    recipe = json.dumps([tiny, templates, train_data, warm_key, warm_optim], sort_keys=True)
    import hashlib
    path = tiny + "-sft-" + hashlib.sha1(recipe.encode()).hexdigest()[:10]
    if not os.path.exists(os.path.join(path, "final", "config.json")):
        if d.rank == 0:
            print(f"warm start: {steps} SFT steps on the task's references -> {path}")
        train(dataclasses.replace(warm, log=dataclasses.replace(warm.log, out_dir=path)), tiny, d)
    return os.path.join(path, "final")


def teacher_model(cfg: Config, d: Dist) -> tuple[Config, str]:
    """The self-made black-box teacher: the tiny model after --gad.teacher_steps SFT steps on
    the task's references, plain prompts only (cached like the student's warm start)."""
    teacher_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=""), train=dataclasses.replace(
        cfg.train, warm_start_steps=cfg.gad.teacher_steps, warm_start_demo_frac=0.0, warm_start_feedback_frac=0.0))
    return teacher_cfg, resolve_model(teacher_cfg, d)


def with_teacher_data(cfg: Config, d: Dist) -> Config:
    """cfg reading a teacher's responses when the objective needs them and the task is synthetic.

    The black-box teacher is the tiny model after --gad.teacher_steps SFT steps on the task's
    references (a warm start of its own, cached). It answers each training prompt once at
    --gad.teacher_temperature; rows whose answer ran out of tokens or is empty are dropped (an
    API teacher's answers are finished). Its text goes to <teacher>-data-<hash>/train.jsonl (uid, prompt,
    answer, tests, teacher_response: the file a user brings), next to heldout.jsonl (the task's
    held-out rows). Training reads only that text; the teacher's weights serve evaluation alone.
    """
    if "teacher_response" not in objectives.OBJECTIVES[cfg.algo.name].row_fields or cfg.data.task not in data.TASKS:
        return cfg
    import hashlib
    teacher_cfg, teacher_dir = teacher_model(cfg, d)
    recipe = json.dumps([teacher_dir, dataclasses.asdict(cfg.data), cfg.train.seed, cfg.gad.teacher_temperature,
                         cfg.rollout.max_tokens], sort_keys=True)
    out = os.path.dirname(teacher_dir) + "-data-" + hashlib.sha1(recipe.encode()).hexdigest()[:10]
    paths = {"train": os.path.join(out, "train.jsonl"), "heldout": os.path.join(out, "heldout.jsonl")}
    if not os.path.exists(paths["heldout"]):  # written last
        train_rows, eval_rows = read_rows(cfg)
        tokenizer = load_tokenizer(teacher_dir)
        engine = start_engine(teacher_cfg, teacher_dir, tokenizer, train_rows, d)
        rank0_call(d, lambda: write_teacher_data(engine, tokenizer, train_rows, eval_rows, teacher_cfg, out, paths),
                   share=False)
        if engine is not None:
            engine.close()
    return dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, task=paths["train"], eval_path=paths["heldout"], fields="",
        reward=cfg.data.reward or data.task_rows(cfg.data.task, "test", 1, cfg=cfg.data)[0]["reward"]))


def write_teacher_data(engine, tokenizer, train_rows: list, eval_rows: list, cfg: Config, out: str, paths: dict):
    rollouts = generate_and_score(engine, tokenizer, train_rows, cfg, stream_seed("generation", cfg.train.seed, 0), 1,
                                  cfg.gad.teacher_temperature)
    tmp = out + f".tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    record = lambda row, **extra: json.dumps({"uid": row["uid"], "prompt": row["messages"], "answer": row["answer"],
                                              "tests": row["tests"], **extra})
    finished = [r for r in rollouts if not r.truncated and r.text.strip()]
    with open(os.path.join(tmp, "train.jsonl"), "w") as f:
        for r in finished:
            f.write(record(r.row, teacher_response=r.text) + "\n")
    with open(os.path.join(tmp, "heldout.jsonl"), "w") as f:
        for row in eval_rows:
            f.write(record(row) + "\n")
    print(f"teacher data: {len(finished)} of {len(rollouts)} answers finished and not empty, success "
          f"{success_rate(finished, cfg):.3f} on the training prompts -> {out}")
    if os.path.exists(out):  # another process won the race
        shutil.rmtree(tmp)
    else:
        os.rename(tmp, out)


def parse_config(argv=None) -> Config:
    """Flags -> Config. Booleans take a value (--sdpo.add_tail=False), as sweep agents pass them."""
    import re
    import tyro
    argv = sys.argv[1:] if argv is None else list(argv)
    argv = [re.sub(r"=(true|false)$", lambda m: "=" + m.group(1).capitalize(), a, flags=re.I) for a in argv]
    cfg = tyro.cli(Config, args=argv, config=(tyro.conf.FlagConversionOff,))
    if cfg.optim.lr is None:
        cfg.optim.lr = RL_LRS.get((cfg.data.task, cfg.algo.name), RL_LRS.get(cfg.data.task, DEFAULT_RL_LR))
    if cfg.sdpo.alpha is None:
        cfg.sdpo.alpha = SDPO_ALPHAS.get(cfg.data.task, DEFAULT_SDPO_ALPHA)
    return cfg


@contextlib.contextmanager
def ctrl_c_wins():
    """Ctrl-C reaches the engine's processes too (one process group), and the engine may die
    of it before the trainer's KeyboardInterrupt surfaces: its EngineDeadError would then
    be what the run stops with. After a SIGINT, whatever the run raises is reported as the
    KeyboardInterrupt it is."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():  # signal handlers: main thread only
        yield
        return
    interrupted = []

    def on_sigint(signum, frame):
        interrupted.append(signum)
        signal.default_int_handler(signum, frame)
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    except Exception as error:
        if interrupted:
            raise KeyboardInterrupt("Ctrl-C (the engine stopped with it)") from error
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


def main(argv=None):
    cfg = parse_config(argv)
    d = setup_distributed()
    rank0_call(d, lambda: check_out_dir(cfg, resuming=bool(cfg.train.resume)))  # not after the warm start
    t0 = time.perf_counter()
    model_dir = resolve_model(cfg, d)
    cfg = with_teacher_data(cfg, d)
    with ctrl_c_wins():
        metrics = train(cfg, model_dir, d)
    if d.rank == 0:
        shown = {k: round(v, 4) for k, v in metrics.items() if k.startswith(("eval/", "reward/"))}
        print(f"done in {time.perf_counter() - t0:.0f}s: {shown} -> {cfg.log.out_dir}")
    end_distributed(d)
    return metrics


if __name__ == "__main__":
    main()

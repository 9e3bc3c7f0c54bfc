"""GAD: on-policy distillation from a black-box teacher's text, a discriminator as the reward
(arXiv 2511.10643; the step, its stages and where it departs from the paper: docs/gad.md).

Its models: the discriminator (discriminator.py, its own optimizer, one step a batch in
before_update) and the frozen initial policy its KL term is measured against (dpo.py's reference).
"""
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

import discriminator
import losses
from config import check_bounds
from microbatch import MicroBatch, Models, Objective, aggregate, give_fields, masked_stat, policy_logprobs
from objectives import grpo
from objectives.dpo import (build_reference, engine_eos, prompt_groups, reference_held, reference_rollout,
                            reference_token_logprobs, refresh_reference)
from objectives.sft import sft_loss


@dataclass
class AlgoFlags:
    """GAD's KL to the initial policy, under --algo."""
    kl_coef: float = 0.001  # GAD: weight of the KL to the initial policy (the GAD paper's: k3, 0.001)
    kl_type: Literal[tuple(k + p for k in losses.KL_KINDS for p in ("", "+"))] = "k3"  # "+": k2's gradient
    kl_in_reward: bool = False  # GAD: subtract kl_coef * the sequence's KL from the reward instead of a loss term


@dataclass
class Flags:
    """GAD (--algo gad): the discriminator and the two stages (docs/gad.md)."""
    disc_path: str = ""  # a local HF directory for the discriminator's backbone; empty: the student's start
    # The discriminator's AdamW lr (the paper's 1e-6 is for 8B models); weight decay and betas are --optim's
    lr: float = 1e-4
    grad_clip: float = 1.0  # the discriminator's gradient-norm clip
    # the discriminator's optimizer steps on each rollout batch; the rewards and gad/d_acc are the
    # scores before the first (more steps a batch did not help on the quiz: docs/gad.md)
    disc_steps: int = 1
    # what the scalar head reads: the last real token's hidden state, or the mean of the response tokens'
    pool: Literal["last", "mean"] = "last"
    policy_loss: Literal["ppo", "gspo"] = "ppo"  # the student's clipped surrogate
    warmup_steps: int = 0  # stage 1: SFT of the student on the teacher's responses while the discriminator trains
    critic_warmup: int = 0  # then this many steps train only the discriminator
    # On a synthetic task the rows have no teacher_response: the project makes a black-box teacher,
    # the tiny model after this many SFT steps on the task's references (the student's start has
    # train.warm_start_steps), and writes its sampled text to a JSONL file (cached, docs/gad.md).
    teacher_steps: int = 1000
    # the discriminator's score has no fixed scale: GAD's advantages are divided by the group's std
    norm_adv_by_std: bool = True
    teacher_temperature: float = 0.6  # the self-made teacher's sampling temperature
    # "constant": every sample's reward is 0 (the control: the same stages, SFT warmup and KL to the start,
    # with no signal from the discriminator, which still trains and logs d_acc; docs/gad.md)
    reward: Literal["discriminator", "constant"] = "discriminator"


@dataclass
class Section:
    """Its flags' section of the run's Config: --gad.* (objectives.Sections)."""
    gad: Flags = field(default_factory=Flags)


def check_flags(cfg):
    """Its flags' bounds, checked before any work starts (flags.check_config)."""
    check_bounds(cfg, at_least={"gad.disc_steps": 1, "gad.warmup_steps": 0, "gad.critic_warmup": 0},
                 positive=("gad.lr", "gad.grad_clip"))


@dataclass
class Fields(grpo.Fields):
    """What GAD writes on a rollout (Rollout.fields): the advantage of its reward, and"""
    reference_logprobs: list | None = None  # per-token log-probs under the frozen initial policy (KL)
    discriminator_score: float = 0.0  # D(prompt, response) before this step's discriminator update
    trains_policy: bool = True  # in this step's policy loss (its stage decides which rollouts)


def gad_stage(steps_done: int, cfg) -> str:
    """"warmup" (SFT on the teacher's text), "critic" (the discriminator alone) or "gad"."""
    if steps_done < cfg.gad.warmup_steps:
        return "warmup"
    return "critic" if steps_done < cfg.gad.warmup_steps + cfg.gad.critic_warmup else "gad"


def prepare_teacher_responses(rollouts: list, tokenizer, cfg) -> dict:
    """Append each prompt's teacher response as a rollout (not generated) after its samples:
    the row's teacher_response, tokenised, ending with the token the engine's finished
    responses end with (a last-token discriminator would otherwise learn the EOS difference)."""
    eos = engine_eos(rollouts, tokenizer)
    teachers = [reference_rollout(group, tokenizer, eos, f"--algo {cfg.algo.name}", "teacher_response")
                for group in prompt_groups(rollouts)]
    rollouts.extend(teachers)
    give_fields(rollouts, Fields)
    return {"gad/teacher_length": sum(len(r.response_ids) for r in teachers) / max(len(teachers), 1)}


def gad_rewards(rollouts: list, models: Models, cfg, pad_id: int, d) -> dict:
    """Every rank: one discriminator step on the step's rollouts, whose pre-update scores of
    the student samples are their rewards (minus the KL to the initial policy with
    --algo.kl_in_reward); GRPO advantages; which rollouts the policy trains on this stage."""
    critic, kl_coef = models.discriminator, cfg.algo.kl_coef
    stage = gad_stage(critic.steps, cfg)
    t0 = time.perf_counter()
    groups = [([r for r in g if r.generated], next(r for r in g if not r.generated)) for g in prompt_groups(rollouts)]
    update = critic.train_step([(len(t.prompt_ids), t.prompt_ids + t.response_ids,
                                 [s.prompt_ids + s.response_ids for s in students])
                                for students, t in groups], pad_id, d, cfg.train.micro_batch, cfg.gad.disc_steps)
    scores = iter(update.scores)
    for students, teacher in groups:
        for r in [teacher, *students]:
            r.fields.discriminator_score = next(scores)
    metrics = {**update.metrics, "gad/stage": ("warmup", "critic", "gad").index(stage),
               "time/discriminator_s": time.perf_counter() - t0}
    samples = [r for r in rollouts if r.generated]
    truncated = [r.fields.discriminator_score for r in samples if r.truncated]
    if truncated:  # scored as they are: no EOS at the end
        metrics["gad/student_score_truncated"] = sum(truncated) / len(truncated)
    rewards = torch.tensor([r.fields.discriminator_score for r in samples], dtype=torch.float64)
    if cfg.gad.reward == "constant":  # the control: no signal, only the KL to the start moves the policy
        rewards.zero_()
    if stage == "gad" and "reference" in models.extra:
        sequence_kl = []
        for r, logprobs in zip(samples, reference_token_logprobs(samples, models, cfg, pad_id, d, metrics)):
            r.fields.reference_logprobs = logprobs
            sequence_kl.append(losses.kl_estimate(torch.tensor(r.rollout_logprobs), torch.tensor(logprobs),
                                                  cfg.algo.kl_type.rstrip("+")).sum().item())
        if cfg.algo.kl_in_reward:
            rewards -= kl_coef * torch.tensor(sequence_kl, dtype=torch.float64)
            metrics["gad/reward_kl"] = sum(sequence_kl) / max(len(sequence_kl), 1)
    advantages = losses.grpo_advantages(rewards, [r.row["uid"] for r in samples], norm_by_std=cfg.gad.norm_adv_by_std)
    for r, a in zip(samples, advantages.tolist()):
        r.fields.advantage = a
    for r in rollouts:
        r.fields.trains_policy = {"warmup": not r.generated, "critic": False, "gad": r.generated}[stage]
    metrics["gad/reward_mean"] = rewards.mean().item() if len(samples) else 0.0
    return metrics


def gad_loss(mb: MicroBatch, models: Models, cfg):
    """Warmup stage: SFT on the teacher's responses. GAD: PPO-clip (or GSPO, --gad.policy_loss)
    on the discriminator's advantages, plus --algo.kl_coef times the --algo.kl_type estimate
    of KL(policy ‖ initial policy) on the sampled tokens (unless it is in the reward), both
    aggregated alike."""
    if not mb.rollouts[0].generated:  # a stage trains on one kind of rollout only
        return sft_loss(mb, models, cfg)
    logprobs, entropy = policy_logprobs(mb, models, cfg)
    surrogate = cfg.gad.policy_loss
    loss, stats = grpo.clipped_loss(mb, logprobs, entropy, mb.per_sequence(lambda r: r.fields.advantage), cfg,
                                    surrogate)
    if mb.rollouts[0].fields.reference_logprobs is not None:
        reference = torch.tensor([v for r in mb.rollouts for v in r.fields.reference_logprobs], device=mb.device)
        mask = mb.response_mask
        kl = losses.kl_estimate(mb.matrix(logprobs), mb.matrix(reference), cfg.algo.kl_type) * mask
        stats["actor/kl"] = masked_stat(kl, mask)
        if not cfg.algo.kl_in_reward:
            loss = loss + cfg.algo.kl_coef * aggregate(mb, kl, mask, cfg,
                                                       "seq-mean-token-mean" if surrogate == "gspo" else "token-mean")
    return loss, stats


def build_models(cfg, initial, model_dir: str, d) -> dict:
    """The reference (unless --dpo.reference_free) and the discriminator with its AdamW."""
    models, o, g = build_reference(cfg, initial, model_dir, d), cfg.optim, cfg.gad
    network = discriminator.load(g.disc_path or model_dir, cfg.train.seed, d.world, d.device, g.pool)
    models["discriminator"] = discriminator.Critic(network, g.lr, o.weight_decay, g.grad_clip, (o.beta1, o.beta2))
    return models


OBJECTIVES = {
    "gad": Objective(loss=gad_loss, prepare=prepare_teacher_responses, before_update=gad_rewards,
                     counted=lambda r: r.fields.trains_policy, counted_only=True, row_fields=("teacher_response",),
                     build_models=build_models, after_update=refresh_reference,
                     held=lambda cfg: {**reference_held(cfg), "discriminator": "discriminator"}),
}

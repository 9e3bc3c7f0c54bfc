"""GRPO and GSPO: PPO-style clipped surrogates on group-relative advantages (docs/loop.md).

Its rows: grpo (PPO-clip; DAPO's clip-higher with --algo.eps_high=0.28) and gspo (the clipped
ratio is the sequence's geometric-mean ratio). The clipped surrogate is the hybrid's and GAD's too.
"""
import functools
from dataclasses import dataclass

import torch

import losses
from microbatch import (MicroBatch, Models, Objective, aggregate, correction_stats, engine_correction, give_fields,
                        masked_stat, old_or_current, policy_logprobs, rollout_stats)


@dataclass
class AlgoFlags:
    """GRPO's and GSPO's flags, under --algo."""
    norm_adv_by_std: bool = False  # GRPO's advantage divided by the group's std; off: Dr. GRPO, as in the SDPO runs
    eps_low: float = 0.2  # PPO clip
    eps_high: float = 0.2  # 0.28 for DAPO's clip-higher
    gspo_eps_low: float = 3e-4  # GSPO clips a sequence-level ratio: far narrower ranges
    gspo_eps_high: float = 4e-4


@dataclass
class Fields:
    """What GRPO writes on a rollout (Rollout.fields)."""
    advantage: float = 0.0  # GRPO/GSPO/hybrid/GAD


def prepare_advantages(rollouts: list, tokenizer, cfg) -> dict:
    """GRPO advantages per sample (docs/loop.md): reward minus its group's mean (Dr. GRPO,
    the SDPO runs' choice), or divided by the group's std with --algo.norm_adv_by_std."""
    give_fields(rollouts, Fields)
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    advantages = losses.grpo_advantages(rewards, [r.row["uid"] for r in rollouts], norm_by_std=cfg.algo.norm_adv_by_std)
    for r, a in zip(rollouts, advantages.tolist()):
        r.fields.advantage = a
    return {}


def clipped_loss(mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor, cfg,
                 surrogate: str = "ppo"):
    """The clipped surrogate of log-probs [N] (with gradient) against the old ones, times the
    engine correction, aggregated: PPO-clip (token-mean) or GSPO (seq-mean-token-mean).
    advantages: [B] or [B, R]."""
    old = old_or_current(mb, logprobs)
    mask = mb.response_mask
    if surrogate == "gspo":
        per_token, clipped = losses.gspo_loss(mb.matrix(logprobs), mb.matrix(old), advantages, mask,
                                              cfg.algo.gspo_eps_low, cfg.algo.gspo_eps_high)
        mode = "seq-mean-token-mean"
    else:
        per_token, clipped = losses.ppo_clip_loss(mb.matrix(logprobs), mb.matrix(old), advantages,
                                                  cfg.algo.eps_low, cfg.algo.eps_high)
        mode = "token-mean"
    correction = engine_correction(mb, old, cfg)
    loss = aggregate(mb, per_token * correction, mask, cfg, mode)
    stats = {**rollout_stats(mb, old, entropy), **correction_stats(correction, mask, cfg)}
    stats["actor/pg_clipfrac"] = masked_stat(clipped.float(), mask)
    return loss, stats


def grpo_loss(mb: MicroBatch, models: Models, cfg, surrogate: str = "ppo"):
    """PPO-clip on GRPO advantages (DAPO's clip-higher: --algo.eps_high=0.28); surrogate "gspo":
    GSPO, whose clipped ratio is the sequence's geometric-mean ratio (--algo.gspo_eps_*)."""
    logprobs, entropy = policy_logprobs(mb, models, cfg)
    return clipped_loss(mb, logprobs, entropy, mb.per_sequence(lambda r: r.fields.advantage), cfg, surrogate)


OBJECTIVES = {
    "grpo": Objective(loss=grpo_loss, prepare=prepare_advantages, moves=lambda r: r.fields.advantage != 0),
    "gspo": Objective(loss=functools.partial(grpo_loss, surrogate="gspo"), prepare=prepare_advantages,
                      moves=lambda r: r.fields.advantage != 0),
}

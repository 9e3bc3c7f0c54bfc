"""The λ-hybrid (paper section 4.5): PPO-clip on A = λ·A_GRPO + (1−λ)·(T_tok − S_tok), the SDPO
term only where the sample has a teacher context; GRPO's advantages and SDPO's teacher both."""
from dataclasses import dataclass

import torch

import chunked_head
import losses
from microbatch import MicroBatch, Models, Objective, forward, give_fields, logprob_head
from objectives import grpo, sdpo


@dataclass
class AlgoFlags:
    """The hybrid's flag, under --algo."""
    lam: float = 0.9  # hybrid: A = lam * A_grpo + (1 - lam) * A_sdpo


@dataclass
class Fields(sdpo.Fields, grpo.Fields):
    """What the hybrid writes on a rollout: GRPO's advantage and SDPO's teacher context."""


def prepare_hybrid(rollouts: list, tokenizer, cfg) -> dict:
    give_fields(rollouts, Fields)
    grpo.prepare_advantages(rollouts, tokenizer, cfg)
    return sdpo.prepare_teacher_contexts(rollouts, tokenizer, cfg)


def hybrid_loss(mb: MicroBatch, models: Models, cfg):
    """PPO-clip on A = λ·A_GRPO + (1−λ)·(T_tok − S_tok) (paper section 4.5), the SDPO term
    only where the sample has a teacher context (0 elsewhere)."""
    teacher_hidden = sdpo.teacher_hidden_for(mb, models, cfg)
    targets, temperature = mb.packed.targets, cfg.rollout.temperature

    def head(hidden, weight):
        logprobs, entropy = logprob_head(targets, temperature, cfg.train.head_chunk_size)(hidden, weight)
        teacher_weight = models.teacher.head_weight(weight).to(hidden.dtype)
        teacher_lp, teacher_entropy = chunked_head.logprobs_and_entropy_from_hidden(
            teacher_hidden.to(hidden.dtype), teacher_weight, targets, temperature, cfg.sdpo.chunk_size)
        return logprobs, entropy, teacher_lp, teacher_entropy

    logprobs, entropy, teacher_lp, teacher_entropy = forward(models.policy, mb.packed, head)
    current = mb.matrix(logprobs.detach())
    has_teacher = mb.per_sequence(lambda r: r.fields.sdpo_mask > 0)[:, None] > 0
    teacher_or_student = torch.where(has_teacher, mb.matrix(teacher_lp), current)  # T - S = 0 without a teacher
    advantages = losses.hybrid_advantages(mb.per_sequence(lambda r: r.fields.advantage), teacher_or_student, current,
                                          cfg.algo.lam)
    loss, stats = grpo.clipped_loss(mb, logprobs, entropy, advantages, cfg)
    stats.update(sdpo.teacher_diagnostics(mb, has_teacher * mb.response_mask, logprobs.detach(), entropy, teacher_lp,
                                          teacher_entropy, cfg.sdpo.success_threshold))
    return loss, stats


OBJECTIVES = {
    "hybrid": Objective(loss=hybrid_loss, prepare=prepare_hybrid, **sdpo.TEACHER,
                        moves=lambda r: r.fields.advantage != 0 or r.fields.sdpo_mask > 0),  # without a teacher T - S = 0
}

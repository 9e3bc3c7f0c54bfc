"""SDPO: distil the student towards the teacher shown a successful sibling and/or feedback.

The teacher (--sdpo.teacher; teacher.py) is the policy's own network under a richer prompt
(sdpo.py builds it); its hidden states at the response tokens feed a top-K divergence computed
chunk by chunk (chunked_head.py, losses.py). An EMA or frozen teacher's are computed once per
update (cache_teacher_hidden); the EMA moves after the update (after_update).
"""
import collections
import math
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

import chunked_head
import losses
from config import check_bounds
from errors import FlagError
from microbatch import (MicroBatch, Models, Objective, aggregate, clip_fraction, correction_stats, engine_correction,
                        forward, give_fields, idle_forward, masked_stat, old_or_current, pack, rollout_stats,
                        stats_by_kind)
from sdpo import SdpoConfig, build_teacher_batch
from teacher import Teacher


# --sdpo.*: the teacher contexts' flags (sdpo.SdpoConfig), then the distillation's and the teacher's
@dataclass
class Flags(SdpoConfig):
    distill: Literal["topk", "full", "token"] = "topk"
    # token_mean: the mean over the optimizer step's distilled tokens; seq_mean_token_mean: the mean
    # over all of its samples of each one's token mean, a sample without a teacher context counting 0
    # (lasgroup/SDPO's and TRL's). Which, and why the default: docs/loop.md, SDPO's aggregation
    loss_agg: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    topk: int = 100
    add_tail: bool = True
    # 0 forward KL, 1 reverse KL, between: generalized JSD. 0.5: the paper's choice without rich
    # feedback (Table 12); reverse KL (1.0) is its choice with rich feedback (tasks/quiz.py)
    alpha: float = 0.5
    is_clip: float = 2.0
    chunked: bool = True  # top-K loss from hidden states, never materialising [tokens, vocab]
    chunk_size: int = 512
    teacher: Literal["ema", "frozen", "trust-region", "live"] = "ema"
    teacher_rate: float = 0.05
    teacher_micro_batch: int = 32
    share_teacher_prefix: bool = True  # a group's question, then each distinct teacher prompt, once (KV cache)


@dataclass
class Section:
    """Its flags' section of the run's Config: --sdpo.* (objectives.Sections)."""
    sdpo: Flags = field(default_factory=Flags)


def check_flags(cfg):
    """Its flags' bounds, checked before any work starts (flags.check_config)."""
    check_bounds(cfg, at_least={"sdpo.topk": 1}, rates=("sdpo.teacher_rate",))
    if cfg.sdpo.loss_agg != "token_mean" and (cfg.algo.loss_agg_mode != "auto" or cfg.train.mask_truncated):
        clash = "--algo.loss_agg_mode" if cfg.algo.loss_agg_mode != "auto" else "--train.mask_truncated"
        raise FlagError(f"--sdpo.loss_agg={cfg.sdpo.loss_agg} divides by every sample of an optimizer step, and "
                        f"{clash} changes which count: drop one of the two")


@dataclass
class Fields:
    """What SDPO writes on a rollout (Rollout.fields)."""
    teacher_ids: list | None = None  # teacher prompt + the same response ids
    sdpo_mask: float = 0.0  # 1.0 when the sample has a teacher context
    teacher_context: str = ""  # "demonstration", "feedback" or "" (none)
    # written by cache_teacher_hidden on the rank that trains it, consumed by its micro-batch:
    teacher_hidden: torch.Tensor | None = None  # [R, H'] teacher hidden states at the response tokens


def prepare_teacher_contexts(rollouts: list, tokenizer, cfg) -> dict:
    """Each rollout's teacher input ids and self-distillation mask (sdpo.build_teacher_batch,
    sdpo.py), and per-group diagnostics: success with and without a successful
    sibling (a sample's own success excluded), which say where the demonstration signal is."""
    give_fields(rollouts, Fields)
    batch = build_teacher_batch(tokenizer, [r.row for r in rollouts], [r.response_ids for r in rollouts],
                                [r.text for r in rollouts], [r.reward for r in rollouts],
                                [r.feedback for r in rollouts], cfg.sdpo)
    for r, ids, mask, demo in zip(rollouts, batch.input_ids, batch.mask, batch.demo_index):
        r.fields.teacher_ids, r.fields.sdpo_mask = ids, float(mask)
        r.fields.teacher_context = "demonstration" if demo is not None else ("feedback" if mask else "")
    success = [r.reward >= cfg.sdpo.success_threshold for r in rollouts]
    group_successes = collections.Counter(r.row["uid"] for r, s in zip(rollouts, success) if s)
    with_sibling = [group_successes[r.row["uid"]] - s > 0 for r, s in zip(rollouts, success)]
    metrics = dict(batch.metrics)
    for name, kind in (("with", True), ("without", False)):
        chosen = [s for s, w in zip(success, with_sibling) if w == kind]
        metrics[f"sdpo/samples_{name}_successful_sibling"] = len(chosen) / max(len(rollouts), 1)
        if chosen:
            metrics[f"sdpo/success_{name}_successful_sibling"] = sum(chosen) / len(chosen)
    return metrics


def teacher_hidden_states(cfg, models: Models, rollouts: list, pad_id: int, device, world: int) -> list:
    """Teacher hidden states [R, H'] at the response tokens of each rollout with a teacher
    context (None for the others: their loss is masked out), teacher_micro_batch sequences per
    forward, a group's shared teacher prompt run once (docs/loop.md, Memory). Every rank calls
    this, an idle one with no rollouts: ranks run as many forwards as the busiest (FSDP2)."""
    used = [r for r in rollouts if r.fields.sdpo_mask > 0]
    calls = torch.tensor([math.ceil(len(used) / cfg.sdpo.teacher_micro_batch)])
    if world > 1:  # ranks differ in how many of their samples have a teacher context
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    share = cfg.sdpo.share_teacher_prefix and not cfg.model.gradient_checkpointing  # HF drops the KV cache under it

    def run_model(model, part, head):
        if not part:
            return idle_forward(model, pad_id, device, head, share, grouped=True)
        chosen = [used[i] for i in part]
        return forward(model, pack(model, [r.fields.teacher_ids for r in chosen], [len(r.response_ids) for r in chosen],
                                   pad_id, device, images=[r.row.get("images") for r in chosen], shared_prefix=share,
                                   groups=[r.row["uid"] for r in chosen]), head)
    hidden = models.teacher.hidden(models.policy, run_model, len(used), cfg.sdpo.teacher_micro_batch, int(calls))
    parts = iter(hidden.split([len(r.response_ids) for r in used]) if used else [])
    return [next(parts) if r.fields.sdpo_mask > 0 else None for r in rollouts]


def cache_teacher_hidden(cfg, models: Models, rollouts: list, pad_id: int, d) -> float:
    """Once per update, before its first optimizer step: an EMA or frozen teacher's hidden states
    for all of this rank's rollouts, kept on each for its micro-batch (why: docs/loop.md, Memory);
    a teacher that reads the policy (live, trust-region) runs per micro-batch. Returns seconds."""
    models.teacher.head_weight_source()  # a collective under FSDP2: gathered here, on every rank at once
    if models.teacher.reads_policy:
        return 0.0
    t0 = time.perf_counter()
    for r, hidden in zip(rollouts, teacher_hidden_states(cfg, models, rollouts, pad_id, d.device, d.world)):
        r.fields.teacher_hidden = hidden
    return time.perf_counter() - t0


def teacher_hidden_for(mb: MicroBatch, models: Models, cfg) -> torch.Tensor:
    """The micro-batch's teacher hidden states [N, H'] (zeros where a sample has no teacher
    context): taken from the rollouts (cache_teacher_hidden; then freed), or computed now for
    a teacher that reads the policy or a loss called outside update.update_policy."""
    if models.teacher.reads_policy or any(r.fields.sdpo_mask > 0 and r.fields.teacher_hidden is None
                                          for r in mb.rollouts):
        t0 = time.perf_counter()
        hidden = teacher_hidden_states(cfg, models, mb.rollouts, mb.pad_id, mb.device, mb.world)
        mb.seconds["teacher"] = mb.seconds.get("teacher", 0.0) + time.perf_counter() - t0
    else:
        hidden = [r.fields.teacher_hidden for r in mb.rollouts]
    for r in mb.rollouts:
        r.fields.teacher_hidden = None
    known = next((h for h in hidden if h is not None), None)
    width = known.shape[-1] if known is not None else models.teacher.hidden_size(models.policy)
    dtype = known.dtype if known is not None else torch.float32
    return torch.cat([h if h is not None else torch.zeros(len(r.response_ids), width, device=mb.device, dtype=dtype)
                      for h, r in zip(hidden, mb.rollouts)])


def sdpo_head(mb: MicroBatch, models: Models, cfg, teacher_hidden: torch.Tensor):
    """Head computing the per-token distillation loss [N] (losses.py) from the student's
    and teacher's hidden states, plus the student's detached token log-probs and entropy,
    and the teacher's token log-probs and entropy (diagnostics)."""
    sd, temperature, targets = cfg.sdpo, cfg.rollout.temperature, mb.packed.targets

    def head(hidden, weight):
        teacher_weight = models.teacher.head_weight(weight).to(hidden.dtype)
        th = teacher_hidden.to(hidden.dtype)
        no_grad_head = chunked_head.logprobs_and_entropy_from_hidden
        current, entropy = no_grad_head(hidden, weight, targets, temperature, sd.chunk_size)
        teacher_lp, teacher_entropy = no_grad_head(th, teacher_weight, targets, temperature, sd.chunk_size)
        if sd.distill == "topk" and sd.chunked:
            loss = chunked_head.sdpo_topk_loss_from_hidden(hidden, weight, th, teacher_weight, k=sd.topk,
                                                           alpha=sd.alpha, add_tail=sd.add_tail,
                                                           temperature=temperature, chunk_size=sd.chunk_size)
        elif sd.distill in ("topk", "full"):
            student_logits = hidden @ weight.T
            with torch.no_grad():
                teacher_logits = th @ teacher_weight.T
            if sd.distill == "topk":
                s, t, _ = losses.topk_with_tail(student_logits, teacher_logits, sd.topk, sd.add_tail,
                                                temperature=temperature)
            else:
                s = (student_logits.float() / temperature).log_softmax(-1)
                t = (teacher_logits.float() / temperature).log_softmax(-1)
            loss = losses.sdpo_divergence(s, t, sd.alpha)
        else:
            loss = losses.sdpo_token_loss(losses.token_logprobs(hidden @ weight.T, targets, temperature), teacher_lp)
        return loss, current, entropy, teacher_lp, teacher_entropy
    return head


def sdpo_loss(mb: MicroBatch, models: Models, cfg):
    """Distillation towards the teacher's next-token distributions on the student's own
    tokens, times the IS clip (several optimizer steps per batch) and the engine correction,
    over the samples with a teacher context (--sdpo.loss_agg: token-mean, or the mean over all the
    step's samples of each one's token mean)."""
    teacher_hidden = teacher_hidden_for(mb, models, cfg)
    loss, current, entropy, teacher_lp, teacher_entropy = forward(models.policy, mb.packed,
                                                                  sdpo_head(mb, models, cfg, teacher_hidden))
    old = old_or_current(mb, current)
    mask = mb.per_sequence(lambda r: r.fields.sdpo_mask)[:, None] * mb.response_mask
    is_clip = losses.importance_weights(mb.matrix(current), mb.matrix(old), cfg.sdpo.is_clip)
    correction = engine_correction(mb, old, cfg)
    per_token = mb.matrix(loss) * is_clip * correction
    divergence = mb.matrix(loss).detach()
    stats = {**rollout_stats(mb, old, entropy), **correction_stats(correction, mask, cfg),
             "sdpo/divergence": masked_stat(divergence, mask),
             "sdpo/is_clipfrac": clip_fraction(is_clip, cfg.sdpo.is_clip, mask)}
    right = lambda r: r.reward >= cfg.sdpo.success_threshold
    stats.update(stats_by_kind(mb, divergence, mask, {  # partitions the covered samples
        "sdpo/divergence_right": lambda r: right(r) and not r.truncated,
        "sdpo/divergence_wrong": lambda r: not (right(r) or r.truncated),
        "sdpo/divergence_truncated": lambda r: r.truncated}))
    stats.update(teacher_diagnostics(mb, mask, current, entropy, teacher_lp, teacher_entropy,
                                     cfg.sdpo.success_threshold))
    if cfg.sdpo.loss_agg == "seq_mean_token_mean":  # over all the step's samples (docs/loop.md, SDPO's aggregation)
        return losses.aggregate(per_token, mask, "seq-mean-token-mean", global_sequences=mb.counts["samples"]), stats
    return aggregate(mb, per_token, mask, cfg, "token-mean"), stats


def teacher_diagnostics(mb: MicroBatch, mask, student_lp, student_entropy, teacher_lp, teacher_entropy,
                        success_threshold: float) -> dict:
    """Whether the teacher knows more than the student (docs/metrics.md, sdpo/): teacher entropy
    and teacher-minus-student entropy, and teacher-minus-student log-prob of the sampled tokens
    by kind of teacher context, by the success of a sample shown a demonstration, and at the
    EOS that ended each finished answer."""
    logprob_gap = mb.matrix(teacher_lp - student_lp)
    entropy_gap = mb.matrix(teacher_entropy - student_entropy)
    stats = {"sdpo/teacher_entropy": masked_stat(mb.matrix(teacher_entropy), mask),
             "sdpo/teacher_minus_student_entropy": masked_stat(entropy_gap, mask)}
    demo = lambda r: r.fields.teacher_context == "demonstration"
    stats.update(stats_by_kind(mb, logprob_gap, mask, {
        "sdpo/teacher_minus_student_logprob_demo": demo,
        "sdpo/teacher_minus_student_logprob_feedback": lambda r: r.fields.teacher_context == "feedback",
        "sdpo/teacher_minus_student_logprob_demo_right": lambda r: demo(r) and r.reward >= success_threshold,
        "sdpo/teacher_minus_student_logprob_demo_wrong": lambda r: demo(r) and r.reward < success_threshold}))
    eos = mask * (torch.arange(mask.shape[1], device=mask.device)[None, :]
                  == mb.per_sequence(lambda r: len(r.response_ids) - 1)[:, None])
    stats["sdpo/teacher_minus_student_logprob_eos"] = masked_stat(
        logprob_gap, eos * (1 - mb.per_sequence(lambda r: r.truncated))[:, None])
    return stats


# ----------------------------------------------------------------------------------------
# The teacher: built with the policy, kept for the micro-batches, moved after the update


def build_teacher(cfg, initial, model_dir: str, d) -> dict:
    """--sdpo.teacher: a copy of the initial policy (ema, frozen, trust-region), or none (live)."""
    return {"teacher": Teacher(cfg.sdpo.teacher, cfg.sdpo.teacher_rate, initial() if cfg.sdpo.teacher != "live" else None)}


def idle_teacher(models: Models, cfg, pad_id: int, d):
    """A rank with no micro-batch runs the forwards of a teacher that reads the policy (collectives)."""
    if models.teacher.reads_policy:
        teacher_hidden_states(cfg, models, [], pad_id, d.device, d.world)


def move_teacher(models: Models, stepped: bool, steps_done: int) -> dict:
    """After the update: the EMA teacher's step towards the policy."""
    models.teacher.update(models.policy, stepped)  # EMA only after a real optimizer step
    return {}


# The hooks of every objective with SDPO's teacher (the hybrid's too)
TEACHER = dict(build_models=build_teacher,
               before_gradients=lambda rollouts, models, cfg, pad_id, d: {
                   "teacher": cache_teacher_hidden(cfg, models, rollouts, pad_id, d)},
               forwards_first=lambda models: not models.teacher.reads_policy, idle_forwards=idle_teacher,
               after_update=move_teacher, held=lambda cfg: {"teacher": "copy"} if cfg.sdpo.teacher != "live" else {})

OBJECTIVES = {
    "sdpo": Objective(loss=sdpo_loss, prepare=prepare_teacher_contexts, counted=lambda r: r.fields.sdpo_mask > 0,
                      **TEACHER),
}

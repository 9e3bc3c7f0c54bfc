"""Every objective of the loop in one place: what it needs from a rollout batch, and its loss.

run.py's loop never names an algorithm: it looks `--algo` up once in OBJECTIVES and calls that
row's plain functions at fixed points of a step (the fields of `Objective`; docs/loop.md,
Adding an objective). The types they read (Rollout, MicroBatch, Models) and the mechanics every
loss shares (the forward pass, the engine-vs-trainer correction, the rollout statistics,
`aggregate`) are written once, in microbatch.py.
"""
import collections
import dataclasses
import functools
import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import chunked_head
import data
import losses
import sdpo
from distributed import Dist, reshard
from microbatch import (MicroBatch, Models, Rollout, aggregate, clip_fraction, correction_stats, engine_correction,
                        forward, idle_forward, logprob_head, masked_stat, old_or_current, pack, policy_logprobs,
                        response_logprobs, rollout_stats, share_prompts, stats_by_kind)


# ----------------------------------------------------------------------------------------
# GRPO, GSPO: PPO-style clipped surrogates on group-relative advantages


def prepare_advantages(rollouts: list, tokenizer, cfg) -> dict:
    """GRPO advantages per sample (docs/loop.md): reward minus its group's mean (Dr. GRPO,
    the SDPO runs' choice), or divided by the group's std with --algo.norm_adv_by_std."""
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    advantages = losses.grpo_advantages(rewards, [r.row["uid"] for r in rollouts], norm_by_std=cfg.algo.norm_adv_by_std)
    for r, a in zip(rollouts, advantages.tolist()):
        r.advantage = a
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
    return clipped_loss(mb, logprobs, entropy, mb.per_sequence(lambda r: r.advantage), cfg, surrogate)


# ----------------------------------------------------------------------------------------
# SDPO: distil the student towards the teacher shown a successful sibling and/or feedback


def prepare_teacher_contexts(rollouts: list, tokenizer, cfg) -> dict:
    """Each rollout's teacher input ids and self-distillation mask (sdpo.build_teacher_batch,
    sdpo.py), and per-group diagnostics: success with and without a successful
    sibling (a sample's own success excluded), which say where the demonstration signal is."""
    batch = sdpo.build_teacher_batch(tokenizer, [r.row for r in rollouts], [r.response_ids for r in rollouts],
                                     [r.text for r in rollouts], [r.reward for r in rollouts],
                                     [r.feedback for r in rollouts], cfg.sdpo)
    for r, ids, mask, demo in zip(rollouts, batch.input_ids, batch.mask, batch.demo_index):
        r.teacher_ids, r.sdpo_mask = ids, float(mask)
        r.teacher_context = "demonstration" if demo is not None else ("feedback" if mask else "")
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


def prepare_hybrid(rollouts: list, tokenizer, cfg) -> dict:
    prepare_advantages(rollouts, tokenizer, cfg)
    return prepare_teacher_contexts(rollouts, tokenizer, cfg)


def teacher_hidden_states(cfg, models: Models, rollouts: list, pad_id: int, device, world: int) -> list:
    """Teacher hidden states [R, H'] at the response tokens of each rollout with a teacher
    context (None for the others: their loss is masked out), teacher_micro_batch sequences per
    forward, a group's shared teacher prompt run once (docs/loop.md, Memory). Every rank calls
    this, an idle one with no rollouts: ranks run as many forwards as the busiest (FSDP2)."""
    used = [r for r in rollouts if r.sdpo_mask > 0]
    calls = torch.tensor([math.ceil(len(used) / cfg.sdpo.teacher_micro_batch)])
    if world > 1:  # ranks differ in how many of their samples have a teacher context
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    share = cfg.sdpo.share_teacher_prefix and not cfg.model.gradient_checkpointing  # HF drops the KV cache under it

    def run_model(model, part, head):
        if not part:
            return idle_forward(model, pad_id, device, head, share, grouped=True)
        chosen = [used[i] for i in part]
        return forward(model, pack(model, [r.teacher_ids for r in chosen], [len(r.response_ids) for r in chosen],
                                   pad_id, device, images=[r.row.get("images") for r in chosen], shared_prefix=share,
                                   groups=[r.row["uid"] for r in chosen]), head)
    hidden = models.teacher.hidden(models.policy, run_model, len(used), cfg.sdpo.teacher_micro_batch, int(calls))
    parts = iter(hidden.split([len(r.response_ids) for r in used]) if used else [])
    return [next(parts) if r.sdpo_mask > 0 else None for r in rollouts]


def cache_teacher_hidden(cfg, models: Models, rollouts: list, pad_id: int, d: Dist) -> float:
    """Once per update, before its first optimizer step: an EMA or frozen teacher's hidden states
    for all of this rank's rollouts, kept on each for its micro-batch (why: docs/loop.md, Memory);
    a teacher that reads the policy (live, trust-region) runs per micro-batch. Returns seconds."""
    models.teacher.head_weight_source()  # a collective under FSDP2: gathered here, on every rank at once
    if models.teacher.reads_policy:
        return 0.0
    t0 = time.perf_counter()
    for r, hidden in zip(rollouts, teacher_hidden_states(cfg, models, rollouts, pad_id, d.device, d.world)):
        r.teacher_hidden = hidden
    return time.perf_counter() - t0


def teacher_hidden_for(mb: MicroBatch, models: Models, cfg) -> torch.Tensor:
    """The micro-batch's teacher hidden states [N, H'] (zeros where a sample has no teacher
    context): taken from the rollouts (cache_teacher_hidden; then freed), or computed now for
    a teacher that reads the policy or a loss called outside run.update_policy."""
    if models.teacher.reads_policy or any(r.sdpo_mask > 0 and r.teacher_hidden is None for r in mb.rollouts):
        t0 = time.perf_counter()
        hidden = teacher_hidden_states(cfg, models, mb.rollouts, mb.pad_id, mb.device, mb.world)
        mb.seconds["teacher"] = mb.seconds.get("teacher", 0.0) + time.perf_counter() - t0
    else:
        hidden = [r.teacher_hidden for r in mb.rollouts]
    for r in mb.rollouts:
        r.teacher_hidden = None
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
    over the samples with a teacher context (token-mean)."""
    teacher_hidden = teacher_hidden_for(mb, models, cfg)
    loss, current, entropy, teacher_lp, teacher_entropy = forward(models.policy, mb.packed,
                                                                  sdpo_head(mb, models, cfg, teacher_hidden))
    old = old_or_current(mb, current)
    mask = mb.per_sequence(lambda r: r.sdpo_mask)[:, None] * mb.response_mask
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
    demo = lambda r: r.teacher_context == "demonstration"
    stats.update(stats_by_kind(mb, logprob_gap, mask, {
        "sdpo/teacher_minus_student_logprob_demo": demo,
        "sdpo/teacher_minus_student_logprob_feedback": lambda r: r.teacher_context == "feedback",
        "sdpo/teacher_minus_student_logprob_demo_right": lambda r: demo(r) and r.reward >= success_threshold,
        "sdpo/teacher_minus_student_logprob_demo_wrong": lambda r: demo(r) and r.reward < success_threshold}))
    eos = mask * (torch.arange(mask.shape[1], device=mask.device)[None, :]
                  == mb.per_sequence(lambda r: len(r.response_ids) - 1)[:, None])
    stats["sdpo/teacher_minus_student_logprob_eos"] = masked_stat(
        logprob_gap, eos * (1 - mb.per_sequence(lambda r: r.truncated))[:, None])
    return stats


def hybrid_loss(mb: MicroBatch, models: Models, cfg):
    """PPO-clip on A = λ·A_GRPO + (1−λ)·(T_tok − S_tok) (paper section 4.5), the SDPO term
    only where the sample has a teacher context (0 elsewhere)."""
    teacher_hidden = teacher_hidden_for(mb, models, cfg)
    targets, temperature = mb.packed.targets, cfg.rollout.temperature

    def head(hidden, weight):
        logprobs, entropy = logprob_head(targets, temperature, cfg.train.head_chunk_size)(hidden, weight)
        teacher_weight = models.teacher.head_weight(weight).to(hidden.dtype)
        teacher_lp, teacher_entropy = chunked_head.logprobs_and_entropy_from_hidden(
            teacher_hidden.to(hidden.dtype), teacher_weight, targets, temperature, cfg.sdpo.chunk_size)
        return logprobs, entropy, teacher_lp, teacher_entropy

    logprobs, entropy, teacher_lp, teacher_entropy = forward(models.policy, mb.packed, head)
    current = mb.matrix(logprobs.detach())
    has_teacher = mb.per_sequence(lambda r: r.sdpo_mask > 0)[:, None] > 0
    teacher_or_student = torch.where(has_teacher, mb.matrix(teacher_lp), current)  # T - S = 0 without a teacher
    advantages = losses.hybrid_advantages(mb.per_sequence(lambda r: r.advantage), teacher_or_student, current,
                                          cfg.algo.lam)
    loss, stats = clipped_loss(mb, logprobs, entropy, advantages, cfg)
    stats.update(teacher_diagnostics(mb, has_teacher * mb.response_mask, logprobs.detach(), entropy, teacher_lp,
                                     teacher_entropy, cfg.sdpo.success_threshold))
    return loss, stats


# ----------------------------------------------------------------------------------------
# SFT: the rows' reference responses (`--algo sft`, and the tiny model's warm start)


def sft_loss(mb: MicroBatch, models: Models, cfg):
    """Negative log-likelihood of the reference tokens at temperature 1, token-mean."""
    logprobs, entropy = policy_logprobs(mb, models, cfg, temperature=1.0)
    loss = aggregate(mb, -mb.matrix(logprobs), mb.response_mask, cfg, "token-mean")
    return loss, {"actor/entropy": (entropy.sum().item(), float(entropy.numel()))}


# ----------------------------------------------------------------------------------------
# DPO (online, and SPIN): preference pairs among a prompt's samples, or the row's reference
# response over each sample, against a frozen reference model


def preference_pairs(rewards: list, mode: str) -> tuple[list, int]:
    """(chosen, rejected) index pairs among one prompt's samples, and how many candidate
    pairs were skipped for a tie. best_worst: the best sample over the worst (the first of
    each when several share the reward), one candidate per prompt; all: every two samples
    with different rewards, the better one chosen."""
    n = len(rewards)
    if mode == "best_worst":
        if n < 2:
            return [], 0
        best = max(range(n), key=lambda i: rewards[i])
        worst = min(range(n), key=lambda i: rewards[i])
        return ([], 1) if rewards[best] == rewards[worst] else ([(best, worst)], 0)
    if mode != "all":
        raise ValueError(f"unknown pairing {mode!r}; choose best_worst or all")
    pairs = [(i, j) if rewards[i] > rewards[j] else (j, i)
             for i, j in itertools.combinations(range(n), 2) if rewards[i] != rewards[j]]
    return pairs, n * (n - 1) // 2 - len(pairs)


def engine_eos(rollouts: list, tokenizer) -> int:
    """The token the engine's finished responses end with (the commonest, when a model has
    several stop tokens); the tokenizer's EOS when every response was truncated."""
    ends = [r.response_ids[-1] for r in rollouts if r.generated and not r.truncated and r.response_ids]
    return max(set(ends), key=ends.count) if ends else tokenizer.eos_token_id


def reference_rollout(group: list, tokenizer, eos: int, needed_by: str, key: str = "reference") -> Rollout:
    """The row's reference response (row[key]) as a rollout appended after a prompt's group:
    tokenised, ending with eos, not generated (no engine log-probs)."""
    first = group[0]
    ids = data.reference_response_ids(tokenizer, first.row, eos, needed_by, key)
    return Rollout(row=first.row, prompt_ids=first.prompt_ids, response_ids=ids, rollout_logprobs=[0.0] * len(ids),
                   text=first.row[key], truncated=False, generated=False, sample_index=len(group))


def prompt_groups(rollouts: list) -> list[list]:
    """Rollouts grouped by their row's uid, in order of first appearance."""
    groups = {}
    for r in rollouts:
        groups.setdefault(r.row["uid"], []).append(r)
    return list(groups.values())


def prepare_pairs(rollouts: list, tokenizer, cfg) -> dict:
    """Preference pairs within each prompt's samples, written onto the chosen rollout
    (preferred_over) and marked on both (paired); --dpo.chosen reference (SPIN): the row's
    reference response, appended as a rollout, over each sample (docs/loop.md, Online DPO)."""
    if cfg.dpo.chosen == "sample" and cfg.rollout.n < 2:
        raise ValueError(f"--algo dpo needs --rollout.n >= 2 samples per prompt to pair (got {cfg.rollout.n}), "
                         "or --dpo.chosen reference")
    eos = engine_eos(rollouts, tokenizer) if cfg.dpo.chosen == "reference" else None
    pairs, ties, prompts_with_pair, groups = 0, 0, 0, prompt_groups(rollouts)
    for group in groups:
        for i, r in enumerate(group):
            r.sample_index = i
        if cfg.dpo.chosen == "reference":
            reference = reference_rollout(group, tokenizer, eos, "--dpo.chosen reference")
            found = [(len(group), r.sample_index) for r in group if r.response_ids != reference.response_ids]
            ties += len(group) - len(found)
            group.append(reference)
            rollouts.append(reference)
        else:
            found, tied = preference_pairs([r.reward for r in group], cfg.dpo.pairs)
            ties += tied
        if cfg.train.mask_truncated:  # a pair with a truncated sample would give it a loss
            found = [(c, j) for c, j in found if not (group[c].truncated or group[j].truncated)]
        for chosen, rejected in found:
            group[chosen].preferred_over.append(rejected)
            group[chosen].paired = group[rejected].paired = True
        pairs += len(found)
        prompts_with_pair += bool(found)
    return {"dpo/pairs": pairs, "dpo/ties_skipped": ties, "dpo/prompts_with_pair": prompts_with_pair / len(groups)}


def reference_token_logprobs(rollouts: list, models: Models, cfg, pad_id: int, d: Dist, metrics: dict) -> list:
    """Each rollout's per-token log-probs under the reference model (all ranks take part; each
    scores a share); the seconds it took go into metrics["time/reference_s"]."""
    t0 = time.perf_counter()
    token_logprobs = response_logprobs(models.reference.model, rollouts, pad_id, d, cfg.train.micro_batch,
                                       cfg.rollout.temperature, share_prompts(cfg))
    reshard(models.reference.model)  # a no-grad forward leaves FSDP2's root unsharded
    metrics["time/reference_s"] = time.perf_counter() - t0
    return token_logprobs


def reference_logprobs(rollouts: list, models: Models, cfg, pad_id: int, d: Dist) -> dict:
    """Every paired rollout's log-prob under the reference model, once per step, before the update."""
    metrics = {}
    if models.reference is None:  # --dpo.reference_free
        return metrics
    paired = [r for r in rollouts if r.paired]
    for r, logprobs in zip(paired, reference_token_logprobs(paired, models, cfg, pad_id, d, metrics)):
        value = math.fsum(logprobs)
        r.reference_logprob = value / max(len(logprobs), 1) if cfg.dpo.loss_type == "ipo" else value
    return metrics


def pair_positions(rollouts: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in rollouts of each pair's chosen and rejected response ([P] each)."""
    where = {(r.row["uid"], r.sample_index): i for i, r in enumerate(rollouts)}
    chosen, rejected = [], []
    for i, r in enumerate(rollouts):
        for j in r.preferred_over:
            chosen.append(i)
            rejected.append(where[(r.row["uid"], j)])
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)


def dpo_loss(mb: MicroBatch, models: Models, cfg):
    """The DPO family's loss (--dpo.loss_type, β, label smoothing) of this micro-batch's
    pairs, summed and divided by the optimizer step's global pair count (a pair's two responses
    share a micro-batch: keep_prompts_together). No engine correction nor ratio clip: DPO is
    off-policy, as in TRL's online DPO and verl's SPIN (docs/loop.md)."""
    dp = cfg.dpo
    logprobs, entropy = policy_logprobs(mb, models, cfg)
    policy = mb.matrix(logprobs).sum(-1)  # each response's log-prob [B]
    if dp.loss_type == "ipo":  # the mean over its tokens, as TRL does (so is reference_logprob)
        policy = policy / mb.per_sequence(lambda r: len(r.response_ids)).clamp(min=1)
    reference = mb.per_sequence(lambda r: r.reference_logprob)  # ignored with --dpo.reference_free
    chosen, rejected = (i.to(mb.device) for i in pair_positions(mb.rollouts))
    pair_losses, chosen_rewards, rejected_rewards = losses.dpo_loss(
        policy[chosen], policy[rejected], reference[chosen], reference[rejected], beta=dp.beta,
        kind=dp.loss_type, label_smoothing=dp.label_smoothing, reference_free=dp.reference_free)
    pairs = float(len(chosen))
    sampled = torch.cat([torch.full((len(r.response_ids),), float(r.generated), device=mb.device)
                         for r in mb.rollouts])
    stats = rollout_stats(mb, old_or_current(mb, logprobs), entropy, sampled)
    stats.update({
        "dpo/rewards_chosen": (chosen_rewards.sum().item(), pairs),
        "dpo/rewards_rejected": (rejected_rewards.sum().item(), pairs),
        "dpo/margin": ((chosen_rewards - rejected_rewards).sum().item(), pairs),
        "dpo/accuracy": ((chosen_rewards > rejected_rewards).float().sum().item(), pairs),
        "dpo/logps_chosen": (policy[chosen].detach().sum().item(), pairs),
        "dpo/logps_rejected": (policy[rejected].detach().sum().item(), pairs),
    })
    return pair_losses.sum() / mb.counts["pairs"], stats


# ----------------------------------------------------------------------------------------
# GAD: on-policy distillation from a black-box teacher's text, a discriminator as the reward
# (arXiv 2511.10643; the step, its stages and where it departs from the paper: docs/gad.md)


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
    return {"gad/teacher_length": sum(len(r.response_ids) for r in teachers) / max(len(teachers), 1)}


def gad_rewards(rollouts: list, models: Models, cfg, pad_id: int, d: Dist) -> dict:
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
            r.discriminator_score = next(scores)
    metrics = {**update.metrics, "gad/stage": ("warmup", "critic", "gad").index(stage),
               "time/discriminator_s": time.perf_counter() - t0}
    samples = [r for r in rollouts if r.generated]
    truncated = [r.discriminator_score for r in samples if r.truncated]
    if truncated:  # scored as they are: no EOS at the end
        metrics["gad/student_score_truncated"] = sum(truncated) / len(truncated)
    rewards = torch.tensor([r.discriminator_score for r in samples], dtype=torch.float64)
    if cfg.gad.reward == "constant":  # the control: no signal, only the KL to the start moves the policy
        rewards.zero_()
    if stage == "gad" and models.reference is not None:
        sequence_kl = []
        for r, logprobs in zip(samples, reference_token_logprobs(samples, models, cfg, pad_id, d, metrics)):
            r.reference_logprobs = logprobs
            sequence_kl.append(losses.kl_estimate(torch.tensor(r.rollout_logprobs), torch.tensor(logprobs),
                                                  cfg.algo.kl_type.rstrip("+")).sum().item())
        if cfg.algo.kl_in_reward:
            rewards -= kl_coef * torch.tensor(sequence_kl, dtype=torch.float64)
            metrics["gad/reward_kl"] = sum(sequence_kl) / max(len(sequence_kl), 1)
    advantages = losses.grpo_advantages(rewards, [r.row["uid"] for r in samples], norm_by_std=cfg.gad.norm_adv_by_std)
    for r, a in zip(samples, advantages.tolist()):
        r.advantage = a
    for r in rollouts:
        r.trains_policy = {"warmup": not r.generated, "critic": False, "gad": r.generated}[stage]
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
    loss, stats = clipped_loss(mb, logprobs, entropy, mb.per_sequence(lambda r: r.advantage), cfg, surrogate)
    if mb.rollouts[0].reference_logprobs is not None:
        reference = torch.tensor([v for r in mb.rollouts for v in r.reference_logprobs], device=mb.device)
        mask = mb.response_mask
        kl = losses.kl_estimate(mb.matrix(logprobs), mb.matrix(reference), cfg.algo.kl_type) * mask
        stats["actor/kl"] = masked_stat(kl, mask)
        if not cfg.algo.kl_in_reward:
            loss = loss + cfg.algo.kl_coef * aggregate(mb, kl, mask, cfg,
                                                       "seq-mean-token-mean" if surrogate == "gspo" else "token-mean")
    return loss, stats


# ----------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Objective:
    loss: Callable  # (micro-batch, models, cfg) -> (loss, {metric: (sum, count)})
    prepare: Callable = lambda rollouts, tokenizer, cfg: {}  # rank 0, after scoring -> metrics
    # every rank, on the shared rollouts, before the update (old log-probs are the loop's):
    # (rollouts, models, cfg, pad_id, dist) -> metrics
    before_update: Callable = lambda rollouts, models, cfg, pad_id, d: {}
    counted: Callable = lambda rollout: True  # counts in the loss's normalisation
    # whether its loss can have a gradient: an optimizer step with none is skipped before any forward
    moves: Callable = lambda rollout: True
    counts: Callable = lambda rollouts: {}  # more global counts of an optimizer step
    counted_only: bool = False  # True: uncounted rollouts are left out of the micro-batches
    keep_prompts_together: bool = False  # True: a prompt's samples always share a micro-batch
    models: tuple = ()  # optional models: "teacher", "reference", "discriminator"
    row_fields: tuple = ()  # fields every training row must have
    references: bool = False  # train on the rows' references instead of generating


def without_truncated(objective: Objective) -> Objective:
    """The objective with its truncated samples left out of every loss and of the optimizer
    steps' counts (--train.mask_truncated): they are not counted, so not in any micro-batch.
    What prepare wrote from the whole batch (GRPO's advantages, SDPO's demonstrations) stays."""
    return dataclasses.replace(objective, counted=lambda r: objective.counted(r) and not r.truncated,
                               counted_only=True)


OBJECTIVES = {
    "sdpo": Objective(loss=sdpo_loss, prepare=prepare_teacher_contexts, counted=lambda r: r.sdpo_mask > 0,
                      models=("teacher",)),
    "grpo": Objective(loss=grpo_loss, prepare=prepare_advantages, moves=lambda r: r.advantage != 0),
    "gspo": Objective(loss=functools.partial(grpo_loss, surrogate="gspo"), prepare=prepare_advantages,
                      moves=lambda r: r.advantage != 0),
    "hybrid": Objective(loss=hybrid_loss, prepare=prepare_hybrid, models=("teacher",),
                        moves=lambda r: r.advantage != 0 or r.sdpo_mask > 0),  # without a teacher T - S = 0
    "sft": Objective(loss=sft_loss, references=True),
    "dpo": Objective(loss=dpo_loss, prepare=prepare_pairs, before_update=reference_logprobs,
                     counted=lambda r: r.paired, counted_only=True, keep_prompts_together=True,
                     counts=lambda rollouts: {"pairs": sum(len(r.preferred_over) for r in rollouts)},
                     models=("reference",)),
    "gad": Objective(loss=gad_loss, prepare=prepare_teacher_responses, before_update=gad_rewards,
                     counted=lambda r: r.trains_policy, counted_only=True, models=("reference", "discriminator"),
                     row_fields=("teacher_response",)),
}

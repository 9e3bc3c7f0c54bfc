"""Online DPO and SPIN: preference pairs among a prompt's samples, or the row's reference
response over each sample, against a frozen reference model (docs/loop.md, Online DPO).

The reference (teacher.Reference) is refreshed to the policy every --dpo.ref_update_every
steps (SPIN's iterations: after_update); GAD keeps one too, as its KL anchor.
"""
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

import data
import losses
from config import check_bounds
from distributed import reshard
from errors import FlagError
from microbatch import (MicroBatch, Models, Objective, Rollout, give_fields, old_or_current, policy_logprobs,
                        response_logprobs, rollout_stats, share_prompts)
from teacher import Reference


@dataclass
class Flags:
    """Online DPO (pairs among a prompt's samples) and SPIN (the row's reference over each sample)."""
    pairs: Literal["best_worst", "all"] = "best_worst"  # per prompt: best sample over worst, or every pair
    # with a reward difference
    chosen: Literal["sample", "reference"] = "sample"  # reference: SPIN, the row's reference is always chosen
    loss_type: Literal[losses.DPO_KINDS] = "sigmoid"  # sigmoid, ipo (length-normalised log-probs), hinge, robust
    beta: float = 0.1
    label_smoothing: float = 0.0  # ε of sigmoid (conservative DPO) and robust; < 0.5
    ref_update_every: int = 0  # the reference becomes the policy every N steps (SPIN's iterations); 0: never
    reference_free: bool = False  # no reference model: the log-ratios are the policy's log-probs alone


@dataclass
class Section:
    """Its flags' section of the run's Config: --dpo.* (objectives.Sections)."""
    dpo: Flags = field(default_factory=Flags)


def check_flags(cfg):
    """Its flags' bounds, checked before any work starts (flags.check_config)."""
    check_bounds(cfg, at_least={"dpo.ref_update_every": 0}, positive=("dpo.beta",))
    if not 0 <= cfg.dpo.label_smoothing < 0.5:
        raise FlagError(f"--dpo.label_smoothing={cfg.dpo.label_smoothing}: must be at least 0 and below 0.5")
    if cfg.dpo.reference_free and cfg.dpo.ref_update_every:
        raise FlagError("--dpo.reference_free has no reference to refresh: drop --dpo.ref_update_every")


@dataclass
class Fields:
    """What DPO writes on a rollout (Rollout.fields)."""
    sample_index: int = 0  # position among its prompt's rollouts
    preferred_over: list = field(default_factory=list)  # sample_index of each sibling it is chosen over
    paired: bool = False  # in at least one preference pair
    reference_logprob: float = 0.0  # response log-prob under the reference (summed; IPO: mean)


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
                   text=first.row[key], truncated=False, generated=False)


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
    give_fields(rollouts, Fields)
    eos = engine_eos(rollouts, tokenizer) if cfg.dpo.chosen == "reference" else None
    pairs, ties, prompts_with_pair, groups = 0, 0, 0, prompt_groups(rollouts)
    for group in groups:
        for i, r in enumerate(group):
            r.fields.sample_index = i
        if cfg.dpo.chosen == "reference":
            reference = reference_rollout(group, tokenizer, eos, "--dpo.chosen reference")
            reference.fields = Fields(sample_index=len(group))
            found = [(len(group), r.fields.sample_index) for r in group if r.response_ids != reference.response_ids]
            ties += len(group) - len(found)
            group.append(reference)
            rollouts.append(reference)
        else:
            found, tied = preference_pairs([r.reward for r in group], cfg.dpo.pairs)
            ties += tied
        if cfg.train.mask_truncated:  # a pair with a truncated sample would give it a loss
            found = [(c, j) for c, j in found if not (group[c].truncated or group[j].truncated)]
        for chosen, rejected in found:
            group[chosen].fields.preferred_over.append(rejected)
            group[chosen].fields.paired = group[rejected].fields.paired = True
        pairs += len(found)
        prompts_with_pair += bool(found)
    return {"dpo/pairs": pairs, "dpo/ties_skipped": ties, "dpo/prompts_with_pair": prompts_with_pair / len(groups)}


def reference_token_logprobs(rollouts: list, models: Models, cfg, pad_id: int, d, metrics: dict) -> list:
    """Each rollout's per-token log-probs under the reference model (all ranks take part; each
    scores a share); the seconds it took go into metrics["time/reference_s"]."""
    t0 = time.perf_counter()
    token_logprobs = response_logprobs(models.reference.model, rollouts, pad_id, d, cfg.train.micro_batch,
                                       cfg.rollout.temperature, share_prompts(cfg))
    reshard(models.reference.model)  # a no-grad forward leaves FSDP2's root unsharded
    metrics["time/reference_s"] = time.perf_counter() - t0
    return token_logprobs


def reference_logprobs(rollouts: list, models: Models, cfg, pad_id: int, d) -> dict:
    """Every paired rollout's log-prob under the reference model, once per step, before the update."""
    metrics = {}
    if "reference" not in models.extra:  # --dpo.reference_free
        return metrics
    paired = [r for r in rollouts if r.fields.paired]
    for r, logprobs in zip(paired, reference_token_logprobs(paired, models, cfg, pad_id, d, metrics)):
        value = math.fsum(logprobs)
        r.fields.reference_logprob = value / max(len(logprobs), 1) if cfg.dpo.loss_type == "ipo" else value
    return metrics


def pair_positions(rollouts: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in rollouts of each pair's chosen and rejected response ([P] each)."""
    where = {(r.row["uid"], r.fields.sample_index): i for i, r in enumerate(rollouts)}
    chosen, rejected = [], []
    for i, r in enumerate(rollouts):
        for j in r.fields.preferred_over:
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
    reference = mb.per_sequence(lambda r: r.fields.reference_logprob)  # ignored with --dpo.reference_free
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
# The reference: a frozen copy of the initial policy, refreshed every --dpo.ref_update_every steps


def build_reference(cfg, initial, model_dir: str, d) -> dict:
    """The reference model, unless --dpo.reference_free."""
    return {} if cfg.dpo.reference_free else {"reference": Reference(initial(), cfg.dpo.ref_update_every)}


def reference_held(cfg) -> dict:
    """What build_reference makes, before it does (plan.py, check_out_dir)."""
    return {} if cfg.dpo.reference_free else {"reference": "copy"}


def refresh_reference(models: Models, stepped: bool, steps_done: int) -> dict:
    """The reference becomes the policy after every --dpo.ref_update_every-th step (SPIN)."""
    if "reference" not in models.extra:
        return {}
    return {"reference/refreshed": float(models.reference.refresh(models.policy, steps_done))}


OBJECTIVES = {
    "dpo": Objective(loss=dpo_loss, prepare=prepare_pairs, before_update=reference_logprobs,
                     counted=lambda r: r.fields.paired, counted_only=True, keep_prompts_together=True,
                     counts=lambda rollouts: {"pairs": sum(len(r.fields.preferred_over) for r in rollouts)},
                     build_models=build_reference, after_update=refresh_reference, held=reference_held),
}

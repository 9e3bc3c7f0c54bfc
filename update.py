"""One rollout batch's update: --train.mini_batches optimizer steps, each accumulating this
rank's micro-batches, every loss normalised by the optimizer step's global counts (all
micro-batches, all ranks), so that the gradient does not depend on micro-batching or the
number of ranks. The objective (a row of objectives.OBJECTIVES) supplies the loss and the
hooks around it; nothing here names an algorithm or its models."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import microbatch
from data import stream_seed
from distributed import Dist, from_every_rank, full_tensor
from microbatch import Models, Objective, without_truncated
from policy import CausalLM

if TYPE_CHECKING:
    from config import Config
    from policy import Trainer


@dataclass
class Prepared:
    """An update up to its first gradient pass (prepare_update)."""
    objective: Objective  # the row, less its truncated samples with --train.mask_truncated
    # each optimizer step's global counts and this rank's micro-batches (None: nothing to learn)
    plan: list
    old_logprobs: list | None  # before the update (before_update_logprobs)
    metrics: dict  # the objective's before_update's
    seconds: dict  # {model name: seconds} of the objective's forwards before the gradient passes


def update_policy(cfg: Config, objective: Objective, trainer: Trainer, rollouts: list, step: int, pad_id: int,
                  d: Dist):
    """Returns (metrics, whether any optimizer step was taken): prepare_update, then take_steps
    (run.learn starts the next generation between the two)."""
    prepared = prepare_update(cfg, objective, trainer, rollouts, step, pad_id, d)
    return take_steps(cfg, prepared, trainer, rollouts, step, pad_id, d)


def prepare_update(cfg: Config, objective: Objective, trainer: Trainer, rollouts: list, step: int, pad_id: int,
                   d: Dist) -> Prepared:
    """Everything before the first gradient pass: the objective's before_update, the plan of
    optimizer steps, the old log-probs, and the objective's forwards kept for this rank's
    micro-batches (its before_gradients: an EMA teacher's hidden states).

    An optimizer step with nothing to learn from is planned as None (docs/loop.md, One step): no
    counted token, or no rollout whose loss can have a gradient (objective.moves)."""
    models = trainer.models
    models.policy.train()
    if cfg.train.mask_truncated:
        objective = without_truncated(objective)
    before = objective.before_update(rollouts, models, cfg, pad_id, d)
    units = mini_batch_units(rollouts, objective, cfg.train.shuffle_samples)
    random.Random(stream_seed("shuffle", cfg.train.seed, step)).shuffle(units)
    # Each optimizer step: its global counts and this rank's micro-batches (None: nothing to learn)
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rollouts]
    plan = [(counts, rank_micro_batches(micro_batch_units(mini_batch, objective), cfg.train.micro_batch, d, lengths,
                                        cfg.train.micro_batch_tokens)
             if counts["tokens"] and any(objective.moves(rollouts[i]) for unit in mini_batch for i in unit) else None)
            for mini_batch in split_evenly(units, cfg.train.mini_batches)
            for counts in [step_counts([rollouts[i] for unit in mini_batch for i in unit], objective)]]
    learning = any(micro for _, micro in plan)  # the same on every rank: all skip the old log-probs' forwards
    old_logprobs = before_update_logprobs(cfg, models.policy, rollouts, units, pad_id, d) if learning else None
    mine = sorted(i for _, micro in plan if micro for part in micro for i in part)
    seconds = objective.before_gradients([rollouts[i] for i in mine], models, cfg, pad_id, d)
    return Prepared(objective, plan, old_logprobs, before, seconds)


def take_steps(cfg: Config, prepared: Prepared, trainer: Trainer, rollouts: list, step: int, pad_id: int, d: Dist):
    """The update's optimizer steps. Returns (metrics, whether any optimizer step was taken).
    A planned step with nothing to learn from, or an exactly zero gradient, is skipped."""
    models, objective = trainer.models, prepared.objective
    stats, seconds, step_losses, grad_norms, skipped, stepped = {}, {}, [], [], 0, False
    for counts, micro in prepared.plan:
        if micro is None:  # every rank sees the same rollouts, so all skip together
            skipped += 1
            continue
        loss, finite = accumulate_gradients(cfg, objective, models, rollouts, micro, prepared.old_logprobs, counts,
                                            pad_id, d, stats, seconds)
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
    metrics = {**prepared.metrics, **reduce_stats(stats, step_losses, d.world)}
    metrics.update({"actor/grad_norm": sum(grad_norms) / max(len(grad_norms), 1), "actor/skipped_steps": skipped,
                    "actor/lr": trainer.scheduler.get_last_lr()[0]})
    for name, (total, _) in seconds.items():  # an objective's models' forwards within the micro-batches
        prepared.seconds[name] = prepared.seconds.get(name, 0.0) + total
    metrics.update({f"time/{name}_s": total for name, total in prepared.seconds.items()})
    return metrics, stepped


def before_update_logprobs(cfg: Config, policy, rollouts: list, units: list, pad_id: int, d: Dist) -> list | None:
    """Log-probs of the rollouts that train (those in units), before the first optimizer step
    of the batch (None elsewhere); None when there is a single optimizer step."""
    if cfg.train.mini_batches == 1:
        return None
    trained = sorted(i for unit in units for i in unit)
    logprobs = microbatch.response_logprobs(policy, [rollouts[i] for i in trained], pad_id, d, cfg.train.micro_batch,
                                            cfg.rollout.temperature, microbatch.share_prompts(cfg))
    by_index = dict(zip(trained, logprobs))
    return [by_index.get(i) for i in range(len(rollouts))]


def accumulate_gradients(cfg: Config, objective, models: Models, rollouts: list, micro: list, old_logprobs,
                         counts: dict, pad_id: int, d: Dist, stats: dict, seconds: dict):
    """Forward and backward over this rank's micro-batches of one optimizer step (micro: lists
    of rollout indices, [] where this rank idles); adds their statistics into stats. Returns
    (the summed loss, whether every loss was finite)."""
    total, finite = 0.0, True
    # FSDP2 gathers a layer's weights again for the backward of that layer's outputs; a shared
    # prompt's KV cache reaches the loss around them, so a sharded policy runs each sequence whole.
    shared_prefix = microbatch.share_prompts(cfg) and isinstance(models.policy, CausalLM) and not models.policy.sharded
    for j, part in enumerate(micro):
        if d.world > 1:  # FSDP2's gradient reduce-scatter after the last micro-batch only
            models.policy.set_requires_gradient_sync(j == len(micro) - 1)
        if part:
            mb = microbatch.micro_batch(models.policy, [rollouts[i] for i in part], counts, pad_id, d.device,
                                        None if old_logprobs is None else [old_logprobs[i] for i in part], d.world,
                                        shared_prefix)
            loss, mb_stats = objective.loss(mb, models, cfg)
            add_stats(stats, mb_stats)
            add_stats(seconds, mb.seconds)
        else:  # this rank has fewer rollouts: take part in the collectives with a zero loss
            loss = idle_loss(cfg, objective, models, pad_id, d)
        finite &= bool(torch.isfinite(loss).item())
        (loss * d.world).backward()  # FSDP2 averages gradients over ranks; the counts are global
        total += loss.item()
    return total, finite


def rank_micro_batches(units: list, micro_batch: int, d: Dist, lengths: list,
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
        share = rank_share(units, r, d.world)  # by index, so that ranks get alike lengths
        if token_budget:
            share = sorted(share, key=longest)
        per_rank.append(pack_units(share, micro_batch, [longest(u) for u in share], token_budget))
    return per_rank[d.rank] + [[]] * (max(max(len(m) for m in per_rank), 1) - len(per_rank[d.rank]))


def idle_loss(cfg: Config, objective: Objective, models: Models, pad_id: int, d: Dist):
    """A zero loss with a forward through the policy (FSDP2's collectives) and through the
    forwards the objective's models run in a micro-batch (collectives too: idle_forwards)."""
    objective.idle_forwards(models, cfg, pad_id, d)
    return microbatch.idle_forward(models.policy, pad_id, d.device, lambda h, w: (h @ w.T).sum() * 0.0)


def mini_batch_units(rollouts: list, objective, shuffle_samples: bool = False) -> list[list[int]]:
    """Lists of rollout indices that go to one mini-batch (optimizer step) together: a prompt's
    samples (verl's mini-batches, and the paper's, count prompts), or with shuffle_samples each
    sample alone unless the objective compares siblings (keep_prompts_together, e.g. preference
    pairs). With counted_only, uncounted rollouts are left out; a unit may then be empty, so
    that the mini-batches still split the step's prompts the same way whatever their counts."""
    keep = lambda i: not objective.counted_only or objective.counted(rollouts[i])
    if shuffle_samples and not objective.keep_prompts_together:
        return [[i] if keep(i) else [] for i in range(len(rollouts))]
    groups = {}
    for i, r in enumerate(rollouts):
        groups.setdefault(r.row["uid"], [])
        if keep(i):
            groups[r.row["uid"]].append(i)
    return list(groups.values())


def micro_batch_units(mini_batch: list[list[int]], objective) -> list[list[int]]:
    """A mini-batch's units for its micro-batches: a prompt's samples stay together where the
    objective compares them (keep_prompts_together), else each sample is a unit of its own, so
    that --train.micro_batch bounds a forward whatever --rollout.n is."""
    return mini_batch if objective.keep_prompts_together else [[i] for unit in mini_batch for i in unit]


def pack_units(units: list[list[int]], size: int, lengths: list | None = None, token_budget: int = 0) -> list[list[int]]:
    """Consecutive units in micro-batches of at most `size` sequences and, with lengths (each
    unit's longest sequence), at most token_budget padded tokens (a larger unit alone)."""
    out, current, width = [], [], 0
    for unit, length in zip(units, lengths or [0] * len(units)):
        grown = max(width, length)
        rows = len(current) + len(unit)
        if current and (rows > size or (token_budget and rows * grown > token_budget)):
            out.append(current)
            current, grown = [], length
        current, width = current + unit, grown
    return out + ([current] if current else [])


def step_counts(rollouts: list, objective) -> dict:
    """Global token / sequence counts of one optimizer step (all micro-batches, all ranks); samples:
    all its rollouts, counted or not."""
    counted = [r for r in rollouts if r.response_ids and objective.counted(r)]
    return {"tokens": sum(len(r.response_ids) for r in counted), "sequences": len(counted), "samples": len(rollouts),
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
    for *_max), and the loss averaged over the optimizer steps taken. A statistic no token
    or sample counted towards (e.g. the teacher gap of right answers in a step without one)
    is left out, not logged as 0."""
    # a rank without micro-batches has no statistics: agree on the names first
    names = sorted(set().union(*from_every_rank(sorted(stats), world)))
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
        if name.endswith("_max"):
            out[name] = maxima[i].item()
        elif counts[i] > 0:
            out[name] = sums[i].item() / counts[i].item()
    return out


def rank_share(items: list, rank: int, world: int) -> list:
    """This rank's contiguous part of items (sizes differ by at most one; may be empty)."""
    size, extra = divmod(len(items), world)
    start = rank * size + min(rank, extra)
    return items[start:start + size + (rank < extra)]


def split_evenly(items: list, parts: int) -> list[list]:
    """items in `parts` contiguous mini-batches (sizes differ by at most one)."""
    if parts < 1 or parts > len(items):
        raise ValueError(f"--train.mini_batches={parts} must be between 1 and the {len(items)} prompts of a step "
                         "(samples with --train.shuffle_samples)")
    return [rank_share(items, p, parts) for p in range(parts)]

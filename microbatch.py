"""Rollouts and micro-batches: the types every objective reads, the row each objective is in
objectives.OBJECTIVES (Objective: its loss and its hooks), and the forward mechanics they share.

Statistics are (sum, count) pairs that update.reduce_stats averages over micro-batches and ranks;
a name ending in "_max" is a maximum instead (its count is ignored).
"""
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

import chunked_head
import losses
import packing
from distributed import Dist, from_every_rank
# ----------------------------------------------------------------------------------------
# What the loss functions get


@dataclass
class Rollout:
    """One response to one prompt: what every objective reads, and a slot for what one writes."""
    row: dict
    prompt_ids: list
    response_ids: list
    rollout_logprobs: list  # from the engine, at the sampling temperature
    text: str
    truncated: bool
    reward: float = 0.0
    feedback: str = ""
    reward_error: str = ""
    policy_version: int = 0  # the weights that generated it: their number of loop steps (updates)
    generated: bool = True  # False: the row's reference response (SFT, SPIN, GAD's teacher), with no engine log-probs
    # The objective's own fields (its file's `Fields`: GRPO's advantage, SDPO's teacher context,
    # DPO's pairs, GAD's scores), written by its prepare (give_fields); None: it writes none (SFT)
    fields: object = None


def give_fields(rollouts: list, kind: type):
    """Each rollout's slot (Rollout.fields) made a fresh `kind` unless it is one already (the
    hybrid's Fields are SDPO's and GRPO's both, so each of their prepares writes into them)."""
    for r in rollouts:
        if not isinstance(r.fields, kind):
            r.fields = kind()


class Models:
    """The policy and the objective's extra models (its row's build_models: SDPO's teacher, the
    DPO reference, GAD's discriminator), each an attribute under its name (models.teacher).

    An extra model has state_dict() and load_state_dict() (a checkpoint keeps it under its name;
    a state_dict() of None: nothing to keep) and networks() (its torch modules)."""

    def __init__(self, policy: torch.nn.Module, **extra):
        self.policy = policy
        vars(self).update({name: model for name, model in extra.items() if model is not None})

    @property
    def extra(self) -> dict:
        """The extra models by name."""
        return {name: model for name, model in vars(self).items() if name != "policy"}

    def networks(self) -> list:
        """Every torch module the models hold: the policy's and the extra models'."""
        return [self.policy, *(network for model in self.extra.values() for network in model.networks())]


@dataclass
class MicroBatch:
    """Rollouts laid out for one forward/backward, with the step's global counts."""
    rollouts: list
    packed: packing.Packed
    rollout_logprobs: torch.Tensor  # [N] engine log-probs of the response tokens
    old_logprobs: torch.Tensor | None  # [N] trainer log-probs before the update; None: the only optimizer step
    counts: dict  # global counts of the optimizer step (run.step_counts)
    pad_id: int
    world: int = 1
    seconds: dict = field(default_factory=dict)  # time spent in parts worth logging ("teacher")

    @property
    def device(self):
        return self.packed.input_ids.device

    def matrix(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token values [N] -> [B, R] response matrix."""
        return packing.to_matrix(values, self.packed)

    def per_sequence(self, value: Callable) -> torch.Tensor:
        """[B] float tensor of value(rollout)."""
        return torch.tensor([float(value(r)) for r in self.rollouts], dtype=torch.float32, device=self.device)

    @property
    def response_mask(self) -> torch.Tensor:
        return self.matrix(torch.ones_like(self.rollout_logprobs))


def micro_batch(policy, rollouts: list, counts: dict, pad_id: int, device, old_logprobs: list | None,
                world: int, shared_prefix: bool = False) -> MicroBatch:
    """The rollouts laid out for the policy's gradient forward (pack; shared_prefix: see
    share_prompts), with their engine and old log-probs [N]."""
    per_token = lambda lists: torch.tensor([v for vs in lists for v in vs], dtype=torch.float32, device=device)
    return MicroBatch(
        rollouts=rollouts,
        packed=pack(policy, [r.prompt_ids + r.response_ids for r in rollouts], [len(r.response_ids) for r in rollouts],
                    pad_id, device, images=[r.row.get("images") for r in rollouts], shared_prefix=shared_prefix),
        rollout_logprobs=per_token([r.rollout_logprobs for r in rollouts]),
        old_logprobs=None if old_logprobs is None else per_token(old_logprobs),
        counts=counts, pad_id=pad_id, world=world)


# ----------------------------------------------------------------------------------------
# Shared mechanics


def pack(model, seqs: list, response_lens: list, pad_id: int, device, images: list | None = None,
         shared_prefix: bool = False, groups: list | None = None) -> packing.Packed:
    """Sequences laid out for model (policy.CausalLM): packing.pack, or packing.pack_shared_prefix
    (groups: each sequence's group key, whose members' common prompt runs once more).

    For a vision-language model, images[i] are sequence i's pictures, their placeholders in
    seqs[i] expanded unless they already are; such sequences never share a prefix, each runs as
    an ordinary right-padded row (docs/data.md, In the trainer).
    """
    vision = getattr(model, "vision", None)
    if vision is None:
        if shared_prefix:
            return packing.pack_shared_prefix(seqs, response_lens, pad_id, device, groups)
        return packing.pack(seqs, response_lens, pad_id, device)
    images = [list(im or []) for im in (images or [None] * len(seqs))]
    seqs, masks = zip(*[vision.expand(s, im) for s, im in zip(seqs, images)]) if seqs else ((), ())
    return packing.pack(list(seqs), response_lens, pad_id, device, images=images, image_masks=list(masks))


def response_logprobs(model, rollouts: list, pad_id: int, d: Dist, micro_batch: int, temperature: float,
                      shared_prefix: bool = False) -> list:
    """Log-probs of every rollout's response tokens under model, without gradient (old
    log-probs, reference log-probs): each rank scores a share, then all ranks exchange them.
    shared_prefix: a prompt that several of a micro-batch's rollouts share runs once
    (packing.pack_shared_prefix; a group's samples are neighbours). Returns one list of
    per-token floats per rollout, on every rank."""
    mine = list(range(len(rollouts)))[d.rank::d.world]
    # Under FSDP2 every forward is a collective: a rank with a smaller share runs idle ones.
    calls = math.ceil(math.ceil(len(rollouts) / d.world) / micro_batch)
    local = {}
    with torch.no_grad():
        for i in range(0, calls * micro_batch, micro_batch):
            part = mine[i:i + micro_batch]
            if not part:
                idle_forward(model, pad_id, d.device, lambda h, w: h.sum(), shared_prefix)
                continue
            packed = pack(model, [rollouts[j].prompt_ids + rollouts[j].response_ids for j in part],
                          [len(rollouts[j].response_ids) for j in part], pad_id, d.device,
                          images=[rollouts[j].row.get("images") for j in part], shared_prefix=shared_prefix)
            logprobs = forward(model, packed, lambda h, w: chunked_head.logprobs_and_entropy_from_hidden(
                h, w, packed.targets, temperature)[0])
            for j, values in zip(part, logprobs.split([len(rollouts[j].response_ids) for j in part])):
                local[j] = values.tolist()
    every = {i: values for part in from_every_rank(local, d.world) for i, values in part.items()}
    return [every[i] for i in range(len(rollouts))]


def idle_forward(model, pad_id: int, device, head, shared_prefix: bool = False, grouped: bool = False):
    """A forward of a rank with nothing to run, on a two-token dummy: under FSDP2 every model
    call is a collective, so it makes the calls a real micro-batch of the same layout makes
    (each shared-prefix level is a call of its own)."""
    return forward(model, pack(model, [[pad_id, pad_id]], [1], pad_id, device, shared_prefix=shared_prefix,
                               groups=[None] if grouped else None), head)


def share_prompts(cfg) -> bool:
    """Whether a forward of the policy or reference runs a prompt that several of its rollouts
    share once (--train.share_prompt_prefix; which forwards, and why not under FSDP2:
    docs/loop.md, One step). HF drops the KV cache under gradient checkpointing."""
    return cfg.train.share_prompt_prefix and not cfg.model.gradient_checkpointing


def forward(model, packed: packing.Packed, head):
    """Run model (policy.CausalLM) on packed sequences; head(hidden [N, H], lm_head weight) is
    applied to the hidden states at the response positions inside the model's forward."""
    return model(packed, head)


def logprob_head(targets: torch.Tensor, temperature: float, chunk_size: int):
    """Head for the policy-gradient, DPO and SFT losses: the log-probs of targets [N] (with
    gradient) and the entropy [N] (without). chunk_size > 0: chunked_head.token_logprobs_from_hidden;
    0: plain autograd over the float32 [N, V] logits (docs/loop.md, Memory)."""
    def head(hidden, weight):
        if chunk_size:
            return chunked_head.token_logprobs_from_hidden(hidden, weight, targets, temperature, chunk_size)
        logits = (hidden @ weight.T).float()
        return losses.token_logprobs(logits, targets, temperature), losses.entropy_from_logits(logits.detach(), temperature)
    return head


def policy_logprobs(mb: MicroBatch, models: Models, cfg, temperature: float | None = None):
    """The policy's log-probs [N] (with gradient) and entropies [N] of mb's response tokens,
    at the sampling temperature unless given."""
    temperature = cfg.rollout.temperature if temperature is None else temperature
    return forward(models.policy, mb.packed, logprob_head(mb.packed.targets, temperature, cfg.train.head_chunk_size))


def old_or_current(mb: MicroBatch, current_logprobs: torch.Tensor) -> torch.Tensor:
    """The log-probs the update is relative to [N]: before the update, or (with a single
    optimizer step per batch, where they are equal) the current ones, detached."""
    return current_logprobs.detach() if mb.old_logprobs is None else mb.old_logprobs


def engine_correction(mb: MicroBatch, old_logprobs: torch.Tensor, cfg) -> torch.Tensor:
    """Truncated IS weights [B, R] for the engine-vs-trainer mismatch:
    min(exp(old - rollout), --rollout.is_cap), token or sequence level; 1 when off."""
    if not cfg.rollout.is_correction:
        return torch.ones(mb.packed.shape, device=mb.device)
    return losses.importance_weights(mb.matrix(old_logprobs), mb.matrix(mb.rollout_logprobs), cfg.rollout.is_cap,
                                     level=cfg.rollout.is_level, mask=mb.response_mask)


def rollout_stats(mb: MicroBatch, old_logprobs: torch.Tensor, entropy: torch.Tensor,
                  sampled: torch.Tensor | None = None) -> dict:
    """Entropy, engine-vs-trainer mismatch KL and IS ratios, as (sum, count) over the tokens
    the engine sampled (sampled [N]: 1 for those, 0 for a reference response's; None: all)."""
    sampled = torch.ones_like(entropy) if sampled is None else sampled
    ratio = (old_logprobs - mb.rollout_logprobs).clamp(-20, 20).exp()
    mismatch_kl = losses.kl_estimate(mb.rollout_logprobs, old_logprobs, "k3")
    return {
        "actor/entropy": masked_stat(entropy, sampled),
        "rollout/mismatch_kl": masked_stat(mismatch_kl, sampled),
        "is/ratio_mean": masked_stat(ratio, sampled),
        "is/ratio_max": (ratio[sampled > 0].max().item() if sampled.any() else 0.0, 1.0),
    }


def clip_fraction(weights: torch.Tensor, cap: float, mask: torch.Tensor) -> tuple[float, float]:
    """The (sum, count) share of mask's tokens whose truncated IS weight [B, R] is at its cap."""
    return masked_stat((weights >= cap).float(), mask)


def correction_stats(correction: torch.Tensor, mask: torch.Tensor, cfg) -> dict:
    """is/clipfrac: the share of the loss's tokens whose engine correction [B, R] is at
    --rollout.is_cap (none when the correction is off)."""
    return {"is/clipfrac": clip_fraction(correction, cfg.rollout.is_cap, mask)} if cfg.rollout.is_correction else {}


def masked_stat(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """The (sum, count) statistic of values over a mask of the same shape (a weighted mean once reduced)."""
    return (values.detach() * mask).sum().item(), mask.sum().item()


def stats_by_kind(mb: MicroBatch, values: torch.Tensor, mask: torch.Tensor, kinds: dict) -> dict:
    """masked_stat of values [B, R] over mask, for the samples of each kind alone: {key: (sum, count)}
    (kinds: {metric key: predicate on a rollout}; whole keys, which docs/metrics.md's test finds)."""
    return {key: masked_stat(values, mb.per_sequence(of_kind)[:, None] * mask) for key, of_kind in kinds.items()}


def aggregate(mb: MicroBatch, per_token_loss: torch.Tensor, mask: torch.Tensor, cfg, default_mode: str) -> torch.Tensor:
    """losses.aggregate with the optimizer step's global counts (--algo.loss_agg_mode, or the
    objective's default under "auto")."""
    mode = default_mode if cfg.algo.loss_agg_mode == "auto" else cfg.algo.loss_agg_mode
    return losses.aggregate(per_token_loss, mask, mode, global_tokens=mb.counts["tokens"],
                            global_sequences=mb.counts["sequences"], max_len=mb.counts["max_len"])


# ----------------------------------------------------------------------------------------
# An objective: a row of objectives.OBJECTIVES, the functions the loop calls at fixed points


@dataclass(frozen=True)
class Objective:
    """What the loop (run.py, update.py) calls, never naming an algorithm or its models
    (docs/changing.md). Hooks take the rollouts, the Models, the Config, the pad id and the Dist."""
    loss: Callable  # (micro-batch, models, cfg) -> (loss, {metric: (sum, count)})
    # rank 0, after scoring: writes each rollout's fields (give_fields) -> metrics
    prepare: Callable = lambda rollouts, tokenizer, cfg: {}
    # every rank, on the shared rollouts, before the update (old log-probs are the loop's): DPO's
    # reference log-probs, GAD's discriminator step -> metrics
    before_update: Callable = lambda rollouts, models, cfg, pad_id, d: {}
    counted: Callable = lambda rollout: True  # counts in the loss's normalisation
    # whether its loss can have a gradient: an optimizer step with none is skipped before any forward
    moves: Callable = lambda rollout: True
    counts: Callable = lambda rollouts: {}  # more global counts of an optimizer step
    counted_only: bool = False  # True: uncounted rollouts are left out of the micro-batches
    keep_prompts_together: bool = False  # True: a prompt's samples always share a micro-batch
    row_fields: tuple = ()  # fields every training row must have
    references: bool = False  # train on the rows' references instead of generating
    # Its extra models, by the name a checkpoint keeps each under (Models):
    # (cfg, initial: () -> a copy of the initial policy, model_dir, d) -> {name: model}
    build_models: Callable = lambda cfg, initial, model_dir, d: {}
    # every rank, after the old log-probs, before the first gradient pass, on the rollouts this
    # rank trains: its models' forwards kept for the micro-batches (SDPO's EMA teacher) ->
    # {model name: seconds}, logged as time/<name>_s
    before_gradients: Callable = lambda rollouts, models, cfg, pad_id, d: {}
    # whether before_gradients runs forwards: on a CPU, generating ahead, the engine starts the
    # next batch after them (docs/async.md)
    forwards_first: Callable = lambda models: False
    idle_forwards: Callable = lambda models, cfg, pad_id, d: None  # a rank's empty micro-batch: its models' collectives
    # after the update's optimizer steps (stepped: whether any was taken): the EMA teacher's move,
    # the reference's refresh -> metrics
    after_update: Callable = lambda models, stepped, steps_done: {}
    # the extra models build_models makes for cfg, known before any loads: {name: "copy" (the
    # policy's weights again) or "discriminator" (a network of its own, with AdamW)}: what
    # plan.py counts in memory and check_out_dir on disk
    held: Callable = lambda cfg: {}


def without_truncated(objective: Objective) -> Objective:
    """The objective with its truncated samples left out of every loss and of the optimizer
    steps' counts (--train.mask_truncated): they are not counted, so not in any micro-batch.
    What prepare wrote from the whole batch (GRPO's advantages, SDPO's demonstrations) stays."""
    return dataclasses.replace(objective, counted=lambda r: objective.counted(r) and not r.truncated,
                               counted_only=True)

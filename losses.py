"""The formulas: the losses of SDPO, GRPO, GSPO, DPO and GAD as pure functions of tensors.

Each docstring states its formula; docs/loop.md gathers them with the papers they come from
(SDPO: arXiv 2601.20802, its section 4.5 for the lambda-hybrid; GSPO: arXiv 2507.18071; GAD:
arXiv 2511.10643).
Shape letters: B sequences, L response positions, V vocabulary, K top-K size,
S a support size (V, K or K+1), H hidden size, N flattened tokens, P pairs/prompts.

Nothing here reads configs, logs, or touches devices; callers pass tensors and
plain numbers and get tensors back. The same values computed chunk by chunk from hidden
states, without [N, V] logits (custom autograd), are in chunked_head.py.
"""

import math

import torch
import torch.nn.functional as F

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: bounds ratios without touching normal values
TAIL_LOGSUMEXP_MAX = -1e-7  # keeps log(1 - sum p) finite when the top-K holds ~all mass
K3_VALUE_CLAMP = 10.0
AGGREGATION_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "abs", "k2", "k3")
DPO_KINDS = ("sigmoid", "ipo", "hinge", "robust")

# -----------------------------------------------------------------------------
# log-probs and entropy


def token_logprobs(logits, token_ids, temperature=1.0):
    """Log-probability of the given tokens: log_softmax(logits / temperature)[token_ids].

    logits [..., V], token_ids [...] (int64) -> [...] in the logits' dtype.
    Written as gather minus logsumexp so that no second [..., V] log-softmax tensor is
    kept for backward. Use the same temperature as the sampler.
    """
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits, temperature=1.0):
    """Entropy of softmax(logits / temperature) per position: H = -sum_v p_v log p_v.

    logits [..., V] -> [...]. Entries with logit -inf (p = 0) contribute exactly 0.
    """
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    # 0 * -inf would be NaN (and so would its gradient), so zero the log first
    logp = logp.masked_fill(p == 0, 0.0)
    return -(p * logp).sum(-1)


# -----------------------------------------------------------------------------
# SDPO distillation


def _kl_from_logprobs(logp, logq):
    """KL(P||Q) = sum_s p_s (log p_s - log q_s) over the last dim; p_s = 0 terms are 0."""
    p = logp.exp()
    # where p == 0 the difference may be -inf - x; masking it keeps value and grad finite
    diff = (logp - logq).masked_fill(p == 0, 0.0)
    return (p * diff).sum(-1)


def sdpo_divergence(student_logprobs, teacher_logprobs, alpha):
    """Per-position divergence between student S and teacher T over a support (last dim).

        alpha = 0      forward KL   KL(T||S) = sum_s e^T (T - S)
        alpha = 1      reverse KL   KL(S||T) = sum_s e^S (S - T)
        0 < alpha < 1  generalized JSD:
                       M = logsumexp(log(1-alpha) + S, log(alpha) + T)
                       loss = (1-alpha) KL(S||M) + alpha KL(T||M)

    student_logprobs, teacher_logprobs [..., S] log-probs over the same support (full
    vocab, or top-K plus tail) -> [...] (e.g. [B, L]). alpha=0.5 is the textbook
    Jensen-Shannon divergence. The teacher carries no gradient (detached here).
    """
    teacher_logprobs = teacher_logprobs.detach()
    if alpha == 0.0:
        return _kl_from_logprobs(teacher_logprobs, student_logprobs)
    if alpha == 1.0:
        return _kl_from_logprobs(student_logprobs, teacher_logprobs)
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    # an id with zero mass on both sides would make the mixture -inf and its logsumexp
    # gradient NaN; a finite floor (gradient-free) keeps it at exactly zero weight
    floor = torch.finfo(student_logprobs.dtype).min
    weighted_student = student_logprobs.clamp(min=floor) + math.log(1.0 - alpha)
    weighted_teacher = teacher_logprobs.clamp(min=floor) + math.log(alpha)
    mixture_logprobs = torch.logsumexp(torch.stack([weighted_student, weighted_teacher]), dim=0)
    student_to_mixture = _kl_from_logprobs(student_logprobs, mixture_logprobs)
    teacher_to_mixture = _kl_from_logprobs(teacher_logprobs, mixture_logprobs)
    return (1.0 - alpha) * student_to_mixture + alpha * teacher_to_mixture


def support_logprobs(top_logits, full_logsumexp, add_tail):
    """Top-K logits [..., K] and the full-vocab logsumexp [..., 1] -> support log-probs.

    With add_tail: [..., K+1], the last entry is log(1 - sum_k p_k) = log(-expm1(ls)),
    ls = logsumexp of the top-K log-probs clamped <= -1e-7 (so the tail stays finite
    when the top-K hold all the mass). Without: [..., K], renormalised over the K ids
    (the full logsumexp cancels then).
    """
    top_logprobs = top_logits - full_logsumexp
    if not add_tail:
        return top_logprobs - torch.logsumexp(top_logprobs, dim=-1, keepdim=True)
    top_mass_log = torch.logsumexp(top_logprobs, dim=-1, keepdim=True).clamp(max=TAIL_LOGSUMEXP_MAX)
    tail_logprob = torch.log(-torch.expm1(top_mass_log))
    return torch.cat([top_logprobs, tail_logprob], dim=-1)


def topk_with_tail(student_logits, teacher_logits, k, add_tail=True, temperature=1.0):
    """Restrict student and teacher to the student's top-K ids per position.

    student_logits, teacher_logits [..., V] (raw logits; divided by temperature here).
    Returns (student_support_logprobs, teacher_support_logprobs, topk_ids):
      support log-probs [..., K+1] with add_tail (top-K log-probs normalised over the
      full vocab, then the tail entry), [..., K] without (renormalised over the K ids);
      topk_ids [..., K] int64, chosen by the student only.
    The student's gradient flows through its top-K logits and its full logsumexp; the
    teacher is detached. Pass full-vocab log-probs straight to sdpo_divergence for the
    full-logit mode instead.
    """
    teacher_logits = teacher_logits.detach()
    if temperature != 1.0:
        student_logits = student_logits / temperature
        teacher_logits = teacher_logits / temperature
    topk_ids = student_logits.detach().topk(k, dim=-1).indices

    def support(logits):
        return support_logprobs(logits.gather(-1, topk_ids), torch.logsumexp(logits, dim=-1, keepdim=True), add_tail)
    return support(student_logits), support(teacher_logits), topk_ids


def sdpo_token_loss(student_token_logprobs, teacher_token_logprobs):
    """Token-level SDPO (sampled token only, reverse KL only), per token [B, L]:

        loss_t = (S_tok - T_tok).detach() * S_tok

    A REINFORCE surrogate with advantage T_tok - S_tok: its gradient is
    -(T_tok - S_tok) * grad S_tok, and its expectation under the student is the
    gradient of KL(S||T).
    """
    return (student_token_logprobs - teacher_token_logprobs).detach() * student_token_logprobs


# -----------------------------------------------------------------------------
# importance weights and advantages


def _masked_sequence_mean(values, mask):
    """values, mask [B, L] -> [B] mean over masked positions (0 for empty masks)."""
    mask = mask.to(values.dtype)
    total = (values.masked_fill(mask == 0, 0.0) * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1.0)


def _broadcast_advantages(advantages, like):
    return advantages.unsqueeze(-1) if advantages.dim() == like.dim() - 1 else advantages


def importance_weights(logprobs, old_logprobs, cap, level="token", mask=None):
    """Truncated importance weights, always detached.

        token:    w_t = min(exp(clamp(logp_t - old_t, -20, 20)), cap)          [B, L]
        sequence: w_i = min(exp(clamp(mean_t (logp_t - old_t), -20, 20)), cap)
                  over the masked tokens of sequence i, broadcast to [B, L]

    logprobs, old_logprobs [B, L]; mask [B, L] is required for level="sequence".
    For the SDPO IS clip pass (S_tok, old_tok); for rollout correction pass
    (old_tok, rollout_tok). The mean, not the sum: a sum grows with length (docs/loop.md).
    A sequence with an empty mask gets weight 1. Masked positions are not zeroed here:
    multiply by the mask (or let aggregate do it).
    """
    log_ratio = (logprobs - old_logprobs).detach()
    if level == "sequence":
        if mask is None:
            raise ValueError("level='sequence' needs mask")
        log_ratio = _masked_sequence_mean(log_ratio, mask).unsqueeze(-1).expand_as(logprobs)
    elif level != "token":
        raise ValueError(f"unknown level {level!r}")
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=cap)


def grpo_advantages(rewards, group_ids, norm_by_std=True, eps=1e-6):
    """GRPO advantage per sample:

        A_i = (r_i - mean_g) / (std_g + eps)   (unbiased std over the group g of i)
        A_i =  r_i - mean_g                    (norm_by_std=False, Dr. GRPO)

    rewards [N] float; group_ids [N] int tensor, or any sequence of hashables (e.g.
    prompt uids) -> [N], detached. A group of one has no std and no baseline: its
    advantage is 0 (never NaN). Broadcast to tokens with A[:, None].
    """
    rewards = rewards.detach()
    if not torch.is_tensor(group_ids):
        index_of = {}
        group_ids = torch.tensor([index_of.setdefault(g, len(index_of)) for g in group_ids], dtype=torch.long)
    _, group_index = torch.unique(group_ids.to(rewards.device), return_inverse=True)
    counts = torch.bincount(group_index).to(rewards.dtype)
    sums = torch.zeros_like(counts).index_add_(0, group_index, rewards)
    centred = rewards - (sums / counts)[group_index]
    if not norm_by_std:
        return centred
    squares = torch.zeros_like(counts).index_add_(0, group_index, centred**2)
    # singletons: centred is exactly 0, and a 0 std makes the advantage 0 / eps = 0
    std = torch.where(counts > 1, squares / (counts - 1).clamp(min=1), torch.zeros_like(counts)).sqrt()
    return centred / (std[group_index] + eps)


def hybrid_advantages(grpo_adv, teacher_token_logprobs, student_token_logprobs, lam):
    """lambda-hybrid per-token advantage (paper section 4.5):

        A_t = lam * A_GRPO + (1 - lam) * (T_tok - S_tok)

    grpo_adv [B] (or [B, L]), token log-probs [B, L] -> [B, L], detached.
    """
    sdpo_adv = teacher_token_logprobs - student_token_logprobs
    return (lam * _broadcast_advantages(grpo_adv, sdpo_adv) + (1.0 - lam) * sdpo_adv).detach()


# -----------------------------------------------------------------------------
# policy-gradient surrogates


def _clipped_surrogate(ratio, advantages, eps_low, eps_high):
    """max(-A r, -A clip(r, 1-eps_low, 1+eps_high)) and where the clip stops the gradient."""
    advantages = _broadcast_advantages(advantages.detach(), ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    ratio = ratio.detach()
    is_clipped = ((advantages > 0) & (ratio > 1.0 + eps_high)) | ((advantages < 0) & (ratio < 1.0 - eps_low))
    return loss, is_clipped


def ppo_clip_loss(logprobs, old_logprobs, advantages, eps_low=0.2, eps_high=0.2):
    """PPO clipped surrogate per token (GRPO/DAPO):

        ratio_t = exp(logp_t - old_t)             (log ratio clamped to +-20)
        loss_t  = max(-A_t ratio_t, -A_t clip(ratio_t, 1-eps_low, 1+eps_high))

    logprobs, old_logprobs [B, L]; advantages [B] or [B, L] (detached here).
    Returns (loss [B, L], is_clipped [B, L] bool): is_clipped marks tokens where the
    clipped branch is active, i.e. whose gradient is 0 (A>0 and ratio>1+eps_high, or
    A<0 and ratio<1-eps_low). clip fraction = aggregate(is_clipped.float(), mask, ...).
    """
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _clipped_surrogate(torch.exp(log_ratio), advantages, eps_low, eps_high)


def gspo_loss(logprobs, old_logprobs, advantages, mask, eps_low=3e-4, eps_high=4e-4):
    """GSPO sequence-level clipped surrogate in token form:

        s_i     = exp(mean_t (logp_t - old_t))       masked mean over sequence i
        ratio_t = exp(logp_t - sg(logp_t) + sg(log s_i))   (value s_i, grad s_i * grad logp_t)
        loss_t  = max(-A_i ratio_t, -A_i clip(ratio_t, 1-eps_low, 1+eps_high))

    logprobs, old_logprobs, mask [B, L]; advantages [B] or [B, L] -> (loss [B, L],
    is_clipped [B, L] bool) as in ppo_clip_loss. Aggregate with seq-mean-token-mean,
    which makes the gradient that of s_i times the sequence advantage.
    """
    seq_log_ratio = _masked_sequence_mean(logprobs.detach() - old_logprobs.detach(), mask)
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).unsqueeze(-1)
    ratio = torch.exp(logprobs - logprobs.detach() + seq_log_ratio)
    return _clipped_surrogate(ratio, advantages, eps_low, eps_high)


# -----------------------------------------------------------------------------
# KL estimators


def kl_estimate(logprobs, ref_logprobs, kind="k3"):
    """Per-token KL(pi || ref) estimate from sampled tokens, d = logp - ref:

        k1   d
        abs  |d|
        k2   d^2 / 2                     (verl's "mse")
        k3   exp(-d) + d - 1             (verl's "low_var_kl"; -d clamped to +-20, value to [0, 10])
        "<kind>+"  value of <kind>, gradient of k2: k2 + sg(value - k2)

    logprobs, ref_logprobs [...] -> [...]. The reference side is detached. k3 is >= 0.
    The "+" forms' gradient d * grad logp is, on tokens sampled from pi, in expectation the
    gradient of KL(pi || ref); their value is the named estimator's, for logging.
    """
    base = kind.removesuffix("+")
    log_ratio = logprobs - ref_logprobs.detach()
    if base == "k1":
        value = log_ratio
    elif base == "abs":
        value = log_ratio.abs()
    elif base == "k2":
        value = 0.5 * log_ratio.square()
    elif base == "k3":
        neg_log_ratio = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        # expm1: exp(y) - 1 - y cancels to -1e-16 for |y| ~ 1e-12; the estimator is >= 0
        value = (torch.expm1(neg_log_ratio) - neg_log_ratio).clamp(0.0, K3_VALUE_CLAMP)
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}, optionally with '+'")
    if base == kind:
        return value
    k2 = 0.5 * log_ratio.square()
    return k2 + (value - k2).detach()


# -----------------------------------------------------------------------------
# DPO and GAD


def dpo_loss(policy_chosen, policy_rejected, ref_chosen=None, ref_rejected=None, beta=0.1, kind="sigmoid",
             label_smoothing=0.0, reference_free=False):
    """DPO family per pair. Inputs [P]: summed response log-probs of the
    chosen / rejected responses under the policy and the reference.

        logits = (pi_c - pi_r) - (ref_c - ref_r)        (ref = 0 if reference_free)
        sigmoid  -(1-eps) logsigmoid(beta logits) - eps logsigmoid(-beta logits)
        ipo      (logits - 1/(2 beta))^2
        hinge    relu(1 - beta logits)
        robust   (-(1-eps) logsigmoid(beta logits) + eps logsigmoid(-beta logits)) / (1 - 2 eps)

    eps = label_smoothing. For IPO, TRL passes length-normalised (mean) log-probs:
    that is the caller's choice of inputs. Returns (losses [P], chosen_rewards [P],
    rejected_rewards [P]) with rewards = beta * (pi - ref), detached, for logging.
    """
    if reference_free:
        ref_chosen, ref_rejected = torch.zeros_like(policy_chosen), torch.zeros_like(policy_rejected)
    elif ref_chosen is None or ref_rejected is None:
        raise ValueError("ref_chosen and ref_rejected are required unless reference_free")
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected).detach()
    eps = label_smoothing
    if kind == "sigmoid":
        losses = -(1.0 - eps) * F.logsigmoid(beta * logits) - eps * F.logsigmoid(-beta * logits)
    elif kind == "ipo":
        losses = (logits - 1.0 / (2.0 * beta)) ** 2
    elif kind == "hinge":
        losses = torch.relu(1.0 - beta * logits)
    elif kind == "robust":
        losses = (-(1.0 - eps) * F.logsigmoid(beta * logits) + eps * F.logsigmoid(-beta * logits)) / (1.0 - 2.0 * eps)
    else:
        raise ValueError(f"unknown DPO kind {kind!r}; expected one of {DPO_KINDS}")
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def discriminator_loss(teacher_scores, student_scores):
    """GAD discriminator Bradley-Terry loss, each teacher response paired
    with every student sample of its prompt:

        loss = mean_{p, j} -logsigmoid(D_teacher[p] - D_student[p, j])
        accuracy = mean_{p, j} [D_teacher[p] > D_student[p, j]]   (detached)

    teacher_scores [P]; student_scores [P, n] (n samples per prompt) or [P] (one each).
    Returns (loss scalar, accuracy scalar).
    """
    if student_scores.dim() == teacher_scores.dim() + 1:
        teacher_scores = teacher_scores.unsqueeze(-1)
    score_gap = teacher_scores - student_scores
    loss = -F.logsigmoid(score_gap).mean()
    accuracy = (score_gap.detach() > 0).to(score_gap.dtype).mean()
    return loss, accuracy


# -----------------------------------------------------------------------------
# aggregation


def global_counts(mask):
    """mask [B, L] -> (num_tokens, num_sequences) as 0-dim float tensors: the number of
    masked tokens and of sequences with at least one masked token. Sum (all-reduce)
    these over all micro-batches and ranks of an optimizer step and pass them to
    aggregate as global_tokens / global_sequences.
    """
    mask = mask.float()
    return mask.sum(), (mask.sum(-1) > 0).float().sum()


def aggregate(per_token_loss, mask, mode, global_tokens=None, global_sequences=None, max_len=None):
    """Reduce a per-token loss [B, L] under a 0/1 mask [B, L] to a scalar:

        token-mean               sum(loss * mask) / num_tokens
        seq-mean-token-sum       sum_i (sum_t loss_it mask_it) / num_sequences
        seq-mean-token-mean      sum_i (sum_t loss_it mask_it / n_i) / num_sequences
        seq-mean-token-sum-norm  sum(loss * mask) / (num_sequences * max_len)   (Dr. GRPO)

    num_tokens / num_sequences default to this batch's counts (global_counts(mask)); pass
    the optimizer step's global counts instead and the micro-batches' (and ranks') results
    sum to the full batch's (docs/loop.md, Aggregation). Sequences with an empty mask do not
    count in the seq-mean modes. max_len defaults to L; pass the step's longest response for
    seq-mean-token-sum-norm, since micro-batches are padded differently.
    Masked positions may hold inf/NaN (e.g. padding); they are dropped without
    poisoning the gradient. With nothing unmasked the result is 0, with a gradient path.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}")
    mask = mask.to(per_token_loss.dtype)
    masked_loss = per_token_loss.masked_fill(mask == 0, 0.0) * mask
    local_tokens, local_sequences = global_counts(mask)
    num_tokens = local_tokens if global_tokens is None else global_tokens
    num_sequences = local_sequences if global_sequences is None else global_sequences
    # the counts are 0 only when every mask is empty and the numerator is exactly 0, so
    # clamping to 1 returns 0 (not 0/0) and keeps the graph attached to the loss
    num_tokens = torch.as_tensor(num_tokens, dtype=mask.dtype, device=mask.device).clamp(min=1.0)
    num_sequences = torch.as_tensor(num_sequences, dtype=mask.dtype, device=mask.device).clamp(min=1.0)
    if mode == "token-mean":
        return masked_loss.sum() / num_tokens
    if mode == "seq-mean-token-sum":
        return masked_loss.sum() / num_sequences
    if mode == "seq-mean-token-mean":
        sequence_means = masked_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return sequence_means.sum() / num_sequences
    max_len = mask.shape[-1] if max_len is None else max_len
    return masked_loss.sum() / (num_sequences * max(max_len, 1))

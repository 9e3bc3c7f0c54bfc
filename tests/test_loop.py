"""The loop's update (run.update_policy) against an independent computation, objective by
objective: two optimizer steps' gradients worked out here from plain HF forwards and the
formulas of docs/loop.md ("The formulas"), with none of the loop's helpers (packing, heads,
losses.py, aggregation), as tests/test_dpo.py does for DPO.

The optimizer is a recorder that keeps each step's gradient and then *takes* a plain SGD step
with it, so that the second mini-batch runs on moved weights: its ratio to the old log-probs
is not 1, and the PPO clip, GSPO's clip and SDPO's IS clip act (each asserted). The engine's
log-probs are the initial policy's plus noise, so the engine correction varies around 1 and
reaches its cap on some tokens.
"""
import copy
import dataclasses

import pytest
import torch

import data
import run
import tiny_models
from microbatch import Models
from objectives import OBJECTIVES
from teacher import Teacher
from test_run import NoSchedule, ONE_PROCESS, _policy, _rollouts

LR = 3.0  # the recorder's SGD step on a gradient clipped to norm 1 (--optim.grad_clip): moves ratios by ~0.1-1
FLAGS = ["--train.mini_batches=2", "--train.micro_batch=3", "--train.shuffle_samples=False", "--sdpo.topk=8",
         "--sdpo.chunk_size=7", "--sdpo.is_clip=1.1"]


class SteppingRecorder:
    """Stands in for the optimizer: keeps each step's gradient (after the loop's clip) and
    the rollouts its micro-batches held, then steps θ ← θ − LR·g."""

    def __init__(self, model):
        self.model, self.grads, self.batches, self.current = model, [], [], []

    def step(self):
        self.grads.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})
        self.batches.append(self.current)
        self.current = []
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.sub_(LR * p.grad)

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def fixed_start(flags):
    """(tiny model dir, tokenizer, config, objective, policy): the flags' objective and the
    fixed start every loop-level test updates (the tiny model moved by seed 3's noise)."""
    tiny = tiny_models.tiny_model_dir()
    cfg = run.parse_config(flags)
    torch.manual_seed(0)
    return tiny, run.load_tokenizer(tiny), cfg, OBJECTIVES[cfg.algo.name], _policy(tiny, seed=3)


def loop_update(flags, rollouts, teacher_kind=None, teacher_seed=None):
    """run.update_policy on the rollouts from the fixed start; returns (recorder, metrics, the
    start's HF model, the teacher copy's HF model or None)."""
    tiny, tokenizer, cfg, objective, policy = fixed_start(flags)
    start = copy.deepcopy(policy.hf)
    teacher = None
    if cfg.algo.name in ("sdpo", "hybrid"):  # the objectives with SDPO's teacher
        kind = teacher_kind or cfg.sdpo.teacher
        teacher = Teacher(kind, cfg.sdpo.teacher_rate, _policy(tiny, seed=teacher_seed) if kind != "live" else None)
    recorder = SteppingRecorder(policy)

    def spied_loss(mb, models, cfg):  # which rollouts each optimizer step used
        recorder.current += [next(i for i, x in enumerate(rollouts) if x is r) for r in mb.rollouts]
        return objective.loss(mb, models, cfg)
    trainer = run.Trainer(Models(policy, teacher=teacher), recorder, NoSchedule())
    metrics, _ = run.update_policy(cfg, dataclasses.replace(objective, loss=spied_loss), trainer, rollouts, 0,
                                   tokenizer.pad_token_id, ONE_PROCESS)
    return recorder, metrics, start, (copy.deepcopy(teacher.copy.hf) if teacher and teacher.copy is not None else None)


# ----------------------------------------------------------------------------------------
# the independent computation


def response_logits(model, ids, n):
    """Raw logits [n, V] predicting the last n of ids (one sequence, no padding)."""
    return model(torch.tensor([ids])).logits[0, len(ids) - n - 1:-1].float()


def token_logprobs(logits, ids, temperature):
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


def divergence(s, t, alpha):
    """docs/loop.md: forward KL at α = 0, reverse KL at 1, generalized Jensen-Shannon between."""
    if alpha == 0:
        return (t.exp() * (t - s)).sum(-1)
    if alpha == 1:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logaddexp(s + torch.log(torch.tensor(1 - alpha)), t + torch.log(torch.tensor(alpha)))
    return (1 - alpha) * (s.exp() * (s - m)).sum(-1) + alpha * (t.exp() * (t - m)).sum(-1)


def with_tail(logprobs, ids):
    """The support: the log-probs at ids, then log(1 − their mass)."""
    top = logprobs.gather(-1, ids)
    return torch.cat([top, torch.log1p(-top.exp().sum(-1, keepdim=True))], dim=-1)


def clip_surrogate(ratio, advantage, low, high, stats):
    """loss_t = max(−A·ratio, −A·clip(ratio, 1−low, 1+high)); counts where the clipped term
    wins, above (A > 0) and below (A < 0)."""
    plain, clipped = -advantage * ratio, -advantage * ratio.clamp(1 - low, 1 + high)
    won = (clipped > plain).detach()
    stats["clipped_high"] += int((won & (advantage > 0)).sum())
    stats["clipped_low"] += int((won & (advantage < 0)).sum())
    stats["pg_tokens"] += len(ratio)
    return torch.maximum(plain, clipped)


def reference_loss(cfg, name, student, teacher, rollouts, chosen, old, stats):
    """The loss of one optimizer step over rollouts[chosen], as docs/loop.md writes it.
    student: the current weights (with gradient); teacher: the teacher copy's HF model
    (trust-region: its reference; None: live, the student itself)."""
    tau, sd, algo = cfg.rollout.temperature, cfg.sdpo, cfg.algo
    sdpo = name == "sdpo"
    counted = [i for i in chosen if not sdpo or rollouts[i].fields.sdpo_mask > 0]
    per_sequence = []  # each counted sequence's per-token loss
    for i in counted:
        r = rollouts[i]
        n = len(r.response_ids)
        logits = response_logits(student, r.prompt_ids + r.response_ids, n)
        s_full = (logits / (1.0 if name == "sft" else tau)).log_softmax(-1)
        s_tok = s_full.gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]
        if name == "sft":
            per_sequence.append(-s_tok)
            continue
        old_tok = old[i]
        log_w = (old_tok - torch.tensor(r.rollout_logprobs))
        if cfg.rollout.is_level == "sequence":  # the mean log ratio over the sequence's tokens
            log_w = log_w.mean().expand(n)
        engine = log_w.clamp(-20, 20).exp().clamp(max=cfg.rollout.is_cap)
        stats["engine_capped"] += int((log_w.exp() > cfg.rollout.is_cap).sum())
        stats["tokens"] += n
        if not cfg.rollout.is_correction:
            engine = torch.ones(n)
        if name in ("sdpo", "hybrid") and r.fields.sdpo_mask > 0:
            with torch.no_grad():
                if sd.teacher == "trust-region":
                    t_logits = ((1 - sd.teacher_rate) * response_logits(teacher, r.fields.teacher_ids, n)
                                + sd.teacher_rate * response_logits(student, r.fields.teacher_ids, n))
                else:
                    t_logits = response_logits(teacher if teacher is not None else student, r.fields.teacher_ids, n)
                t_full = (t_logits / tau).log_softmax(-1)
            t_tok = t_full.gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]
        if sdpo:
            if sd.distill == "token":
                per_token = (s_tok - t_tok).detach() * s_tok
            elif sd.distill == "full":
                per_token = divergence(s_full, t_full, sd.alpha)
            else:
                top = s_full.detach().topk(sd.topk, dim=-1).indices
                per_token = divergence(with_tail(s_full, top), with_tail(t_full, top), sd.alpha)
            is_weight = (s_tok.detach() - old_tok).exp()
            stats["is_clipped"] += int((is_weight > sd.is_clip).sum())
            per_sequence.append(per_token * is_weight.clamp(max=sd.is_clip) * engine)
            continue
        advantage = torch.full((n,), r.fields.advantage)
        if name == "hybrid" and r.fields.sdpo_mask > 0:
            advantage = (algo.lam * advantage + (1 - algo.lam) * (t_tok - s_tok)).detach()
        elif name == "hybrid":
            advantage = algo.lam * advantage
        if name == "gspo":
            log_s = (s_tok - old_tok).mean()
            ratio = (s_tok - s_tok.detach() + log_s.detach()).exp()
            per_token = clip_surrogate(ratio, advantage, algo.gspo_eps_low, algo.gspo_eps_high, stats)
        else:
            per_token = clip_surrogate((s_tok - old_tok).exp(), advantage, algo.eps_low, algo.eps_high, stats)
        per_sequence.append(per_token * engine)
    # aggregation over the step's counted tokens N and sequences B (docs/loop.md)
    mode = algo.loss_agg_mode if algo.loss_agg_mode != "auto" else "seq-mean-token-mean" if name == "gspo" else "token-mean"
    tokens, sequences = sum(len(x) for x in per_sequence), len(per_sequence)
    longest = max(len(rollouts[i].response_ids) for i in chosen)
    return sum({"token-mean": x.sum() / tokens, "seq-mean-token-sum": x.sum() / sequences,
                "seq-mean-token-mean": x.mean() / sequences,
                "seq-mean-token-sum-norm": x.sum() / (sequences * longest)}[mode] for x in per_sequence)


def reference_update(cfg, name, start, teacher, rollouts, steps):
    """The two optimizer steps on rollouts[steps[k]]: each step's gradient (clipped to norm
    --optim.grad_clip as torch's clip_grad_norm_ does), and the SGD step after it."""
    student = copy.deepcopy(start)
    with torch.no_grad():
        old = [token_logprobs(response_logits(student, r.prompt_ids + r.response_ids, len(r.response_ids)),
                              r.response_ids, cfg.rollout.temperature) for r in rollouts]
    stats = {"is_clipped": 0, "clipped_high": 0, "clipped_low": 0, "pg_tokens": 0, "engine_capped": 0, "tokens": 0,
             "grad_norms": []}
    grads = []
    for chosen in steps:
        student.zero_grad()
        reference_loss(cfg, name, student, teacher, rollouts, chosen, old, stats).backward()
        params = {n: p for n, p in student.named_parameters() if p.grad is not None}
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in params.values()))
        scale = min(1.0, cfg.optim.grad_clip / (float(norm) + 1e-6))
        stats["grad_norms"].append(float(norm))
        grads.append({"hf." + n: p.grad * scale for n, p in params.items()})
        with torch.no_grad():
            for p in params.values():
                p.sub_(LR * scale * p.grad)
    return grads, stats


def fixed_rollouts(algo, start, tokenizer, cfg):
    """_rollouts' batch (3 prompts x 4 samples, the first of each a success), with the engine's
    log-probs the start's own plus noise (std 0.4): engine weights around 1, some at the cap."""
    if algo == "sft":
        return run.sft_rollouts(tokenizer, data.task_rows("strops", "train", 6, seed=1), cfg, 0)
    rollouts = _rollouts(tokenizer, algo)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for r in rollouts:
            lp = token_logprobs(response_logits(start, r.prompt_ids + r.response_ids, len(r.response_ids)),
                                r.response_ids, cfg.rollout.temperature)
            r.rollout_logprobs = (lp + 0.4 * torch.randn(len(lp), generator=g)).tolist()
    return rollouts


# name, the loss's kind, flags
CASES = [
    ("sdpo", "sdpo", ["--algo=sdpo"]),
    ("sdpo-full-reverse", "sdpo", ["--algo=sdpo", "--sdpo.distill=full", "--sdpo.alpha=1.0", "--sdpo.chunked=False"]),
    ("sdpo-forward-kl", "sdpo", ["--algo=sdpo", "--sdpo.alpha=0.0"]),
    ("sdpo-token", "sdpo", ["--algo=sdpo", "--sdpo.distill=token"]),
    ("sdpo-no-is-correction", "sdpo", ["--algo=sdpo", "--rollout.is_correction=False"]),
    ("sdpo-trust-region", "sdpo", ["--algo=sdpo", "--sdpo.teacher=trust-region", "--sdpo.teacher_rate=0.3"]),
    ("sdpo-live", "sdpo", ["--algo=sdpo", "--sdpo.teacher=live", "--sdpo.is_clip=1.01"]),
    ("grpo", "grpo", ["--algo=grpo"]),
    ("grpo-no-is-correction", "grpo", ["--algo=grpo", "--rollout.is_correction=False"]),
    ("grpo-sequence-is", "grpo", ["--algo=grpo", "--rollout.is_level=sequence", "--rollout.is_cap=1.1"]),
    ("grpo-seq-mean-token-sum", "grpo", ["--algo=grpo", "--algo.loss_agg_mode=seq-mean-token-sum"]),
    ("grpo-seq-mean-token-sum-norm", "grpo", ["--algo=grpo", "--algo.loss_agg_mode=seq-mean-token-sum-norm"]),
    ("grpo-unchunked-head", "grpo", ["--algo=grpo", "--train.head_chunk_size=0"]),
    ("sdpo-seq-mean-token-mean", "sdpo", ["--algo=sdpo", "--algo.loss_agg_mode=seq-mean-token-mean"]),
    ("gspo", "gspo", ["--algo=gspo"]),
    ("hybrid", "hybrid", ["--algo=hybrid"]),
    ("sft", "sft", ["--algo=sft"]),
    ("sft-unchunked-head", "sft", ["--algo=sft", "--train.head_chunk_size=0"]),
]


@pytest.mark.parametrize("case,name,flags", CASES, ids=[c[0] for c in CASES])
def test_two_optimizer_steps_match_the_formulas_on_plain_forwards(case, name, flags):
    tiny = tiny_models.tiny_model_dir()
    tokenizer = run.load_tokenizer(tiny)
    cfg = run.parse_config(FLAGS + flags)
    torch.manual_seed(0)
    rollouts = fixed_rollouts(name, _policy(tiny, seed=3).hf, tokenizer, cfg)
    recorder, metrics, start, teacher = loop_update(FLAGS + flags, rollouts)
    assert len(recorder.grads) == 2 and all(recorder.batches)
    steps = [sorted(set(b)) for b in recorder.batches]
    assert sorted(i for s in steps for i in s) == sorted(range(len(rollouts)))  # each sample in one step
    want, stats = reference_update(cfg, name, start, teacher, rollouts, steps)
    for got, expected in zip(recorder.grads, want):
        assert got.keys() == expected.keys()
        norm = torch.sqrt(sum((g ** 2).sum() for g in expected.values()))
        assert norm > 1e-4  # the loss reaches the weights
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-3, atol=1e-4 * float(norm), msg=key)
    # the norm before the clip (the loop logs its mean over the steps): the loss's scale, which the clip hides
    assert metrics["actor/grad_norm"] == pytest.approx(sum(stats["grad_norms"]) / 2, rel=1e-3)
    if cfg.rollout.is_correction and name != "sft":
        assert stats["engine_capped"] > 0, stats  # the engine correction reaches its cap somewhere
        assert metrics["is/clipfrac"] == pytest.approx(stats["engine_capped"] / stats["tokens"])  # and the run says so
    # the second step moved off ratio 1: the clips act
    if name == "sdpo":
        assert stats["is_clipped"] > 0, stats
        assert metrics["sdpo/is_clipfrac"] == pytest.approx(stats["is_clipped"] / stats["tokens"])
    elif name != "sft":
        if name == "gspo":  # a sequence's ratio: here every one fell
            assert stats["clipped_high"] + stats["clipped_low"] > 0, stats
        else:
            assert stats["clipped_high"] > 0 and stats["clipped_low"] > 0, stats
        clipped = (stats["clipped_high"] + stats["clipped_low"]) / stats["pg_tokens"]
        assert metrics["actor/pg_clipfrac"] == pytest.approx(clipped)


def test_the_live_teacher_is_an_ema_teacher_holding_the_current_weights():
    """An update's first optimizer step: the live teacher gives the loss, gradient and
    metrics of an EMA teacher whose copy holds the policy's weights. Its second, after the
    policy moved: the live teacher moved with it, the EMA copy (which moves after the update) did not."""
    tiny = tiny_models.tiny_model_dir()
    tokenizer = run.load_tokenizer(tiny)
    for mini_batches in (1, 2):
        flags = FLAGS + ["--algo=sdpo", f"--train.mini_batches={mini_batches}"]
        cfg = run.parse_config(flags)
        rollouts = fixed_rollouts("sdpo", _policy(tiny, seed=3).hf, tokenizer, cfg)
        live, live_metrics, _, _ = loop_update(flags, copy.deepcopy(rollouts), teacher_kind="live")
        ema, ema_metrics, _, _ = loop_update(flags, copy.deepcopy(rollouts), teacher_kind="ema", teacher_seed=3)
        assert len(live.grads) == len(ema.grads) == mini_batches
        for name in ema.grads[0]:
            torch.testing.assert_close(live.grads[0][name], ema.grads[0][name], rtol=1e-4, atol=1e-7, msg=name)
        if mini_batches == 1:
            assert live_metrics["actor/loss"] != 0
            for key in (k for k in ema_metrics if not k.startswith("time/")):
                assert live_metrics[key] == pytest.approx(ema_metrics[key], rel=1e-4, abs=1e-7), key
        else:
            difference = sum(float((live.grads[1][n] - ema.grads[1][n]).norm()) for n in ema.grads[1])
            assert difference > 1e-3 * sum(float(g.norm()) for g in ema.grads[1].values())

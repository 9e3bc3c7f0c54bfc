"""Online DPO and SPIN (--algo dpo): pairing rules, a hand-worked step, the reference refresh,
invariance to micro-batch size and to the number of ranks, and a two-rank run."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import data
import objectives
import rollout
import run
from microbatch import Models, Rollout
from objectives import OBJECTIVES
from objectives.dpo import preference_pairs, prepare_pairs
from teacher import Reference
from test_run import GradRecorder, NoSchedule, ONE_PROCESS, ROOT, SMALL, _free_port, _metrics, _policy, _rollouts, _run
from policy import CausalLM
from update import mini_batch_units, step_counts

DPO = OBJECTIVES["dpo"]


def dpo_config(*flags):
    return run.parse_config(["--algo=dpo", "--train.mini_batches=1", *flags])


# ----------------------------------------------------------------------------------------
# pairs


def test_best_worst_pairs_the_first_best_sample_with_the_first_worst():
    assert preference_pairs([0.0, 1.0, 0.5, 1.0, 0.0], "best_worst") == ([(1, 0)], 0)
    assert preference_pairs([0.2, 0.7], "best_worst") == ([(1, 0)], 0)


def test_all_pairs_every_two_samples_with_different_rewards():
    rewards = [1.0, 0.0, 1.0, 0.5]
    pairs, ties = preference_pairs(rewards, "all")
    brute = {(i, j) for i in range(4) for j in range(4) if rewards[i] > rewards[j]}
    assert sorted(pairs) == sorted(brute) and len(pairs) == 5
    assert ties == 1  # samples 0 and 2


@pytest.mark.parametrize("mode,ties", [("best_worst", 1), ("all", 6)])
def test_equal_rewards_give_no_pair_and_count_each_tie(mode, ties):
    assert preference_pairs([1.0] * 4, mode) == ([], ties)


@pytest.mark.parametrize("mode", ["best_worst", "all"])
def test_a_single_sample_has_no_pair_and_no_tie(mode):
    assert preference_pairs([1.0], mode) == ([], 0)
    assert preference_pairs([], mode) == ([], 0)


def _scored(tokenizer, rewards_per_prompt, seed=0):
    """Canned rollouts (test_run._rollouts) of len(rewards_per_prompt) prompts, with these rewards."""
    n = len(rewards_per_prompt[0])
    rollouts = _rollouts(tokenizer, "grpo", n_prompts=len(rewards_per_prompt), n=n, seed=seed)
    for r, reward in zip(rollouts, [x for rewards in rewards_per_prompt for x in rewards]):
        r.reward = reward
    return rollouts


def test_prepare_marks_pairs_and_a_prompt_without_a_pair_contributes_nothing(tokenizer):
    cfg = dpo_config("--rollout.n=4", "--dpo.pairs=all")
    rollouts = _scored(tokenizer, [[1, 0, 0, 1], [0, 0, 0, 0], [0.5, 1, 0, 0.5]])
    metrics = prepare_pairs(rollouts, tokenizer, cfg)
    assert metrics == {"dpo/pairs": 4 + 5, "dpo/ties_skipped": 2 + 6 + 1, "dpo/prompts_with_pair": 2 / 3}
    assert [r.fields.preferred_over for r in rollouts[:4]] == [[1, 2], [], [], [1, 2]]
    assert [r.fields.sample_index for r in rollouts] == [0, 1, 2, 3] * 3
    assert not any(r.fields.paired for r in rollouts[4:8])
    units = mini_batch_units(rollouts, DPO)
    assert units == [[0, 1, 2, 3], [], [8, 9, 10, 11]]  # one unit per prompt, the tied one empty
    counts = step_counts([rollouts[i] for unit in units for i in unit], DPO)
    assert counts["pairs"] == 9 and counts["sequences"] == 8


def test_spin_chooses_the_reference_ending_with_the_engines_eos_over_every_sample(tokenizer):
    cfg = dpo_config("--rollout.n=3", "--dpo.chosen=reference")
    rollouts = _scored(tokenizer, [[0, 1, 0], [0, 0, 0]])
    stop = 7  # a model whose responses end with a stop token other than the tokenizer's EOS
    for r in rollouts:
        r.response_ids[-1] = stop
    rollouts[1].truncated, rollouts[1].response_ids[-1] = True, 9  # a truncated response says nothing
    row = rollouts[3].row
    rollouts[4].response_ids = tokenizer(row["reference"], add_special_tokens=False)["input_ids"] + [stop]
    metrics = prepare_pairs(rollouts, tokenizer, cfg)
    assert len(rollouts) == 8
    references = rollouts[6:]
    for reference, first in zip(references, (rollouts[0], rollouts[3])):
        assert not reference.generated and reference.row is first.row and reference.prompt_ids == first.prompt_ids
        assert reference.response_ids == tokenizer(first.row["reference"], add_special_tokens=False)["input_ids"] + [stop]
        assert reference.fields.sample_index == 3 and reference.fields.paired
    assert references[0].fields.preferred_over == [0, 1, 2]
    assert references[1].fields.preferred_over == [0, 2]  # sample 1 is the reference itself: a tie
    assert metrics == {"dpo/pairs": 5, "dpo/ties_skipped": 1, "dpo/prompts_with_pair": 1.0}
    units = mini_batch_units(rollouts, DPO)
    assert units == [[0, 1, 2, 6], [3, 5, 7]]


def test_spin_on_a_row_without_a_reference_names_the_row_and_field(tokenizer):
    rollouts = _scored(tokenizer, [[0, 1]])
    for r in rollouts:
        r.row = {**r.row, "reference": None, "source": "data.jsonl, row 12"}
    with pytest.raises(ValueError, match=r"data.jsonl, row 12: --dpo.chosen reference .*'teacher_response'"):
        prepare_pairs(rollouts, tokenizer, dpo_config("--rollout.n=2", "--dpo.chosen=reference"))


def test_one_sample_per_prompt_is_refused():
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        prepare_pairs([], None, dpo_config("--rollout.n=1"))


# ----------------------------------------------------------------------------------------
# a hand-worked step on a unigram "language model": every token's log-prob is log_softmax(w)


class Unigram(torch.nn.Module):
    """p(token) = softmax(weight) whatever the context, through CausalLM's head interface."""

    def __init__(self, logits):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(logits, dtype=torch.float32)[:, None])

    def forward(self, packed, head):
        return head(torch.ones(len(packed.targets), 1), self.weight)


REFERENCE_P = [0.1, 0.1, 0.3, 0.3, 0.2]


def _unigram_batch(cfg):
    """Two prompts, one pair each under best_worst: A: [1, 2] over [3, 3, 4]; B: [2] over [4]."""
    responses = {"A": ([1, 2], [3, 3, 4], [0, 4]), "B": ([4], [2])}
    rewards = {"A": (1.0, 0.0, 0.5), "B": (0.0, 1.0)}
    rollouts = [Rollout(row={"uid": uid}, prompt_ids=[1, 2], response_ids=ids, rollout_logprobs=[-1.6] * len(ids),
                        text="", truncated=False, reward=reward)
                for uid in ("A", "B") for ids, reward in zip(responses[uid], rewards[uid])]
    prepare_pairs(rollouts, None, cfg)
    return rollouts


def _unigram_step(cfg, policy_logits):
    policy = Unigram(policy_logits)
    reference = None if cfg.dpo.reference_free else Reference(Unigram([math.log(p) for p in REFERENCE_P]))
    recorder = GradRecorder(policy)
    metrics, stepped = run.update_policy(cfg, DPO, run.Trainer(Models(policy, reference=reference), recorder,
                                                                NoSchedule()), _unigram_batch(cfg), 0, 0, ONE_PROCESS)
    return recorder.grads, metrics


def test_hand_worked_sigmoid_step():
    """Uniform policy over 5 tokens: a response of L tokens has log-prob -L log 5, and
    d log p(response)/d w_k = count_k - L/5. Two pairs, the loss their mean."""
    cfg = dpo_config("--rollout.n=2", "--train.micro_batch=4", "--optim.grad_clip=1e9")
    grads, metrics = _unigram_step(cfg, [0.0] * 5)
    beta, log5, lp = 0.1, math.log(5), [math.log(p) for p in REFERENCE_P]
    pairs = [([1, 2], [3, 3, 4]), ([2], [4])]  # (chosen, rejected)
    logits = [(-len(c) + len(r)) * log5 - (sum(lp[t] for t in c) - sum(lp[t] for t in r)) for c, r in pairs]
    # pair A: log 5 - (log .1 + log .3 - 2 log .3 - log .2) = log 5 - log(.03 / .018) > 0;
    # pair B: 0 - (log .3 - log .2) < 0: the reference prefers B's chosen response more than the policy does
    assert logits[0] == pytest.approx(math.log(5) - math.log(0.03 / 0.018))
    assert logits[1] == pytest.approx(-math.log(0.3 / 0.2))
    loss = sum(math.log1p(math.exp(-beta * x)) for x in logits) / 2
    assert metrics["actor/loss"] == pytest.approx(loss, rel=1e-6)
    grad = [0.0] * 5
    for (c, r), x in zip(pairs, logits):
        dloss_dlogit = -beta / (1 + math.exp(beta * x)) / 2
        for k in range(5):
            grad[k] += dloss_dlogit * ((c.count(k) - len(c) / 5) - (r.count(k) - len(r) / 5))
    assert grads[0]["weight"][:, 0].tolist() == pytest.approx(grad, rel=1e-5, abs=1e-8)
    chosen_rewards = [beta * (-len(c) * log5 - sum(lp[t] for t in c)) for c, _ in pairs]
    rejected_rewards = [beta * (-len(r) * log5 - sum(lp[t] for t in r)) for _, r in pairs]
    assert metrics["dpo/rewards_chosen"] == pytest.approx(sum(chosen_rewards) / 2, rel=1e-6)
    assert metrics["dpo/rewards_rejected"] == pytest.approx(sum(rejected_rewards) / 2, rel=1e-6)
    assert metrics["dpo/margin"] == pytest.approx((sum(chosen_rewards) - sum(rejected_rewards)) / 2, rel=1e-6)
    assert metrics["dpo/accuracy"] == sum(c > r for c, r in zip(chosen_rewards, rejected_rewards)) / 2 == 0.5


def _spec_loss(w, pairs, kind, beta, eps, reference_free):
    """The DPO losses of docs/loop.md in float64, from the unigram weights w [5] (IPO: mean log-probs)."""
    def logprob(seq, logits):
        total = logits.log_softmax(0)[seq].sum()
        return total / len(seq) if kind == "ipo" else total

    ref = torch.tensor([math.log(p) for p in REFERENCE_P], dtype=torch.float64)
    out = []
    for c, r in pairs:
        x = logprob(c, w) - logprob(r, w)
        if not reference_free:
            x = x - (logprob(c, ref) - logprob(r, ref))
        logsig = torch.nn.functional.logsigmoid
        out.append({"sigmoid": -(1 - eps) * logsig(beta * x) - eps * logsig(-beta * x),
                    "ipo": (x - 1 / (2 * beta)) ** 2,
                    "hinge": torch.relu(1 - beta * x),
                    "robust": (-(1 - eps) * logsig(beta * x) + eps * logsig(-beta * x)) / (1 - 2 * eps)}[kind])
    return sum(out) / len(out)


@pytest.mark.parametrize("kind,eps,reference_free", [("sigmoid", 0.1, False), ("ipo", 0.0, False),
                                                     ("hinge", 0.0, False), ("robust", 0.2, False),
                                                     ("sigmoid", 0.0, True)])
def test_every_loss_type_gives_the_float64_gradient_of_the_spec_formula(kind, eps, reference_free):
    w0 = [0.3, -0.2, 0.5, 0.1, -0.4]
    cfg = dpo_config("--rollout.n=2", "--train.micro_batch=1", "--optim.grad_clip=1e9", "--dpo.beta=0.5",
                     f"--dpo.loss_type={kind}", f"--dpo.label_smoothing={eps}", f"--dpo.reference_free={reference_free}")
    grads, metrics = _unigram_step(cfg, w0)
    w = torch.tensor(w0, dtype=torch.float64, requires_grad=True)
    expected = _spec_loss(w, [([1, 2], [3, 3, 4]), ([2], [4])], kind, 0.5, eps, reference_free)
    expected.backward()
    assert metrics["actor/loss"] == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(grads[0]["weight"][:, 0].double(), w.grad, rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------------------------------
# the reference model


def test_reference_refreshes_exactly_at_multiples_of_the_interval():
    policy, reference = Unigram([0.0] * 5), Reference(Unigram([1.0] * 5), every=3)
    never = Reference(Unigram([1.0] * 5), every=0)
    held = reference.model.weight.detach().clone()
    for step in range(1, 10):
        with torch.no_grad():
            policy.weight.add_(0.1)  # the policy moves every step
        refreshed = reference.refresh(policy, step)
        assert refreshed == (step % 3 == 0), step
        if refreshed:
            held = policy.weight.detach().clone()
        assert torch.equal(reference.model.weight, held), step
        assert not never.refresh(policy, step) and torch.equal(never.model.weight, torch.ones(5, 1))
    assert not reference.model.weight.requires_grad
    with pytest.raises(ValueError):
        Reference(Unigram([0.0] * 5), every=-1)


class ProbeEngine:
    """Accepts every weight sync (run.sync_engine's contract) without a vLLM engine."""

    def update_weights(self, state, probe, trainer_logprobs, tol, version=None, probe_images=None):
        return rollout.SyncResult(seconds=0.0, probe_max_abs_diff=0.0)


def test_the_loop_refreshes_the_reference_after_every_nth_step(tiny_dir, tokenizer):
    cfg = dpo_config("--rollout.n=4", "--dpo.ref_update_every=2", "--train.micro_batch=8")
    policy = _policy(tiny_dir, seed=5)
    reference = Reference(_policy(tiny_dir), every=2)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    trainer = run.Trainer(Models(policy, reference=reference), optimizer, NoSchedule())
    previous = [p.detach().clone() for p in reference.model.parameters()]
    for step in range(5):
        rollouts = _scored(tokenizer, [[1, 0, 0, 0], [0, 1, 1, 0]], seed=step)
        prepare_pairs(rollouts, tokenizer, cfg)
        metrics = run.learn(cfg, DPO, trainer, ProbeEngine(), tokenizer, rollouts, step, ONE_PROCESS)
        now = [p.detach().clone() for p in reference.model.parameters()]
        if (step + 1) % 2 == 0:
            assert metrics["reference/refreshed"] == 1.0
            assert all(torch.equal(r, p) for r, p in zip(now, policy.parameters()))
            assert any(not torch.equal(a, b) for a, b in zip(now, previous))
        else:
            assert metrics["reference/refreshed"] == 0.0
            assert all(torch.equal(a, b) for a, b in zip(now, previous))
        previous = now


def test_checkpoint_restores_the_reference(tiny_dir, tmp_path):
    def trainer(seed):
        policy = _policy(tiny_dir, seed=seed)
        optimizer = torch.optim.AdamW(policy.parameters())
        return run.Trainer(Models(policy, reference=Reference(_policy(tiny_dir, seed=seed + 1), every=2)),
                           optimizer, NoSchedule())

    saved, restored = trainer(1), trainer(10)
    run.save_checkpoint(str(tmp_path / "ckpt"), saved, 4, None, ONE_PROCESS)
    assert run.load_checkpoint(str(tmp_path / "ckpt"), restored, run.parse_config([]), ONE_PROCESS) == (4, None, None)
    for a, b in zip(saved.models.reference.model.parameters(), restored.models.reference.model.parameters()):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------
# the step on the tiny model


def _tiny_step(tiny_dir, tokenizer, flags, rewards, recorder_policy=None):
    cfg = dpo_config("--rollout.n=4", *flags)
    torch.manual_seed(0)
    policy = _policy(tiny_dir, seed=3)
    reference = None if cfg.dpo.reference_free else Reference(_policy(tiny_dir), cfg.dpo.ref_update_every)
    recorder = GradRecorder(policy)
    rollouts = _scored(tokenizer, rewards)
    prepare_pairs(rollouts, tokenizer, cfg)
    metrics, _ = run.update_policy(cfg, DPO, run.Trainer(Models(policy, reference=reference), recorder, NoSchedule()),
                                   rollouts, 0, tokenizer.pad_token_id, ONE_PROCESS)
    return recorder.grads, metrics, policy, rollouts


REWARDS = [[1, 0, 0.5, 0], [0, 0, 0, 0], [1, 1, 0, 0], [0, 0.5, 0, 1]]


@pytest.mark.parametrize("flags", [[], ["--dpo.pairs=all", "--dpo.loss_type=ipo"],
                                   ["--dpo.chosen=reference", "--dpo.loss_type=robust", "--dpo.label_smoothing=0.1"],
                                   ["--dpo.reference_free=True", "--dpo.loss_type=hinge", "--train.mini_batches=2"]],
                         ids=["sigmoid", "all-ipo", "spin-robust", "reference-free-hinge-2-steps"])
def test_micro_batch_size_does_not_change_dpo_gradients(tiny_dir, tokenizer, flags):
    one, metrics_one, _, _ = _tiny_step(tiny_dir, tokenizer, flags + ["--train.micro_batch=1"], REWARDS)
    four, metrics_four, _, _ = _tiny_step(tiny_dir, tokenizer, flags + ["--train.micro_batch=4"], REWARDS)
    assert len(one) == len(four) >= 1
    assert all(sum(g.abs().sum() for g in step.values()) > 0 for step in one)
    for step_one, step_four in zip(one, four):
        for name in step_one:
            torch.testing.assert_close(step_one[name], step_four[name], rtol=1e-4, atol=1e-7, msg=name)
    for key in (k for k in metrics_one if not k.startswith("time/")):
        assert metrics_one[key] == pytest.approx(metrics_four[key], rel=1e-4, abs=1e-7), key


def test_sequence_log_probs_are_sums_of_a_plain_forwards_token_log_probs(tiny_dir, tokenizer):
    """Reference-free rewards are β × the policy's summed response log-probs: check them
    against an unpacked HF forward of each pair's sequences (temperature 1)."""
    _, metrics, policy, rollouts = _tiny_step(tiny_dir, tokenizer, ["--dpo.reference_free=True"], REWARDS)

    def plain(r):
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            logits = policy.hf(input_ids=ids).logits[0, len(r.prompt_ids) - 1:-1].double()
        return logits.log_softmax(-1).gather(1, torch.tensor(r.response_ids)[:, None]).sum().item()

    chosen = [r for r in rollouts if r.fields.preferred_over]
    rejected = [next(s for s in rollouts if s.row["uid"] == r.row["uid"] and s.fields.sample_index == r.fields.preferred_over[0])
                for r in chosen]
    assert len(chosen) == 3
    assert metrics["dpo/logps_chosen"] == pytest.approx(sum(map(plain, chosen)) / 3, rel=1e-5)
    assert metrics["dpo/rewards_rejected"] == pytest.approx(0.1 * sum(map(plain, rejected)) / 3, rel=1e-5)


def test_a_batch_without_a_pair_takes_no_optimizer_step(tiny_dir, tokenizer):
    cfg = dpo_config("--rollout.n=4", "--train.mini_batches=2")
    policy = _policy(tiny_dir, seed=4)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.1)
    trainer = run.Trainer(Models(policy, reference=Reference(_policy(tiny_dir))), optimizer,
                          torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    rollouts = _scored(tokenizer, [[1, 1, 1, 1], [0, 0, 0, 0]])
    assert prepare_pairs(rollouts, tokenizer, cfg)["dpo/pairs"] == 0
    before = [p.detach().clone() for p in policy.parameters()]
    metrics, stepped = run.update_policy(cfg, DPO, trainer, rollouts, 0, tokenizer.pad_token_id, ONE_PROCESS)
    assert not stepped and metrics["actor/skipped_steps"] == 2
    assert all(torch.equal(p, b) for p, b in zip(policy.parameters(), before))


# ----------------------------------------------------------------------------------------
# two ranks (torchrun)

# n = 3: nine paired samples over five prompts, so the ranks' shares of the reference
# forward and of the micro-batches differ (idle forwards) and one mini-batch has one pair
TWO_RANK_REWARDS = [[1, 0, 0], [0, 0, 0], [1, 0.5, 0], [1, 1, 1], [0, 1, 0]]
TWO_RANK_FLAGS = ["--rollout.n=3", "--dpo.pairs=all", "--train.mini_batches=2", "--train.micro_batch=2",
                  "--optim.grad_clip=1e9"]


@pytest.mark.slow
def test_two_ranks_give_the_gradients_of_one(tiny_dir, tokenizer, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           os.path.join(ROOT, "tests", "dist_dpo.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    two = torch.load(tmp_path / "grads.pt")
    with open(tmp_path / "metrics.json") as f:
        two_metrics = json.load(f)
    one, metrics, _, _ = _tiny_step(tiny_dir, tokenizer, TWO_RANK_FLAGS, TWO_RANK_REWARDS)
    assert len(one) == len(two) == 2
    for step_one, step_two in zip(one, two):
        assert step_one.keys() == step_two.keys()
        for name in step_one:
            torch.testing.assert_close(step_two[name], step_one[name], rtol=1e-4, atol=1e-6, msg=name)
    for key in ("actor/loss", "dpo/rewards_chosen", "dpo/margin", "dpo/accuracy", "rollout/mismatch_kl"):
        assert two_metrics[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-7), key


@pytest.mark.slow
@pytest.mark.extended  # two-rank DPO gradients: test_two_ranks_give_the_gradients_of_one
def test_two_rank_spin_run_refreshes_the_reference_and_syncs(tmp_path):
    out = str(tmp_path / "spin")
    _run(SMALL + ["--algo=dpo", "--dpo.chosen=reference", "--dpo.ref_update_every=1", "--train.steps=3",
                  "--train.mini_batches=2", "--train.micro_batch=3", "--train.eval_every=3", f"--log.out_dir={out}"],
         nproc=2)
    steps = [r for r in _metrics(out) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["sync/probe_max_abs_diff"] < 1e-3  # the engine holds the trained weights
        assert r["dpo/pairs"] + r["dpo/ties_skipped"] == 4 * 4  # every sample against its row's reference
        assert r["reference/refreshed"] == 1.0 and r["actor/grad_norm"] > 0
        for key in ("dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/margin", "dpo/accuracy",
                    "rollout/mismatch_kl", "time/reference_s", "reward/mean", "response/length_mean"):
            assert key in r, key
    assert "eval/success_rate" in steps[-1]


def _refused(flags, capsys) -> str:
    """The message of the FlagError (exit status 2 on the command line) raised when a flag's
    dataclass refuses its value."""
    import re
    import data
    with pytest.raises(data.FlagError) as refused:
        run.parse_config(flags)
    assert refused.value.exit_code == 2
    return re.sub(r"[│\s]+", " ", str(refused.value))


@pytest.mark.parametrize("flags, message", [
    (["--dpo.beta=0"], "--dpo.beta=0.0: must be > 0"),
    (["--dpo.label_smoothing=0.5"], "--dpo.label_smoothing=0.5: must be at least 0 and below 0.5"),
    (["--dpo.ref_update_every=-1"], "--dpo.ref_update_every=-1: must be at least 0"),
    (["--dpo.reference_free=True", "--dpo.ref_update_every=2"],
     "--dpo.reference_free has no reference to refresh: drop --dpo.ref_update_every"),
])
def test_dpo_flags_out_of_range_are_refused_naming_them(flags, message, capsys):
    assert message in _refused(["--algo=dpo"] + flags, capsys)
    run.parse_config(["--algo=dpo", "--dpo.beta=0.5", "--dpo.label_smoothing=0.49", "--dpo.ref_update_every=0",
                      "--dpo.reference_free=True"])  # the edges that are allowed

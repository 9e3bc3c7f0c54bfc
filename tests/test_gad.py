"""GAD (--algo gad): the discriminator's last-token score, its Bradley–Terry step, rewards from
the discriminator before its update, the stages, the KL term, checkpoints, bad data, two ranks."""
import copy
import json
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

import data
import discriminator
import losses
import microbatch
import packing
import run
import warm_start
from flags import parse_config
from discriminator import Critic
from microbatch import Models
from objectives import OBJECTIVES
from objectives.gad import gad_loss, gad_rewards, prepare_teacher_responses
from teacher import Reference
from test_run import (OF_THE_BATCH, ONE_PROCESS, SMALL, GradRecorder, NoSchedule, _metrics, _policy, _rollouts, _run,
                      check_agrees_with_one_rank)
from update import step_counts

GAD = OBJECTIVES["gad"]


def gad_config(*flags):
    return run.parse_config(["--algo=gad", "--train.mini_batches=1", *flags])


def _critic(tiny_dir, seed=0, lr=1e-3):
    return Critic(discriminator.load(tiny_dir, seed, 1, torch.device("cpu")), lr, 0.0, 1e9)


def _gad_rollouts(tokenizer, cfg, n_prompts=2, n=3, seed=0):
    """Canned student samples (test_run._rollouts) whose rows carry a teacher response, with
    each prompt's teacher response appended as prepare does."""
    rollouts = _rollouts(tokenizer, "grpo", n_prompts=n_prompts, n=n, seed=seed)
    for r in rollouts:
        r.row = {**r.row, "teacher_response": r.row["reference"]}
        r.response_ids[-1] = tokenizer.eos_token_id  # finished: ends with the engine's EOS
    prepare_teacher_responses(rollouts, tokenizer, cfg)
    return rollouts


# ----------------------------------------------------------------------------------------
# the discriminator


def test_score_is_read_at_the_last_real_token_whatever_the_padding(tiny_dir):
    model = discriminator.load(tiny_dir, 0, 1, torch.device("cpu"))
    seqs = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    with torch.no_grad():
        alone = torch.cat([model(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long)) for s in seqs])
        right = model(*discriminator.right_pad(seqs, 0, "cpu"))
        left = model(*packing.pad(seqs, 0))
        changed = model(*discriminator.right_pad([s[:-1] + [99] for s in seqs], 0, "cpu"))
    torch.testing.assert_close(right, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(left, alone, rtol=1e-5, atol=1e-5)
    assert (changed - alone).abs().min() > 1e-4  # the last token matters: it is where the head reads


def test_mean_pool_reads_the_mean_of_the_response_tokens_states_whatever_the_padding(tiny_dir):
    model = discriminator.load(tiny_dir, 0, 1, torch.device("cpu"), pool="mean")
    seqs, starts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [13, 14, 15, 16]], [2, 1, 3]
    with torch.no_grad():
        by_hand = torch.stack([model.head(model.backbone(input_ids=torch.tensor([s])).last_hidden_state[0, k:].mean(0))
                               for s, k in zip(seqs, starts)]).squeeze(-1)
        right = model(*discriminator.right_pad(seqs, 0, "cpu"), torch.tensor(starts))
        left = model(*packing.pad(seqs, 0), torch.tensor(starts))
        prompt_changed = model(*discriminator.right_pad([[99] + s[1:] for s in seqs], 0, "cpu"), torch.tensor(starts))
    torch.testing.assert_close(right, by_hand, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(left, by_hand, rtol=1e-5, atol=1e-5)
    assert (prompt_changed - right).abs().min() > 1e-5  # the prompt is read, through attention, not pooled


def test_the_discriminator_has_no_dropout_and_a_fresh_head_the_same_for_a_seed(tiny_dir):
    a, b = (discriminator.load(tiny_dir, 7, 1, torch.device("cpu")) for _ in range(2))
    assert all(v == 0.0 for k, v in vars(a.backbone.config).items() if "dropout" in k and isinstance(v, float))
    assert torch.equal(a.head.weight, b.head.weight)
    assert not torch.equal(a.head.weight, discriminator.load(tiny_dir, 8, 1, torch.device("cpu")).head.weight)


def test_bradley_terry_loss_and_accuracy_on_a_hand_example():
    teacher = torch.tensor([1.0, 0.0])
    students = torch.tensor([[0.0, 2.0], [-1.0, 0.0]])
    loss, accuracy = losses.discriminator_loss(teacher, students)
    # gaps 1, -1, 1, 0: -log σ(gap) averaged; teacher above student in 2 of 4 pairs (a tie is not above)
    by_hand = (math.log1p(math.exp(-1)) * 2 + math.log1p(math.exp(1)) + math.log(2)) / 4
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)
    assert accuracy.item() == 0.5


def test_a_step_reports_the_loss_and_accuracy_of_its_pre_update_scores_and_has_their_gradient(tiny_dir, tokenizer):
    cfg = gad_config("--rollout.n=3", "--train.micro_batch=4")  # 4 sequences: one prompt per micro-batch
    rollouts = _gad_rollouts(tokenizer, cfg)
    critic = _critic(tiny_dir)
    before = copy.deepcopy(critic.model)
    critic.optimizer = GradRecorder(critic.model)
    metrics = gad_rewards(rollouts, Models(_policy(tiny_dir), discriminator=critic), cfg, tokenizer.pad_token_id,
                          ONE_PROCESS)
    pairs = []
    for uid in dict.fromkeys(r.row["uid"] for r in rollouts):
        group = [r for r in rollouts if r.row["uid"] == uid]
        teacher = next(r for r in group if not r.generated)
        pairs += [(teacher, s) for s in group if s.generated]
    assert len(pairs) == 6 and critic.steps == 1
    gaps = [t.fields.discriminator_score - s.fields.discriminator_score for t, s in pairs]
    assert metrics["gad/d_loss"] == pytest.approx(sum(-F.logsigmoid(torch.tensor(g)).item() for g in gaps) / 6, rel=1e-5)
    assert metrics["gad/d_acc"] == pytest.approx(sum(g > 0 for g in gaps) / 6)
    # the gradient is that of the mean over all pairs, each sequence scored alone (a slow loop)
    alone = lambda r: before(torch.tensor([r.prompt_ids + r.response_ids]),
                             torch.ones(1, len(r.prompt_ids) + len(r.response_ids), dtype=torch.long))[0]
    slow = sum(-F.logsigmoid(alone(t) - alone(s)) for t, s in pairs) / len(pairs)
    slow.backward()
    (grads,) = critic.optimizer.grads
    for name, p in before.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_accuracy_counts_only_pairs_whose_texts_differ(tiny_dir):
    """A student answer that is the teacher's text scores exactly as the teacher's: such a pair
    is neither right nor wrong; d_acc is over the others, identical_frac says how many there were."""
    critic = _critic(tiny_dir)
    teacher, other = [5, 6, 7, 8], [5, 6, 9]
    with torch.no_grad():
        scores = critic.model(*discriminator.right_pad([teacher, other, [5, 6, 10, 11]], 0, "cpu")).tolist()
    groups = [(2, teacher, [teacher, other]), (2, [5, 6, 10, 11], [[5, 6, 10, 11], [5, 6, 10, 11]])]
    metrics = critic.train_step(groups, 0, ONE_PROCESS, 8).metrics
    assert metrics["gad/identical_frac"] == 0.75
    assert metrics["gad/d_acc"] == float(scores[0] > scores[1])  # the one pair that differs
    assert "gad/d_acc" not in critic.train_step([groups[1]], 0, ONE_PROCESS, 8).metrics  # no pair to order


def test_rewards_come_from_the_discriminator_before_its_update(tiny_dir, tokenizer):
    cfg = gad_config("--rollout.n=3")
    rollouts = _gad_rollouts(tokenizer, cfg)
    critic = _critic(tiny_dir, lr=1e-2)
    seqs = [r.prompt_ids + r.response_ids for r in rollouts]
    pre = critic.score(seqs, tokenizer.pad_token_id, "cpu")
    gad_rewards(rollouts, Models(_policy(tiny_dir), discriminator=critic), cfg, tokenizer.pad_token_id, ONE_PROCESS)
    post = critic.score(seqs, tokenizer.pad_token_id, "cpu")
    got = torch.tensor([r.fields.discriminator_score for r in rollouts])
    torch.testing.assert_close(got, pre, rtol=1e-5, atol=1e-5)
    assert (got - post).abs().max() > 1e-2  # the update moved the scores: the order is observable
    # GRPO advantages (std-normalised by default for GAD) of the pre-update scores, students only
    students = [r for r in rollouts if r.generated]
    expected = losses.grpo_advantages(torch.tensor([r.fields.discriminator_score for r in students], dtype=torch.float64),
                                      [r.row["uid"] for r in students], norm_by_std=True)
    assert [r.fields.advantage for r in students] == pytest.approx(expected.tolist(), abs=1e-9)


def test_several_discriminator_steps_a_batch_are_that_many_steps_rewarded_with_the_first_scores(tiny_dir,
                                                                                                tokenizer):
    """--gad.disc_steps 3 trains as three one-step batches on the same rollouts would, while its
    rewards and metrics are the first step's (held out) and the stages still count batches."""
    pad = tokenizer.pad_token_id
    rollouts = _gad_rollouts(tokenizer, gad_config("--rollout.n=3"))
    repeated, single = _critic(tiny_dir, lr=1e-2), _critic(tiny_dir, lr=1e-2)
    pre = repeated.score([r.prompt_ids + r.response_ids for r in rollouts], pad, "cpu")
    batch = copy.deepcopy(rollouts)
    got = gad_rewards(batch, Models(_policy(tiny_dir), discriminator=repeated),
                      gad_config("--rollout.n=3", "--gad.disc_steps=3"), pad, ONE_PROCESS)
    assert repeated.steps == 1
    torch.testing.assert_close(torch.tensor([r.fields.discriminator_score for r in batch]), pre, rtol=1e-5, atol=1e-5)
    firsts = [gad_rewards(copy.deepcopy(rollouts), Models(_policy(tiny_dir), discriminator=single),
                          gad_config("--rollout.n=3"), pad, ONE_PROCESS) for _ in range(3)]
    assert got["gad/d_loss"] == pytest.approx(firsts[0]["gad/d_loss"], rel=1e-5)
    # the later steps moved the scores: one step alone would not match three
    assert abs(firsts[2]["gad/d_loss"] - firsts[0]["gad/d_loss"]) > 1e-3
    for (name, p), q in zip(repeated.model.named_parameters(), single.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_the_teacher_text_ends_with_the_engines_eos_so_identical_texts_score_identically(tiny_dir, tokenizer):
    cfg = gad_config("--rollout.n=2")
    rollouts = _rollouts(tokenizer, "grpo", n_prompts=1, n=2)
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")  # an engine whose stop token is not the tokenizer's EOS
    row = {**rollouts[0].row, "teacher_response": "Program: reverse"}
    for r in rollouts:
        r.row = row
    rollouts[0].response_ids = tokenizer(row["teacher_response"], add_special_tokens=False)["input_ids"] + [end]
    rollouts[1].response_ids = rollouts[1].response_ids[:-1] + [end]
    prepare_teacher_responses(rollouts, tokenizer, cfg)
    teacher = rollouts[-1]
    assert not teacher.generated and teacher.response_ids == rollouts[0].response_ids
    gad_rewards(rollouts, Models(_policy(tiny_dir), discriminator=_critic(tiny_dir)), cfg, tokenizer.pad_token_id,
                ONE_PROCESS)
    assert teacher.fields.discriminator_score == pytest.approx(rollouts[0].fields.discriminator_score, abs=1e-6)


# ----------------------------------------------------------------------------------------
# stages and the policy loss


def _trainer(tiny_dir, cfg, seed=3):
    policy = _policy(tiny_dir, seed=seed)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    models = Models(policy, reference=Reference(_policy(tiny_dir)), discriminator=_critic(tiny_dir))
    return run.Trainer(models, optimizer, NoSchedule())


@pytest.mark.parametrize("warmup,critic_warmup", [(0, 2), (1, 1)])
def test_stages_train_the_policy_on_the_teachers_text_then_not_at_all_then_on_its_samples(tiny_dir, tokenizer, warmup,
                                                                                          critic_warmup):
    cfg = gad_config("--rollout.n=3", f"--gad.warmup_steps={warmup}", f"--gad.critic_warmup={critic_warmup}")
    trainer = _trainer(tiny_dir, cfg)
    policy, critic = trainer.models.policy, trainer.models.discriminator
    for step in range(warmup + critic_warmup + 1):
        weights = [p.detach().clone() for p in policy.parameters()]
        head = critic.model.head.weight.detach().clone()
        rollouts = _gad_rollouts(tokenizer, cfg, seed=step)
        metrics, stepped = run.update_policy(cfg, GAD, trainer, rollouts, step, tokenizer.pad_token_id, ONE_PROCESS)
        moved = any(not torch.equal(a, b) for a, b in zip(weights, policy.parameters()))
        assert not torch.equal(head, critic.model.head.weight), step  # the discriminator trains in every stage
        stage = "warmup" if step < warmup else "critic" if step < warmup + critic_warmup else "gad"
        assert metrics["gad/stage"] == ("warmup", "critic", "gad").index(stage)
        assert moved == stepped == (stage != "critic"), step
        trained = [r for r in rollouts if r.fields.trains_policy]
        assert trained == [r for r in rollouts if (not r.generated if stage == "warmup" else r.generated)
                           and stage != "critic"]
        assert ("actor/kl" in metrics) == (stage == "gad")


def _kl_grads(tiny_dir, tokenizer, kind, coef=1.0):
    cfg = gad_config("--rollout.n=3", f"--algo.kl_type={kind}", f"--algo.kl_coef={coef}")
    policy = _policy(tiny_dir, seed=3)
    rollouts = [r for r in _gad_rollouts(tokenizer, cfg) if r.generated]
    g = torch.Generator().manual_seed(0)
    for r in rollouts:
        r.fields.advantage = 0.0  # the clipped surrogate contributes no gradient: only the KL term is left
        r.fields.reference_logprobs = (torch.tensor(r.rollout_logprobs) + torch.randn(len(r.response_ids), generator=g)).tolist()
    counts = step_counts(rollouts, GAD)
    mb = microbatch.micro_batch(None, rollouts, counts, tokenizer.pad_token_id, "cpu", None, 1)
    loss, stats = gad_loss(mb, Models(policy), cfg)
    loss.backward()
    return [p.grad.clone() for p in policy.parameters()], stats["actor/kl"], loss.item()


def test_kl_loss_gradient_is_k2s_under_the_straight_through_form_and_its_value_the_named_one(tiny_dir, tokenizer):
    k3_plus, kl_k3_plus, loss_k3_plus = _kl_grads(tiny_dir, tokenizer, "k3+")
    k2, _, _ = _kl_grads(tiny_dir, tokenizer, "k2")
    k3, kl_k3, loss_k3 = _kl_grads(tiny_dir, tokenizer, "k3")
    for a, b in zip(k3_plus, k2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    assert any((a - b).abs().max() > 1e-6 for a, b in zip(k3, k2))
    assert kl_k3_plus == pytest.approx(kl_k3) and loss_k3_plus == pytest.approx(loss_k3, rel=1e-6)
    assert loss_k3 == pytest.approx(kl_k3[0] / kl_k3[1], rel=1e-5)  # token-mean of the k3 values, coefficient 1


def test_kl_in_the_reward_instead_of_the_loss(tiny_dir, tokenizer):
    cfg = gad_config("--rollout.n=3", "--algo.kl_in_reward=True", "--algo.kl_coef=0.5")
    trainer = _trainer(tiny_dir, cfg)
    rollouts = _gad_rollouts(tokenizer, cfg)
    metrics = gad_rewards(rollouts, trainer.models, cfg, tokenizer.pad_token_id, ONE_PROCESS)
    students = [r for r in rollouts if r.generated]
    kl = [losses.kl_estimate(torch.tensor(r.rollout_logprobs), torch.tensor(r.fields.reference_logprobs)).sum().item()
          for r in students]
    rewards = torch.tensor([r.fields.discriminator_score - 0.5 * k for r, k in zip(students, kl)], dtype=torch.float64)
    expected = losses.grpo_advantages(rewards, [r.row["uid"] for r in students])
    assert [r.fields.advantage for r in students] == pytest.approx(expected.tolist(), abs=1e-6)
    assert metrics["gad/reward_kl"] == pytest.approx(sum(kl) / len(kl), rel=1e-5)
    mb = microbatch.micro_batch(None, students, step_counts(students, GAD), tokenizer.pad_token_id, "cpu", None, 1)
    with_kl = gad_loss(mb, trainer.models, cfg)[0]
    without = gad_loss(mb, trainer.models, gad_config("--rollout.n=3", "--algo.kl_coef=0"))[0]
    assert with_kl.item() == pytest.approx(without.item(), rel=1e-6)  # the loss has no KL term


# ----------------------------------------------------------------------------------------
# checkpoints, data, ranks


def test_checkpoint_restores_both_networks_and_both_optimizers(tiny_dir, tokenizer, tmp_path):
    cfg = gad_config("--rollout.n=3")
    saved = _trainer(tiny_dir, cfg, seed=1)
    run.update_policy(cfg, GAD, saved, _gad_rollouts(tokenizer, cfg), 0, tokenizer.pad_token_id, ONE_PROCESS)
    run.save_checkpoint(str(tmp_path / "ckpt"), saved, 1, None, ONE_PROCESS)
    restored = _trainer(tiny_dir, cfg, seed=9)
    restored.models.discriminator = Critic(discriminator.load(tiny_dir, 5, 1, torch.device("cpu")), 1e-3, 0.0, 1e9)
    assert run.load_checkpoint(str(tmp_path / "ckpt"), restored, cfg, ONE_PROCESS) == (1, None, None)
    a, b = saved.models, restored.models
    for x, y in [(a.policy, b.policy), (a.discriminator.model, b.discriminator.model)]:
        for p, q in zip(x.parameters(), y.parameters()):
            assert torch.equal(p, q)
    assert b.discriminator.steps == 1
    for x, y in [(saved.optimizer, restored.optimizer), (a.discriminator.optimizer, b.discriminator.optimizer)]:
        states = [(x.state[p], y.state[q]) for p, q in zip(x.param_groups[0]["params"], y.param_groups[0]["params"])]
        assert states and all(torch.equal(s["exp_avg_sq"], t["exp_avg_sq"]) for s, t in states)


def test_a_row_without_teacher_response_is_refused_naming_file_row_and_field(tmp_path):
    path = tmp_path / "distill.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"prompt": "1+1?", "answer": "2", "teacher_response": "Answer: 2"}) + "\n")
        f.write(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    cfg = run.parse_config(["--algo=gad", f"--data.task={path}", "--data.reward=math", f"--data.eval_path={path}"])
    with pytest.raises(data.DataError, match=rf"{path}, row 2, field 'teacher_response'"):
        run.load_data(cfg)
    run.load_data(run.parse_config(["--algo=grpo", f"--data.task={path}", "--data.reward=math",
                                    f"--data.eval_path={path}"]))  # others: fine


def _teacher_file(tmp_path, n=40):
    """Rows of the strops task with their reference as the teacher's response."""
    path = tmp_path / "teacher.jsonl"
    with open(path, "w") as f:
        for row in data.task_rows("strops", "train", n):
            f.write(json.dumps({"uid": row["uid"], "prompt": row["messages"], "tests": row["tests"],
                                "teacher_response": row["reference"]}) + "\n")
    return str(path)


@pytest.mark.slow
def test_two_rank_gad_run_with_both_stages(tmp_path):
    """Both stages under two ranks, with the figures of the same run on one rank (the batches'
    to the bit but the rewards, which are the discriminator's scores: to float rounding)."""
    out, alone = str(tmp_path / "gad"), str(tmp_path / "alone")
    path = _teacher_file(tmp_path)
    flags = SMALL + ["--algo=gad", f"--data.task={path}", f"--data.eval_path={path}", "--data.reward=strops",
                     "--gad.warmup_steps=1", "--gad.critic_warmup=1", "--train.mini_batches=2",
                     "--train.micro_batch=3", "--train.steps=3", "--train.eval_every=3"]
    _run(flags + [f"--log.out_dir={out}"], nproc=2, timeout=900)
    _run(flags + [f"--log.out_dir={alone}"], timeout=900)
    check_agrees_with_one_rank(_metrics(out), _metrics(alone), 3, [k for k in OF_THE_BATCH if k != "reward/"])
    steps = [r for r in _metrics(out) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3] and [r["gad/stage"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert r["sync/probe_max_abs_diff"] < 1e-3
        for key in ("gad/d_loss", "gad/d_acc", "gad/teacher_score", "gad/student_score", "reward/mean"):
            assert key in r, key
    assert steps[1]["actor/skipped_steps"] == 2  # the critic warmup leaves the policy alone
    assert "actor/kl" in steps[2] and "actor/pg_clipfrac" in steps[2] and "eval/success_rate" in steps[2]
    # resuming both networks and both optimizers is test_checkpoint_restores_both_networks_and_both_optimizers


def test_the_self_made_teacher_trains_past_the_students_early_stop():
    """A task recipe's warm_start_target stops the *student's* warm start (the quiz's at 30%
    held-out success); the teacher takes --gad.teacher_steps on plain prompts, no stop, no contexts."""
    cfg = parse_config(["--data.task=quiz", "--algo=gad", "--gad.teacher_steps=700"])
    assert cfg.train.warm_start_target == 0.3 and cfg.train.warm_start_context_steps == 300
    teacher = warm_start.gad_teacher_config(cfg).train
    assert (teacher.warm_start_steps, teacher.warm_start_target, teacher.warm_start_context_steps) == (700, 0.0, 0)
    assert teacher.warm_start_demo_frac == teacher.warm_start_feedback_frac == 0.0


@pytest.mark.parametrize("flag, got", [
    ("--gad.lr=0", "--gad.lr=0.0: must be > 0"), ("--gad.grad_clip=-1", "--gad.grad_clip=-1.0: must be > 0"),
    ("--gad.disc_steps=0", "--gad.disc_steps=0: must be at least 1"),
    ("--gad.warmup_steps=-1", "--gad.warmup_steps=-1: must be at least 0"),
    ("--gad.critic_warmup=-2", "--gad.critic_warmup=-2: must be at least 0"),
])
def test_gad_flags_out_of_range_are_refused_naming_them(flag, got, capsys):
    from test_dpo import _refused
    assert got in _refused(["--algo=gad", flag], capsys)
    run.parse_config(["--algo=gad", "--gad.disc_steps=1", "--gad.warmup_steps=0", "--gad.critic_warmup=0"])


def _fake_teacher(monkeypatch, tokenizer, references) -> list:
    """warm_start's teacher engine replaced by one that answers prompt i: cut off, empty, or
    references[i], in turn; returns the list its calls are recorded in."""
    import warm_start
    from rollout import Sample
    calls = []

    class TeacherEngine:
        def generate(self, prompts, n, temperature, max_tokens, seed, images=None):
            calls.append((len(prompts), n, temperature))
            out = []
            for i, p in enumerate(prompts):
                text = ["Program: rev", "", references[i]][i % 3]
                ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([] if i % 3 == 0 else [tokenizer.eos_token_id])
                out.append([Sample(p, ids, [-1.0] * len(ids), text, i % 3 == 0) for _ in range(n)])
            return out

        def close(self):
            calls.append("closed")
    monkeypatch.setattr(warm_start, "start_engine", lambda *args: TeacherEngine())
    monkeypatch.setattr(warm_start, "load_tokenizer", lambda path: tokenizer)
    return calls


def test_the_teacher_data_file_keeps_the_task_rows_own_fields_for_the_reward(tokenizer, tmp_path, monkeypatch):
    """A task row's own fields (the manners a manners row accepts) become the teacher-data file's
    columns, and the reward reads them there: with --data.manners=eq, an answer in the 'is'
    manner scores 0 on the file's rows as on the task's."""
    import warm_start
    from feedback import reward_function
    from tasks.manners import write_line
    cfg = run.parse_config(["--algo=gad", "--data.task=manners", "--data.manners=eq", "--data.train_rows=6",
                            "--data.eval_rows=2"])
    train_rows, _ = data.read_rows(cfg)
    _fake_teacher(monkeypatch, tokenizer, [row["reference"] for row in train_rows])
    got = warm_start.teacher_data(cfg, warm_start.gad_teacher_config(cfg), str(tmp_path / "t" / "final"), ONE_PROCESS)
    rows, held_out = run.load_data(got)
    assert rows and all(row["columns"]["manners"] == ["eq"] for row in rows + held_out)
    for row in rows:
        score = reward_function(got, row)
        questions = [re.fullmatch(r"(\w):(\d+)(\D)(\d+)", t["input"]).groups() + (t["output"],) for t in row["tests"]]
        assert score("\n".join(write_line("eq", *q) for q in questions), row, False).score == 1.0
        assert score("\n".join(write_line("is", *q) for q in questions), row, False).score == 0.0


def test_the_self_made_teacher_writes_its_finished_answers_as_the_runs_data(tiny_dir, tokenizer, tmp_path,
                                                                            monkeypatch, capsys):
    """On a synthetic task GAD's black-box teacher is made here (warm_start.teacher_data): it answers
    each training prompt once at --gad.teacher_temperature; its finished, non-empty answers become
    train.jsonl's teacher_response, the held-out rows heldout.jsonl, and the run reads those files."""
    import warm_start
    cfg = run.parse_config(["--algo=gad", "--data.task=strops", "--data.train_rows=9", "--data.eval_rows=4",
                            "--gad.teacher_temperature=0.7"])
    train_rows, eval_rows = data.read_rows(cfg)
    references = [row["reference"] for row in train_rows]
    calls = _fake_teacher(monkeypatch, tokenizer, references)
    teacher_dir = str(tmp_path / "teacher" / "final")
    got = warm_start.teacher_data(cfg, warm_start.gad_teacher_config(cfg), teacher_dir, ONE_PROCESS)
    assert calls == [(len(train_rows), 1, 0.7), "closed"]
    assert os.path.dirname(got.data.task) == os.path.dirname(got.data.eval_path)
    assert os.path.dirname(got.data.task).startswith(str(tmp_path / "teacher") + "-data-")
    with open(got.data.task) as f:
        written = [json.loads(line) for line in f]
    assert [w["uid"] for w in written] == [row["uid"] for row in train_rows[2::3]]  # the finished, non-empty ones
    assert [w["teacher_response"] for w in written] == references[2::3]
    assert all(w["prompt"] == row["messages"] and w["tests"] == row["tests"] for w, row in zip(written, train_rows[2::3]))
    with open(got.data.eval_path) as f:
        assert [json.loads(line)["uid"] for line in f] == [row["uid"] for row in eval_rows]
    assert f"teacher data: {len(written)} of {len(train_rows)} answers finished and not empty, success 1.000" \
        in capsys.readouterr().out
    rows, held_out = run.load_data(got)  # the run reads the teacher's text
    assert [row["teacher_response"] for row in rows] == references[2::3]
    assert len(held_out) == len(eval_rows) and got.data.reward == "strops"
    # cached: a second run with the same recipe asks no engine
    assert warm_start.teacher_data(cfg, warm_start.gad_teacher_config(cfg), teacher_dir, ONE_PROCESS) == got
    assert len(calls) == 2

"""
Tests for losses.py. Each function is checked against something computed another way:
an explicit Python loop over floats, a hand-worked number, or a closed form.
Run: python -m pytest tests/test_losses.py
"""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import chunked_head
import losses

FAST = settings(max_examples=40, deadline=None)


@pytest.fixture(autouse=True, scope="module")
def float64_by_default():
    # exact comparisons need float64; restored so other test modules are unaffected
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def rand_logprobs(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(2.0 * torch.randn(*shape, generator=g), dim=-1)


def loop_kl(p_logs, q_logs):
    """KL(P||Q) for one row of log-probs, as Python floats."""
    return sum(math.exp(lp) * (lp - lq) for lp, lq in zip(p_logs, q_logs) if lp > -math.inf)


# -----------------------------------------------------------------------------
# log-probs and entropy


def test_token_logprobs_match_loop():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 6, generator=g)
    ids = torch.randint(0, 6, (2, 3), generator=g)
    for temperature in (1.0, 0.6):
        got = losses.token_logprobs(logits, ids, temperature=temperature)
        for b in range(2):
            for t in range(3):
                row = [x / temperature for x in logits[b, t].tolist()]
                expected = row[ids[b, t]] - math.log(sum(math.exp(x) for x in row))
                assert got[b, t].item() == pytest.approx(expected, abs=1e-12)


def test_entropy_matches_loop_and_handles_masked_vocab():
    logits = torch.tensor([[0.3, -1.2, 2.0, 0.0], [1.0, -math.inf, 0.5, -math.inf]], requires_grad=True)
    for temperature in (1.0, 2.0):
        got = losses.entropy_from_logits(logits, temperature=temperature)
        for row, value in zip(logits.tolist(), got.tolist()):
            z = [x / temperature for x in row]
            total = sum(math.exp(x) for x in z)
            expected = -sum(math.exp(x) / total * math.log(math.exp(x) / total) for x in z if x > -math.inf)
            assert value == pytest.approx(expected, abs=1e-12)
    got.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert losses.entropy_from_logits(torch.zeros(1, 8)).item() == pytest.approx(math.log(8))


# -----------------------------------------------------------------------------
# divergences


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_forward_and_reverse_kl_match_loop(alpha):
    student, teacher = rand_logprobs(2, 3, 7, seed=2), rand_logprobs(2, 3, 7, seed=3)
    got = losses.sdpo_divergence(student, teacher, alpha)
    assert got.shape == (2, 3)
    for b in range(2):
        for t in range(3):
            s, q = student[b, t].tolist(), teacher[b, t].tolist()
            expected = loop_kl(q, s) if alpha == 0.0 else loop_kl(s, q)
            assert got[b, t].item() == pytest.approx(expected, rel=1e-12)


def test_jsd_half_equals_textbook_jsd():
    student, teacher = rand_logprobs(4, 9, seed=4), rand_logprobs(4, 9, seed=5)
    got = losses.sdpo_divergence(student, teacher, 0.5)
    for row in range(4):
        p, q = student[row].exp().tolist(), teacher[row].exp().tolist()
        m = [(a + b) / 2 for a, b in zip(p, q)]
        kl_pm = sum(a * math.log(a / c) for a, c in zip(p, m))
        kl_qm = sum(b * math.log(b / c) for b, c in zip(q, m))
        jsd = 0.5 * kl_pm + 0.5 * kl_qm
        assert got[row].item() == pytest.approx(jsd, rel=1e-12)


def test_generalized_jsd_matches_probability_space_loop():
    alpha = 0.3
    student, teacher = rand_logprobs(3, 5, seed=6), rand_logprobs(3, 5, seed=7)
    got = losses.sdpo_divergence(student, teacher, alpha)
    for row in range(3):
        p, q = student[row].exp().tolist(), teacher[row].exp().tolist()
        m = [(1 - alpha) * a + alpha * b for a, b in zip(p, q)]
        expected = (1 - alpha) * sum(a * math.log(a / c) for a, c in zip(p, m)) + alpha * sum(
            b * math.log(b / c) for b, c in zip(q, m)
        )
        assert got[row].item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_divergence_of_identical_distributions_is_zero_with_zero_grad(alpha):
    raw = rand_logprobs(2, 4, 11, seed=8).requires_grad_(True)
    student = torch.log_softmax(raw, -1)
    value = losses.sdpo_divergence(student, student.detach().clone(), alpha)
    assert value.abs().max().item() < 1e-14
    value.sum().backward()  # a minimum: zero gradient w.r.t. the logits
    assert raw.grad.abs().max().item() < 1e-12


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_teacher_gets_no_gradient(alpha):
    student = rand_logprobs(3, 6, seed=9).requires_grad_(True)
    teacher = rand_logprobs(3, 6, seed=10).requires_grad_(True)
    losses.sdpo_divergence(student, teacher, alpha).sum().backward()
    assert teacher.grad is None
    assert student.grad.abs().sum() > 0


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_divergence_gradcheck(alpha):
    raw = torch.randn(3, 6, generator=torch.Generator().manual_seed(11), requires_grad=True)
    teacher = rand_logprobs(3, 6, seed=12)
    assert torch.autograd.gradcheck(lambda x: losses.sdpo_divergence(torch.log_softmax(x, -1), teacher, alpha), (raw,))


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_zero_probability_entries_give_finite_values_and_grads(alpha):
    # both sides put zero mass on the last id (e.g. a masked vocab entry)
    student = torch.log_softmax(torch.tensor([[0.2, 1.0, -0.5, -math.inf]]), -1).requires_grad_(True)
    teacher = torch.log_softmax(torch.tensor([[1.2, 0.1, 0.4, -math.inf]]), -1)
    value = losses.sdpo_divergence(student, teacher, alpha)
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(student.grad).all()
    reference = losses.sdpo_divergence(student[:, :3].detach(), teacher[:, :3], alpha)
    assert value.item() == pytest.approx(reference.item(), rel=1e-12)


@FAST
@given(
    alpha=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]),
    seed=st.integers(0, 10_000),
    scale=st.floats(0.1, 8.0),
)
def test_divergence_nonnegative_and_jsd_bounded(alpha, seed, scale):
    g = torch.Generator().manual_seed(seed)
    student = torch.log_softmax(scale * torch.randn(4, 10, generator=g), -1)
    teacher = torch.log_softmax(scale * torch.randn(4, 10, generator=g), -1)
    value = losses.sdpo_divergence(student, teacher, alpha)
    assert (value >= -1e-12).all()
    if 0.0 < alpha < 1.0:  # a generalized JSD is at most the entropy of its weights
        assert (value <= -(1 - alpha) * math.log(1 - alpha) - alpha * math.log(alpha) + 1e-12).all()


# -----------------------------------------------------------------------------
# top-K support


def test_topk_with_tail_matches_loop():
    g = torch.Generator().manual_seed(13)
    student_logits, teacher_logits = torch.randn(2, 3, 10, generator=g), torch.randn(2, 3, 10, generator=g)
    k, temperature = 3, 0.8
    for add_tail in (True, False):
        s_sup, t_sup, ids = losses.topk_with_tail(student_logits, teacher_logits, k, add_tail, temperature=temperature)
        assert s_sup.shape == t_sup.shape == (2, 3, k + add_tail) and ids.shape == (2, 3, k)
        for b in range(2):
            for t in range(3):
                s = [x / temperature for x in student_logits[b, t].tolist()]
                q = [x / temperature for x in teacher_logits[b, t].tolist()]
                top = sorted(range(10), key=lambda v: -s[v])[:k]
                assert sorted(ids[b, t].tolist()) == sorted(top)
                order = ids[b, t].tolist()  # compare entry by entry in the returned order
                for values, support in ((s, s_sup[b, t]), (q, t_sup[b, t])):
                    total = sum(math.exp(x) for x in values)
                    probs = [math.exp(values[v]) / total for v in order]
                    if add_tail:
                        expected = [math.log(p) for p in probs] + [math.log(1 - sum(probs))]
                    else:
                        expected = [math.log(p / sum(probs)) for p in probs]
                    assert support.tolist() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_topk_full_vocab_without_tail_equals_full_logit(alpha):
    g = torch.Generator().manual_seed(14)
    student_logits = torch.randn(3, 4, 12, generator=g, requires_grad=True)
    teacher_logits = torch.randn(3, 4, 12, generator=g)
    s_sup, t_sup, _ = losses.topk_with_tail(student_logits, teacher_logits, 12, add_tail=False)
    topk_value = losses.sdpo_divergence(s_sup, t_sup, alpha)
    (topk_grad,) = torch.autograd.grad(topk_value.sum(), student_logits)
    full_value = losses.sdpo_divergence(
        torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1), alpha
    )
    (full_grad,) = torch.autograd.grad(full_value.sum(), student_logits)
    torch.testing.assert_close(topk_value, full_value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(topk_grad, full_grad, rtol=1e-10, atol=1e-12)


def test_tail_bucket_makes_each_row_sum_to_one():
    g = torch.Generator().manual_seed(15)
    for k in (1, 5, 31):
        s_sup, t_sup, _ = losses.topk_with_tail(3 * torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g), k)
        torch.testing.assert_close(s_sup.exp().sum(-1), torch.ones(4), rtol=0, atol=1e-12)
        torch.testing.assert_close(t_sup.exp().sum(-1), torch.ones(4), rtol=0, atol=1e-12)


def test_tail_stays_finite_when_topk_holds_all_mass():
    student_logits = torch.tensor([[0.0, 1.0, 2.0]], requires_grad=True)
    s_sup, _, _ = losses.topk_with_tail(student_logits, torch.zeros(1, 3), 3, add_tail=True)
    assert s_sup[0, -1].item() == pytest.approx(math.log(1e-7), rel=1e-6)
    losses.sdpo_divergence(s_sup, torch.log_softmax(torch.tensor([[0.0, 0.0, 0.0, -30.0]]), -1), 0.5).sum().backward()
    assert torch.isfinite(student_logits.grad).all()


def test_topk_gradient_paths():
    g = torch.Generator().manual_seed(16)
    student_logits = torch.randn(2, 9, generator=g, requires_grad=True)
    teacher_logits = torch.randn(2, 9, generator=g, requires_grad=True)
    for add_tail in (True, False):
        s_sup, t_sup, ids = losses.topk_with_tail(student_logits, teacher_logits, 3, add_tail)
        (grad,) = torch.autograd.grad(losses.sdpo_divergence(s_sup, t_sup, 1.0).sum(), student_logits)
        outside = torch.ones_like(grad, dtype=torch.bool).scatter_(-1, ids, False)
        if add_tail:  # the full logsumexp reaches every logit
            assert (grad[outside].abs() > 1e-4).all()
        else:  # renormalising over the K ids cancels the full logsumexp (up to rounding)
            assert grad[outside].abs().max().item() < 1e-15
    assert not t_sup.requires_grad


def test_topk_temperature_applies_to_both_sides():
    g = torch.Generator().manual_seed(17)
    student_logits, teacher_logits = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    hot = losses.topk_with_tail(student_logits, teacher_logits, 4, temperature=2.0)
    pre_divided = losses.topk_with_tail(student_logits / 2.0, teacher_logits / 2.0, 4)
    for a, b in zip(hot, pre_divided):
        torch.testing.assert_close(a, b)
    assert not torch.allclose(hot[1], losses.topk_with_tail(student_logits / 2.0, teacher_logits, 4)[1])


def test_sdpo_token_loss_value_and_gradient():
    student = torch.tensor([[-0.5, -2.0, -0.1]], requires_grad=True)
    teacher = torch.tensor([[-1.0, -0.5, -0.1]], requires_grad=True)
    value = losses.sdpo_token_loss(student, teacher)
    torch.testing.assert_close(value, torch.tensor([[-0.25, 3.0, 0.0]]), rtol=0, atol=1e-15)
    value.sum().backward()
    torch.testing.assert_close(student.grad, torch.tensor([[0.5, -1.5, 0.0]]), rtol=0, atol=1e-15)
    assert teacher.grad is None


# -----------------------------------------------------------------------------
# importance weights and advantages


def test_token_importance_weights_match_loop_capped_and_detached():
    logprobs = torch.tensor([[-1.0, -0.2, -5.0, 0.0], [-3.0, -0.1, -0.3, -40.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -0.2, -1.0, -30.0], [-2.0, -0.4, -0.3, -0.1]])
    weights = losses.importance_weights(logprobs, old, cap=2.0, level="token")
    assert not weights.requires_grad
    for w, lp, o in zip(weights.flatten().tolist(), logprobs.flatten().tolist(), old.flatten().tolist()):
        assert w == pytest.approx(min(math.exp(max(-20.0, min(20.0, lp - o))), 2.0), rel=1e-12)
    assert weights.max().item() == 2.0  # the 30-nat gap is capped
    assert weights[1, 3].item() == pytest.approx(math.exp(-20.0))  # the -39.9 gap is clamped at -20


def test_sequence_importance_weights_use_masked_mean_and_broadcast():
    logprobs = torch.tensor([[-1.0, -0.5, -9.0], [-0.2, -0.4, -0.6], [-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.2, -0.9, 0.0], [-0.1, -0.2, -0.3], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    weights = losses.importance_weights(logprobs, old, cap=10.0, level="sequence", mask=mask)
    expected_rows = [math.exp((0.2 + 0.4) / 2), math.exp((-0.1 - 0.2 - 0.3) / 3), 1.0]  # empty mask -> 1
    for row, expected in enumerate(expected_rows):
        assert weights[row].tolist() == pytest.approx([expected] * 3, rel=1e-12)
    assert losses.importance_weights(logprobs, old, cap=1.1, level="sequence", mask=mask).max().item() <= 1.1
    with pytest.raises(ValueError):
        losses.importance_weights(logprobs, old, cap=2.0, level="sequence")


@FAST
@given(seed=st.integers(0, 10_000), cap=st.floats(1.0, 5.0), level=st.sampled_from(["token", "sequence"]))
def test_importance_weights_never_exceed_cap(seed, cap, level):
    g = torch.Generator().manual_seed(seed)
    logprobs = (30 * torch.randn(3, 5, generator=g)).requires_grad_(True)
    old = 30 * torch.randn(3, 5, generator=g)
    mask = torch.randint(0, 2, (3, 5), generator=g)
    weights = losses.importance_weights(logprobs, old, cap=cap, level=level, mask=mask)
    assert (weights <= cap).all() and (weights > 0).all() and not weights.requires_grad


def loop_grpo(rewards, groups, norm_by_std):
    out = []
    for r, gid in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == gid]
        mean = sum(members) / len(members)
        if not norm_by_std:
            out.append(r - mean)
        elif len(members) == 1:
            out.append(0.0)
        else:
            out.append((r - mean) / (statistics.stdev(members) + 1e-6))
    return out


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_advantages_match_loop_and_sum_to_zero_per_group(norm_by_std):
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.2, 0.2, 3.0, -1.0, 0.0, 0.7]
    groups = ["a", "a", "a", "a", "b", "c", "c", "c", "d", "d", "d", "d"]  # b is a singleton, c is constant
    got = losses.grpo_advantages(torch.tensor(rewards), groups, norm_by_std=norm_by_std)
    assert torch.isfinite(got).all()
    assert got.tolist() == pytest.approx(loop_grpo(rewards, groups, norm_by_std), abs=1e-12)
    for gid in set(groups):
        assert sum(a for a, h in zip(got.tolist(), groups) if h == gid) == pytest.approx(0.0, abs=1e-9)
    assert got[4].item() == 0.0  # singleton
    assert got[5:8].abs().max().item() < 1e-9  # constant group: (r - mean) is rounding noise


def test_grpo_advantages_use_unbiased_std():
    got = losses.grpo_advantages(torch.tensor([0.0, 1.0]), torch.tensor([7, 7]))
    # mean 0.5, unbiased std sqrt(0.5): +-0.5 / 0.7071
    assert got.tolist() == pytest.approx([-0.5 / (math.sqrt(0.5) + 1e-6), 0.5 / (math.sqrt(0.5) + 1e-6)], rel=1e-12)


@FAST
@given(rewards=st.lists(st.floats(-5, 5), min_size=1, max_size=12), seed=st.integers(0, 1000))
def test_grpo_advantages_property(rewards, seed):
    groups = torch.randint(0, 3, (len(rewards),), generator=torch.Generator().manual_seed(seed))
    got = losses.grpo_advantages(torch.tensor(rewards), groups)
    assert torch.isfinite(got).all()
    assert got.tolist() == pytest.approx(loop_grpo(rewards, groups.tolist(), True), rel=1e-6, abs=1e-6)


def test_hybrid_advantages_hand_worked():
    grpo = torch.tensor([1.0, -2.0])
    teacher = torch.tensor([[-0.1, -2.0], [-1.0, -1.0]])
    student = torch.tensor([[-0.5, -1.0], [-0.2, -3.0]], requires_grad=True)
    got = losses.hybrid_advantages(grpo, teacher, student, lam=0.9)
    expected = [[0.9 + 0.1 * 0.4, 0.9 + 0.1 * -1.0], [-1.8 + 0.1 * -0.8, -1.8 + 0.1 * 2.0]]
    assert got.tolist()[0] == pytest.approx(expected[0]) and got.tolist()[1] == pytest.approx(expected[1])
    assert not got.requires_grad
    torch.testing.assert_close(losses.hybrid_advantages(grpo, teacher, student, lam=1.0), grpo[:, None].expand(2, 2))


# -----------------------------------------------------------------------------
# policy-gradient surrogates


def test_ppo_clip_values_match_loop():
    logprobs = torch.tensor([[-1.0, -0.5, -2.0, -0.1]])
    old = torch.tensor([[-1.5, -0.5, -1.0, -0.2]])
    advantages = torch.tensor([[1.0, -1.0, -2.0, 0.5]])
    got, clipped = losses.ppo_clip_loss(logprobs, old, advantages, eps_low=0.2, eps_high=0.28)
    for i in range(4):
        ratio = math.exp(logprobs[0, i].item() - old[0, i].item())
        a = advantages[0, i].item()
        expected = max(-a * ratio, -a * min(max(ratio, 0.8), 1.28))
        assert got[0, i].item() == pytest.approx(expected, rel=1e-12)
    assert clipped.tolist() == [[True, False, True, False]]


def test_ppo_clip_gradient_is_zero_exactly_where_clipped():
    # ratios 1.5 / 0.5 / 0.5 / 1.5 with advantages + / - / + / -
    logprobs = torch.log(torch.tensor([1.5, 0.5, 0.5, 1.5])).requires_grad_(True)
    old = torch.zeros(4)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    value, clipped = losses.ppo_clip_loss(logprobs, old, advantages, eps_low=0.2, eps_high=0.2)
    value.sum().backward()
    assert logprobs.grad[:2].tolist() == [0.0, 0.0]  # pushing further past the clip is not rewarded
    assert logprobs.grad[2:].tolist() == pytest.approx([-0.5, 1.5])  # d(-A r)/dlogp = -A r: still pulled back
    assert clipped.tolist() == [True, True, False, False]


def test_ppo_clip_broadcasts_sequence_advantages():
    logprobs, old = rand_logprobs(2, 3, seed=18), rand_logprobs(2, 3, seed=19)
    advantages = torch.tensor([0.7, -1.2])
    a, _ = losses.ppo_clip_loss(logprobs, old, advantages)
    b, _ = losses.ppo_clip_loss(logprobs, old, advantages[:, None].expand(2, 3))
    torch.testing.assert_close(a, b)


def test_gspo_ratio_value_and_gradient_match_sequence_formula():
    g = torch.Generator().manual_seed(20)
    logprobs = (-torch.rand(3, 5, generator=g)).requires_grad_(True)
    old = logprobs.detach() + 1e-4 * torch.randn(3, 5, generator=g)  # inside the 3e-4 / 4e-4 range
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    advantages = torch.tensor([1.0, -0.5, 2.0])
    value, clipped = losses.gspo_loss(logprobs, old, advantages, mask)
    assert not clipped.any()
    for i in range(3):
        n = int(mask[i].sum())
        s = math.exp(sum(logprobs[i, t].item() - old[i, t].item() for t in range(n)) / n)
        assert value[i, :n].tolist() == pytest.approx([-advantages[i].item() * s] * n, rel=1e-12)
    loss = losses.aggregate(value, mask, "seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, logprobs)
    # closed form: seq-mean-token-mean of the token form is the gradient of mean_i -A_i s_i
    fresh = logprobs.detach().clone().requires_grad_(True)
    seq_ratio = torch.exp(((fresh - old) * mask).sum(-1) / mask.sum(-1))
    (expected,) = torch.autograd.grad((-advantages * seq_ratio).mean(), fresh)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


def test_gspo_clipped_sequence_gets_no_gradient():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    old = torch.tensor([[-0.01, -0.01, -0.01], [0.01, 0.01, 0.01]])  # ratios e^0.01 and e^-0.01
    mask = torch.ones(2, 3)
    value, clipped = losses.gspo_loss(logprobs, old, torch.tensor([1.0, -1.0]), mask)
    value.sum().backward()
    assert clipped.all() and logprobs.grad.abs().max().item() == 0.0


# -----------------------------------------------------------------------------
# KL estimators


def test_kl_estimators_match_closed_forms():
    logprobs = torch.tensor([-0.3, -2.0, -0.01, -5.0])
    ref = torch.tensor([-0.5, -1.0, -0.01, -0.2])
    d = (logprobs - ref).tolist()
    expected = {
        "k1": d,
        "abs": [abs(x) for x in d],
        "k2": [0.5 * x * x for x in d],
        "k3": [min(math.exp(-x) + x - 1, 10.0) for x in d],
    }
    for kind, values in expected.items():
        assert losses.kl_estimate(logprobs, ref, kind).tolist() == pytest.approx(values, rel=1e-12, abs=1e-15)
    assert losses.kl_estimate(torch.tensor([-40.0]), torch.tensor([0.0]), "k3").item() == 10.0  # clamped
    with pytest.raises(ValueError):
        losses.kl_estimate(logprobs, ref, "k4")


@FAST
@given(d=st.lists(st.floats(-60, 60), min_size=1, max_size=20))
def test_k3_is_nonnegative(d):
    value = losses.kl_estimate(torch.tensor(d), torch.zeros(len(d)), "k3")
    assert (value >= 0).all() and (value <= 10).all()


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
def test_straight_through_variants_have_k2_gradient(kind):
    logprobs = torch.tensor([-0.3, -2.0, -0.7, -5.0], requires_grad=True)
    ref = torch.tensor([-0.5, -1.0, -0.7, -0.2])
    value = losses.kl_estimate(logprobs, ref, kind + "+")
    torch.testing.assert_close(value, losses.kl_estimate(logprobs, ref, kind))
    (grad,) = torch.autograd.grad(value.sum(), logprobs)
    torch.testing.assert_close(grad, (logprobs - ref).detach())  # d(d^2/2)/dlogp = d


# -----------------------------------------------------------------------------
# DPO and GAD


def test_dpo_sigmoid_at_zero_logits_is_log_two():
    zeros = torch.zeros(3)
    value, chosen_rewards, rejected_rewards = losses.dpo_loss(zeros, zeros, zeros, zeros, beta=0.1)
    assert value.tolist() == pytest.approx([math.log(2)] * 3)
    assert chosen_rewards.tolist() == [0.0] * 3 and rejected_rewards.tolist() == [0.0] * 3


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "hinge", "robust"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_dpo_kinds_match_hand_formulas(kind, label_smoothing):
    beta, eps = 0.1, label_smoothing
    pc, pr = torch.tensor([-10.0, -3.0, -8.0]), torch.tensor([-12.0, -2.0, -8.0])
    rc, rr = torch.tensor([-11.0, -3.5, -7.0]), torch.tensor([-11.0, -1.0, -9.5])
    value, chosen_rewards, _ = losses.dpo_loss(pc, pr, rc, rr, beta=beta, kind=kind, label_smoothing=eps)

    def logsig(x):
        return -math.log1p(math.exp(-x))

    for i in range(3):
        logit = (pc[i] - pr[i] - (rc[i] - rr[i])).item()
        z = beta * logit
        expected = {
            "sigmoid": -(1 - eps) * logsig(z) - eps * logsig(-z),
            "ipo": (logit - 1 / (2 * beta)) ** 2,
            "hinge": max(0.0, 1 - z),
            "robust": (-(1 - eps) * logsig(z) + eps * logsig(-z)) / (1 - 2 * eps),
        }[kind]
        assert value[i].item() == pytest.approx(expected, rel=1e-12)
    assert chosen_rewards.tolist() == pytest.approx([0.1, 0.05, -0.1])


def test_dpo_reference_free_and_gradient():
    pc = torch.tensor([-1.0], requires_grad=True)
    pr = torch.tensor([-2.0], requires_grad=True)
    value, _, _ = losses.dpo_loss(pc, pr, beta=0.5, reference_free=True)
    assert value.item() == pytest.approx(math.log1p(math.exp(-0.5)))
    value.sum().backward()
    # d/dpc -logsig(b (pc - pr)) = -b sigmoid(-b (pc - pr))
    assert pc.grad.item() == pytest.approx(-0.5 / (1 + math.exp(0.5)))
    assert pr.grad.item() == pytest.approx(0.5 / (1 + math.exp(0.5)))
    with pytest.raises(ValueError):
        losses.dpo_loss(pc, pr)


def test_discriminator_loss_pairs_each_teacher_with_every_student_sample():
    teacher = torch.tensor([1.0, -0.5], requires_grad=True)
    student = torch.tensor([[0.0, 2.0, 1.0], [-1.0, -0.5, 0.3]])
    loss, accuracy = losses.discriminator_loss(teacher, student)
    gaps = [1.0, -1.0, 0.0, 0.5, 0.0, -0.8]
    assert loss.item() == pytest.approx(sum(math.log1p(math.exp(-x)) for x in gaps) / 6, rel=1e-12)
    assert accuracy.item() == pytest.approx(2 / 6)  # ties are not wins
    loss.backward()
    assert teacher.grad[0].item() == pytest.approx(-sum(1 / (1 + math.exp(x)) for x in gaps[:3]) / 6)
    flat_loss, flat_accuracy = losses.discriminator_loss(torch.tensor([0.0, 3.0]), torch.tensor([0.0, 1.0]))
    assert flat_loss.item() == pytest.approx((math.log(2) + math.log1p(math.exp(-2.0))) / 2)
    assert flat_accuracy.item() == 0.5


# -----------------------------------------------------------------------------
# aggregation

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def test_aggregate_hand_worked():
    loss = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 6.0, 7.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert losses.aggregate(loss, mask, "token-mean").item() == pytest.approx(15 / 5)
    assert losses.aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 9) / 2)
    assert losses.aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4.5) / 2)
    assert losses.aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(15 / (2 * 4))
    assert losses.aggregate(loss, mask, "seq-mean-token-sum-norm", max_len=10).item() == pytest.approx(15 / 20)
    assert [x.item() for x in losses.global_counts(mask)] == [5.0, 2.0]
    with pytest.raises(ValueError):
        losses.aggregate(loss, mask, "mean")


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_of_nothing_is_zero_with_gradient_path(mode):
    loss = torch.full((2, 3), float("nan"), requires_grad=True)  # masked garbage must not leak
    value = losses.aggregate(loss, torch.zeros(2, 3), mode)
    assert value.item() == 0.0
    value.backward()
    assert loss.grad.abs().sum().item() == 0.0
    empty = torch.zeros(0, 0, requires_grad=True)
    assert losses.aggregate(empty, torch.zeros(0, 0), mode).item() == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_ignores_inf_and_nan_at_masked_positions(mode):
    loss = torch.tensor([[1.0, float("inf")], [2.0, float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 0], [1, 0]])
    value = losses.aggregate(loss, mask, mode)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(loss.grad).all()


def split_and_sum(loss, mask, mode, cuts, max_len):
    tokens, sequences = losses.global_counts(mask)
    total = 0.0
    for start, stop in zip([0] + cuts, cuts + [loss.shape[0]]):
        lengths = mask[start:stop].sum(-1)
        width = int(lengths.max()) if stop > start and lengths.numel() else 0
        width = max(width, 1)  # micro-batches are padded to their own longest response
        total = total + losses.aggregate(
            loss[start:stop, :width], mask[start:stop, :width], mode,
            global_tokens=tokens, global_sequences=sequences, max_len=max_len,
        )
    return total


@FAST
@given(
    lengths=st.lists(st.integers(0, 7), min_size=1, max_size=9),
    cut_fractions=st.lists(st.floats(0, 1), max_size=4),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 1000),
)
def test_aggregate_is_invariant_to_micro_batching(lengths, cut_fractions, mode, seed):
    width = 8
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths], dtype=torch.float64)
    per_token = torch.randn(len(lengths), width, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    cuts = sorted({int(f * len(lengths)) for f in cut_fractions} - {0, len(lengths)})
    full = losses.aggregate(per_token, mask, mode, max_len=width)
    (full_grad,) = torch.autograd.grad(full, per_token)
    pieces = split_and_sum(per_token, mask, mode, cuts, max_len=width)
    (pieces_grad,) = torch.autograd.grad(pieces, per_token)
    assert pieces.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(pieces_grad, full_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_invariance_fails_without_global_counts(mode):
    # guards the test above: local normalisation must actually differ on this split
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.float64)
    per_token = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    full = losses.aggregate(per_token, mask, mode, max_len=4)
    local = losses.aggregate(per_token[:1], mask[:1], mode, max_len=4) + losses.aggregate(
        per_token[1:], mask[1:], mode, max_len=4
    )
    assert abs(local.item() - full.item()) > 1e-3
    assert split_and_sum(per_token, mask, mode, [1], max_len=4).item() == pytest.approx(full.item(), rel=1e-12)


# -----------------------------------------------------------------------------
# chunked top-K distillation from hidden states


def make_hidden(num_tokens=13, hidden=6, vocab=40, seed=21):
    g = torch.Generator().manual_seed(seed)
    student_hidden = torch.randn(num_tokens, hidden, generator=g, requires_grad=True)
    student_weight = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    teacher_hidden = student_hidden.detach() + 0.5 * torch.randn(num_tokens, hidden, generator=g)
    teacher_weight = student_weight.detach() + 0.3 * torch.randn(vocab, hidden, generator=g)
    return student_hidden, student_weight, teacher_hidden, teacher_weight


def plain_path(student_hidden, student_weight, teacher_hidden, teacher_weight, k, alpha, add_tail, temperature,
               mix=0.0):
    student_logits = student_hidden @ student_weight.T
    teacher_logits = teacher_hidden @ teacher_weight.T
    if mix:
        teacher_logits = torch.lerp(teacher_logits, student_logits.detach(), mix)
    s_sup, t_sup, _ = losses.topk_with_tail(student_logits, teacher_logits, k, add_tail, temperature=temperature)
    return losses.sdpo_divergence(s_sup, t_sup, alpha)


def assert_close_scaled(actual, expected, rtol=1e-10):
    # the tail entry's log(1 - sum p) magnifies rounding when the top-K hold almost all
    # mass, so compare relative to the tensor's scale rather than elementwise
    scale = expected.abs().max().item() + 1e-300
    assert (actual - expected).abs().max().item() <= rtol * scale


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("add_tail", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_plain_in_values_and_gradients(alpha, add_tail, temperature):
    inputs = make_hidden()
    student_hidden, student_weight = inputs[:2]
    grad_output = torch.rand(13, generator=torch.Generator().manual_seed(22))  # caller's mask x IS weight
    expected = plain_path(*inputs, 5, alpha, add_tail, temperature)
    expected_grads = torch.autograd.grad((expected * grad_output).sum(), (student_hidden, student_weight))
    for chunk_size in (1, 4, 13, 50):  # 4 does not divide 13
        got = chunked_head.sdpo_topk_loss_from_hidden(
            *inputs, k=5, alpha=alpha, add_tail=add_tail, temperature=temperature, chunk_size=chunk_size
        )
        assert got.shape == (13,)
        got_grads = torch.autograd.grad((got * grad_output).sum(), (student_hidden, student_weight))
        assert_close_scaled(got, expected)
        for a, b in zip(got_grads, expected_grads):
            assert_close_scaled(a, b)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_chunked_weighted_path_equals_plain(alpha):
    inputs = make_hidden(seed=23)
    student_hidden, student_weight = inputs[:2]
    weights = torch.rand(13, generator=torch.Generator().manual_seed(24)) * (torch.arange(13) % 3 > 0)
    expected = (plain_path(*inputs, 6, alpha, True, 0.9) * weights).sum()
    expected_grads = torch.autograd.grad(3.0 * expected, (student_hidden, student_weight))
    got = chunked_head.sdpo_topk_loss_from_hidden(
        *inputs, k=6, alpha=alpha, temperature=0.9, chunk_size=5, token_weights=weights
    )
    assert got.dim() == 0
    got_grads = torch.autograd.grad(3.0 * got, (student_hidden, student_weight), retain_graph=True)
    assert got.item() == pytest.approx(expected.item(), rel=1e-10)
    for a, b in zip(got_grads, expected_grads):
        assert_close_scaled(a, b)
    with pytest.raises(RuntimeError):  # gradients were scaled in place: a second backward is refused
        torch.autograd.grad(got, (student_hidden, student_weight))


def test_chunked_trust_region_teacher_and_shared_head():
    student_hidden, student_weight, teacher_hidden, teacher_weight = make_hidden(seed=25)
    expected = plain_path(student_hidden, student_weight, teacher_hidden, teacher_weight, 4, 0.5, True, 1.0, mix=0.4)
    expected_grads = torch.autograd.grad(expected.sum(), (student_hidden, student_weight))
    got = chunked_head.sdpo_topk_loss_from_hidden(
        student_hidden, student_weight, teacher_hidden, teacher_weight, k=4, chunk_size=3, teacher_mix=0.4
    )
    got_grads = torch.autograd.grad(got.sum(), (student_hidden, student_weight))
    assert_close_scaled(got, expected)
    for a, b in zip(got_grads, expected_grads):
        assert_close_scaled(a, b)
    shared = chunked_head.sdpo_topk_loss_from_hidden(student_hidden, student_weight, teacher_hidden, None, k=4,
                                                     chunk_size=3)
    expected_shared = plain_path(student_hidden, student_weight, teacher_hidden, student_weight, 4, 0.5, True, 1.0)
    assert_close_scaled(shared, expected_shared)


def test_chunked_gives_teacher_no_gradient():
    student_hidden, student_weight, teacher_hidden, teacher_weight = make_hidden(seed=26)
    teacher_hidden.requires_grad_(True)
    teacher_weight.requires_grad_(True)
    loss = chunked_head.sdpo_topk_loss_from_hidden(student_hidden, student_weight, teacher_hidden, teacher_weight, k=3)
    loss.sum().backward()
    assert teacher_hidden.grad is None and teacher_weight.grad is None
    assert student_hidden.grad.abs().sum() > 0 and student_weight.grad.abs().sum() > 0


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("add_tail", [True, False])
def test_chunked_gradcheck(alpha, add_tail):
    inputs = make_hidden(num_tokens=5, hidden=3, vocab=9, seed=27)
    student_hidden, student_weight, teacher_hidden, teacher_weight = inputs
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_head.sdpo_topk_loss_from_hidden(
            h, w, teacher_hidden, teacher_weight, k=3, alpha=alpha, add_tail=add_tail, temperature=0.8, chunk_size=2
        ),
        (student_hidden, student_weight),
    )


def test_chunked_bfloat16_matches_plain_bfloat16():
    student_hidden, student_weight, teacher_hidden, teacher_weight = (
        x.detach().to(torch.bfloat16) for x in make_hidden(num_tokens=9, hidden=16, vocab=64, seed=28)
    )
    student_hidden.requires_grad_(True)
    student_weight.requires_grad_(True)
    got = chunked_head.sdpo_topk_loss_from_hidden(
        student_hidden, student_weight, teacher_hidden, teacher_weight, k=8, chunk_size=4
    )
    assert got.dtype == torch.float32
    got.sum().backward()
    assert student_hidden.grad.dtype == torch.bfloat16 and student_weight.grad.dtype == torch.bfloat16
    h = student_hidden.detach().clone().requires_grad_(True)
    w = student_weight.detach().clone().requires_grad_(True)
    s_sup, t_sup, _ = losses.topk_with_tail((h @ w.T).float(), (teacher_hidden @ teacher_weight.T).float(), 8)
    expected = losses.sdpo_divergence(s_sup, t_sup, 0.5)
    expected.sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    scale = w.grad.abs().max().item()
    torch.testing.assert_close(student_weight.grad.float(), w.grad.float(), rtol=0.02, atol=0.02 * scale)


def test_chunked_with_no_tokens():
    hidden = torch.zeros(0, 4, requires_grad=True)
    weight = torch.randn(10, 4, requires_grad=True)
    per_token = chunked_head.sdpo_topk_loss_from_hidden(hidden, weight, hidden.detach(), weight.detach(), k=3)
    assert per_token.shape == (0,)
    per_token.sum().backward()
    assert hidden.grad.shape == (0, 4) and weight.grad.abs().sum().item() == 0.0
    weighted = chunked_head.sdpo_topk_loss_from_hidden(hidden, weight, hidden.detach(), weight.detach(), k=3,
                                                 token_weights=torch.zeros(0))
    assert weighted.item() == 0.0


# -----------------------------------------------------------------------------
# token log-probs with a gradient from hidden states (GRPO/GSPO/DPO/SFT head)


def _logprob_loop(hidden, weight, targets, temperature):
    """Per row, by the formulas with Python floats: log p(target) and the entropy."""
    logprobs, entropies = [], []
    for h, t in zip(hidden.tolist(), targets.tolist()):
        z = [sum(a * b for a, b in zip(h, w)) / temperature for w in weight.tolist()]
        top = max(z)
        lse = top + math.log(sum(math.exp(x - top) for x in z))
        p = [math.exp(x - lse) for x in z]
        logprobs.append(z[t] - lse)
        entropies.append(-sum(q * (x - lse) for q, x in zip(p, z)))
    return logprobs, entropies


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_from_hidden_match_loop_and_plain_gradients(temperature):
    hidden, weight = make_hidden(num_tokens=11, hidden=5, vocab=17, seed=31)[:2]
    targets = torch.randint(0, 17, (11,), generator=torch.Generator().manual_seed(32))
    grad_output = torch.randn(11, generator=torch.Generator().manual_seed(33))  # the caller's advantages
    want_logprobs, want_entropies = _logprob_loop(hidden, weight, targets, temperature)
    plain = losses.token_logprobs(hidden @ weight.T, targets, temperature)
    want_grads = torch.autograd.grad((plain * grad_output).sum(), (hidden, weight))
    for chunk_size in (1, 4, 11, 64):  # 4 does not divide 11
        logprobs, entropies = chunked_head.token_logprobs_from_hidden(hidden, weight, targets, temperature, chunk_size)
        assert logprobs.tolist() == pytest.approx(want_logprobs, abs=1e-10)
        assert entropies.tolist() == pytest.approx(want_entropies, abs=1e-10)
        assert not entropies.requires_grad
        grads = torch.autograd.grad((logprobs * grad_output).sum(), (hidden, weight))
        for got, want in zip(grads, want_grads):
            assert_close_scaled(got, want)


def test_token_logprobs_from_hidden_gradcheck():
    hidden, weight = make_hidden(num_tokens=5, hidden=3, vocab=9, seed=34)[:2]
    targets = torch.tensor([0, 8, 3, 3, 5])
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_head.token_logprobs_from_hidden(h, w, targets, 0.8, chunk_size=2)[0], (hidden, weight))


def test_token_logprobs_from_hidden_peaked_rows_and_no_tokens():
    # a row whose softmax is one-hot in float64 has entropy 0 and log p 0 (no 0 * log 0 NaN)
    hidden = torch.tensor([[1000.0, 0.0], [0.0, 0.0]], requires_grad=True)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], requires_grad=True)
    logprobs, entropies = chunked_head.token_logprobs_from_hidden(hidden, weight, torch.tensor([0, 2]))
    assert logprobs.tolist() == pytest.approx([0.0, -math.log(3)])
    assert entropies.tolist() == pytest.approx([0.0, math.log(3)])
    logprobs.sum().backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    empty = torch.zeros(0, 2, requires_grad=True)
    logprobs, entropies = chunked_head.token_logprobs_from_hidden(empty, weight, torch.zeros(0, dtype=torch.long))
    assert logprobs.shape == entropies.shape == (0,)
    logprobs.sum().backward()
    assert empty.grad.shape == (0, 2)
    with pytest.raises(ValueError, match="head_chunk_size"):
        chunked_head.token_logprobs_from_hidden(hidden, weight, torch.tensor([0, 2]), chunk_size=-1)


def test_token_logprobs_from_hidden_bfloat16_matches_plain_upcast():
    hidden, weight = (x.detach().to(torch.bfloat16).requires_grad_(True)
                      for x in make_hidden(num_tokens=9, hidden=16, vocab=64, seed=35)[:2])
    targets = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(36))
    logprobs, _ = chunked_head.token_logprobs_from_hidden(hidden, weight, targets, chunk_size=4)
    assert logprobs.dtype == torch.float32
    logprobs.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    h, w = (x.detach().clone().requires_grad_(True) for x in (hidden, weight))
    expected = losses.token_logprobs((h @ w.T).float(), targets)
    expected.sum().backward()
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)
    for got, want in ((hidden.grad, h.grad), (weight.grad, w.grad)):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02 * scale)

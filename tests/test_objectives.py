"""The objectives table: every objective gives the gradients and metrics the loop gave before
the objectives were split out of run.py (pinned in tests/golden.json, see tests/golden.py)."""
import json

import pytest
import torch

import data
import run
import tiny_models
from golden import CASES, COMMON, PATH, fingerprint
from microbatch import Models
from objectives import OBJECTIVES, dpo
from teacher import Teacher
from test_loop import SteppingRecorder, fixed_rollouts, fixed_start
from test_run import CPU, GradRecorder, NoSchedule, ONE_PROCESS, _policy, _rollouts
from update import micro_batch_units, mini_batch_units, pack_units


def new_loop_step(flags, rollouts=None, stepping=False):
    """The fixed batch (or rollouts) through the objectives table. stepping: the recorder
    steps (tests/test_loop.py), so later mini-batches run off ratio 1, on test_loop's batch
    whose engine log-probs are the start's plus noise (the golden cases)."""
    tiny, tokenizer, cfg, objective, policy = fixed_start(flags)
    extra = objective.build_models(cfg, lambda: _policy(tiny), tiny, ONE_PROCESS)  # SDPO's teacher: the start
    recorder = SteppingRecorder(policy) if stepping else GradRecorder(policy)
    if stepping and rollouts is None:
        rollouts = fixed_rollouts(cfg.algo.name, policy.hf, tokenizer, cfg)
    elif objective.references:
        rollouts = run.sft_rollouts(tokenizer, data.task_rows("strops", "train", 6, seed=1), cfg, 0)
    elif rollouts is None:
        rollouts = _rollouts(tokenizer, cfg.algo.name)
    trainer = run.Trainer(Models(policy, **extra), recorder, NoSchedule())
    metrics, _ = run.update_policy(cfg, objective, trainer, rollouts, 0, tokenizer.pad_token_id, ONE_PROCESS)
    return recorder.grads, metrics


with open(PATH) as f:
    GOLDEN = json.load(f)

# Tolerances from arithmetic: the same code gives other float32 sums under other SIMD kernels and
# thread counts (ATEN_CPU_CAPABILITY default, avx2, avx512; 1 or 2 threads; each with its own tiny
# model), and each tolerance is at least 10 times the largest difference `python tests/golden.py
# --spread` measured, between two settings or from the pinned file (the table, its machine and each
# margin: docs/results.md, Tests). A gradient's sum and random projection cancel, so their rounding is relative to the
# tensor's gradient norm; a sum of squares does not: relative to itself.
GRAD_TOL_OF_NORM = 6e-4  # sum and projection, x the tensor's gradient norm
SQUARES_REL = 1.2e-4  # sum of squares, relative
# A metric: |got - pinned| <= METRIC_REL x |pinned| + METRIC_ABS. The loss, the divergences and the
# teacher-minus-student gaps are small differences of O(1) float32 sums: their rounding is absolute.
METRIC_REL, METRIC_ABS = 1e-4, 1e-5


@pytest.mark.parametrize("name,flags", CASES, ids=[c[0] for c in CASES])
def test_objective_gives_the_pinned_gradients_and_metrics(name, flags):
    grads, metrics = new_loop_step(COMMON + flags, stepping=True)
    pinned = GOLDEN[name]
    assert len(grads) == len(pinned["grads"])
    for got, want in zip(grads, pinned["grads"]):
        got = fingerprint(got)
        assert got.keys() == want.keys()
        for tensor, (total, squares, projection) in want.items():
            norm = squares ** 0.5
            assert got[tensor][1] == pytest.approx(squares, rel=SQUARES_REL, abs=1e-12), tensor
            assert got[tensor][0] == pytest.approx(total, abs=GRAD_TOL_OF_NORM * norm + 1e-12), tensor
            assert got[tensor][2] == pytest.approx(projection, abs=GRAD_TOL_OF_NORM * norm + 1e-12), tensor
    for key, value in pinned["metrics"].items():  # new metrics may be added, none may change
        assert metrics[key] == pytest.approx(value, rel=METRIC_REL, abs=METRIC_ABS), key


def test_the_algo_flag_offers_exactly_the_rows_of_the_table():
    for name in OBJECTIVES:
        assert run.parse_config([f"--algo={name}"]).algo.name == name
    with pytest.raises(run.data.FlagError, match="invalid choice 'ppo'"):  # a message, exit status 2 (run.cli)
        run.parse_config(["--algo=ppo"])


def test_units_are_never_split_across_micro_batches():
    units = [[0, 1, 2], [3], [4, 5, 6, 7, 8], [9, 10]]
    assert pack_units(units, 4) == [[0, 1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    assert pack_units([[i] for i in range(5)], 2) == [[0, 1], [2, 3], [4]]
    assert pack_units([], 4) == []
    # a token budget: sequences x the longest so far stays within it; a unit over it goes alone
    assert pack_units([[0], [1], [2], [3, 4]], 8, lengths=[10, 20, 30, 40], token_budget=60) == [[0, 1], [2], [3, 4]]
    assert pack_units([[0], [1], [2]], 2, lengths=[5, 5, 5], token_budget=100) == [[0, 1], [2]]


def test_mini_batches_split_prompts_and_micro_batches_split_samples_unless_the_objective_pairs_them(tokenizer):
    import dataclasses
    rollouts = _rollouts(tokenizer, "grpo", n_prompts=3, n=4)
    grpo, paired = OBJECTIVES["grpo"], dataclasses.replace(OBJECTIVES["grpo"], keep_prompts_together=True)
    groups = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert mini_batch_units(rollouts, grpo) == groups  # the paper's mini-batches count prompts
    assert all(len({rollouts[i].row["uid"] for i in unit}) == 1 for unit in groups)
    assert mini_batch_units(rollouts, grpo, shuffle_samples=True) == [[i] for i in range(12)]
    assert mini_batch_units(rollouts, paired, shuffle_samples=True) == groups
    # within a mini-batch, a micro-batch may cut a group (--train.micro_batch bounds a forward)
    assert micro_batch_units(groups[:2], grpo) == [[i] for i in range(8)]
    assert micro_batch_units(groups[:2], paired) == groups[:2]


@pytest.mark.parametrize("algo", ["grpo", "sdpo"])
def test_a_mini_batch_of_whole_prompts_is_an_update_on_those_prompts_alone(algo, tokenizer):
    """The paper's layout (Table 12, "32 optimizer steps, mini-batch 1"): each optimizer step's
    gradient is what an update on its prompts' samples alone gives, each prompt in one step.
    A micro-batch of 3 cuts every group of 4, so the step's counts must hold them together."""
    import copy
    rollouts = _rollouts(tokenizer, algo)
    flags = [f"--algo={algo}", "--train.micro_batch=3", "--sdpo.topk=8", "--sdpo.chunk_size=7"]
    steps, _ = new_loop_step(flags + ["--train.mini_batches=3"], copy.deepcopy(rollouts))
    uids = list(dict.fromkeys(r.row["uid"] for r in rollouts))
    alone = [new_loop_step(flags + ["--train.mini_batches=1"], copy.deepcopy([r for r in rollouts if r.row["uid"] == u]))[0]
             for u in uids]
    assert len(steps) == 3 and all(len(a) == 1 for a in alone)

    def distance(a, b):  # the largest difference, relative to the gradient's norm
        return max(float((a[n] - b[n]).abs().max() / b[n].norm().clamp_min(1e-12)) for n in b)
    matched = [min(range(3), key=lambda k: distance(step, alone[k][0])) for step in steps]
    assert sorted(matched) == [0, 1, 2]
    assert max(distance(step, alone[k][0]) for step, k in zip(steps, matched)) < 1e-5
    # and no two prompts' gradients alike, or the match above proves nothing
    assert min(distance(alone[i][0], alone[j][0]) for i in range(3) for j in range(3) if i != j) > 1e-2


def _sdpo_update(flags, per_micro_batch: bool, monkeypatch):
    """One SDPO update on the fixed batch; returns (gradients, metrics, teacher forwards).
    per_micro_batch: compute the teacher per micro-batch, as a policy-reading teacher is."""
    import teacher as teacher_module
    tiny = tiny_models.tiny_model_dir()
    tokenizer = run.load_tokenizer(tiny)
    cfg = run.parse_config(flags)
    torch.manual_seed(0)
    policy = _policy(tiny, seed=3)
    copy = _policy(tiny)
    forwards = []
    copy.register_forward_hook(lambda module, args, out: forwards.append(1))
    teacher = Teacher(cfg.sdpo.teacher, cfg.sdpo.teacher_rate, copy)
    monkeypatch.setattr(teacher_module.Teacher, "reads_policy", property(lambda self: per_micro_batch))
    recorder = GradRecorder(policy)
    trainer = run.Trainer(Models(policy, teacher=teacher), recorder, NoSchedule())
    metrics, _ = run.update_policy(cfg, OBJECTIVES[cfg.algo.name], trainer, _rollouts(tokenizer, cfg.algo.name), 0,
                                   tokenizer.pad_token_id, ONE_PROCESS)
    return recorder.grads, metrics, len(forwards)


@pytest.mark.parametrize("algo", ["sdpo", "hybrid"])
def test_the_teacher_runs_once_per_update_with_the_same_gradients(algo, monkeypatch):
    flags = [f"--algo={algo}", "--train.mini_batches=3", "--train.micro_batch=2", "--sdpo.topk=8",
             "--sdpo.chunk_size=7"]
    cached, cached_metrics, cached_forwards = _sdpo_update(flags, False, monkeypatch)
    each, each_metrics, each_forwards = _sdpo_update(flags, True, monkeypatch)
    # 9 of the 12 samples have a teacher context: one forward of 32 sequences per update,
    # against one per micro-batch holding one of them
    assert cached_forwards == 1 and each_forwards >= 4
    assert len(cached) == len(each) == 3
    for got, want in zip(cached, each):
        for name in want:  # float rounding of a different padding width only
            assert torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-4 * want[name].abs().max().item()), name
    for key, value in each_metrics.items():
        if not key.startswith("time/"):
            assert cached_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


TRUNCATED = (1, 6, 9)  # a wrong sample of each prompt (the first sample of each succeeds)


def _with_truncated(tokenizer, algo):
    rollouts = _rollouts(tokenizer, algo)
    for i in TRUNCATED:
        rollouts[i].truncated = True
    return rollouts


@pytest.mark.parametrize("algo", ["grpo", "gspo", "sdpo", "hybrid"])
def test_mask_truncated_gives_the_gradient_of_the_batch_without_the_truncated_samples(algo, tokenizer):
    """--train.mask_truncated: the gradient is the one of the same batch with the truncated
    samples removed (their advantages and teacher contexts, written from the whole batch,
    left as they were), normalised by the other samples' tokens; without the flag it is not."""
    import copy
    rollouts = _with_truncated(tokenizer, algo)
    flags = [f"--algo={algo}", "--train.mini_batches=1", "--train.micro_batch=3", "--sdpo.topk=8",
             "--sdpo.chunk_size=7"]
    masked, _ = new_loop_step(flags + ["--train.mask_truncated=True"], copy.deepcopy(rollouts))
    removed, _ = new_loop_step(flags, copy.deepcopy([r for r in rollouts if not r.truncated]))
    kept, _ = new_loop_step(flags, copy.deepcopy(rollouts))
    assert len(masked) == len(removed) == len(kept) == 1
    distance = lambda a, b: max(float((a[n] - b[n]).abs().max() / b[n].norm().clamp_min(1e-12)) for n in b)
    assert distance(masked[0], removed[0]) < 1e-5
    assert distance(kept[0], removed[0]) > 1e-3


def test_mask_truncated_leaves_every_dpo_pair_with_a_truncated_sample_out(tokenizer):
    rollouts = _with_truncated(tokenizer, "grpo")
    for i, r in enumerate(rollouts):
        r.reward = float(i % 4 in (0, 2))  # two right, two wrong per prompt; 1, 6, 9 truncated
    cfg = run.parse_config(["--algo=dpo", "--dpo.pairs=all", "--train.mask_truncated=True", "--train.mini_batches=1"])
    dpo.prepare_pairs(rollouts, tokenizer, cfg)
    expected = sum(1 for i in range(12) for j in range(12) if i // 4 == j // 4 and rollouts[i].reward > rollouts[j].reward
                   and i not in TRUNCATED and j not in TRUNCATED)
    assert sum(len(r.fields.preferred_over) for r in rollouts) == expected == 6  # of 12 without the flag
    assert not any(r.fields.paired for r in rollouts if r.truncated)


def test_sdpo_divergence_by_sample_kind_is_the_divergence_of_those_samples_alone(tokenizer):
    """sdpo/divergence_right|wrong|truncated: each the divergence an update on that kind of
    sample alone logs (the same teacher contexts); together the whole batch's."""
    import copy
    rollouts = _with_truncated(tokenizer, "sdpo")
    flags = ["--algo=sdpo", "--train.mini_batches=1", "--sdpo.topk=8", "--sdpo.chunk_size=7"]
    _, metrics = new_loop_step(flags, copy.deepcopy(rollouts))
    kinds = {"right": lambda r: r.reward >= 0.5 and not r.truncated, "truncated": lambda r: r.truncated,
             "wrong": lambda r: r.reward < 0.5 and not r.truncated}
    total, tokens = 0.0, 0
    for name, of_kind in kinds.items():
        alone = [r for r in rollouts if of_kind(r) and r.fields.sdpo_mask > 0]
        _, own = new_loop_step(flags, copy.deepcopy(alone))
        assert metrics[f"sdpo/divergence_{name}"] == pytest.approx(own["sdpo/divergence"], rel=1e-4), name
        n = sum(len(r.response_ids) for r in alone)
        total, tokens = total + own["sdpo/divergence"] * n, tokens + n
    assert metrics["sdpo/divergence"] == pytest.approx(total / tokens, rel=1e-4)
    values = sorted(metrics[f"sdpo/divergence_{k}"] for k in kinds)  # the split tells the kinds apart
    assert values[0] < 0.99 * values[1] and values[1] < 0.99 * values[2], values

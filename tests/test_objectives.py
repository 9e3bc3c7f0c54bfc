"""The objectives table: every objective gives the gradients and metrics the loop gave before
the objectives were split out of run.py (pinned in tests/golden.json, see tests/golden.py)."""
import json

import pytest
import torch

import data
import objectives
import run
from golden import CASES, COMMON, PATH, fingerprint
from objectives import OBJECTIVES, Models
from teacher import Teacher
from test_run import CPU, GradRecorder, NoSchedule, ONE_PROCESS, _policy, _rollouts


def new_loop_step(flags):
    """The same fixed batch as golden.old_loop_step, through the objectives table."""
    tiny = data.tiny_model_dir()
    tokenizer = run.load_tokenizer(tiny)
    cfg = run.parse_config(flags)
    objective = OBJECTIVES[cfg.algo.name]
    torch.manual_seed(0)
    policy = _policy(tiny, seed=3)
    teacher = Teacher(cfg.sdpo.teacher, cfg.sdpo.teacher_rate, _policy(tiny)) if "teacher" in objective.models else None
    recorder = GradRecorder(policy)
    if objective.references:
        rollouts = run.sft_rollouts(tokenizer, data.task_rows("strops", "train", 6, seed=1), cfg, 0)
    else:
        rollouts = _rollouts(tokenizer, cfg.algo.name)
    trainer = run.Trainer(Models(policy, teacher), recorder, NoSchedule())
    metrics, _ = run.update_policy(cfg, objective, trainer, rollouts, 0, tokenizer.pad_token_id, ONE_PROCESS)
    return recorder.grads, metrics


with open(PATH) as f:
    GOLDEN = json.load(f)


@pytest.mark.parametrize("name,flags", CASES, ids=[c[0] for c in CASES])
def test_objective_gives_the_pinned_gradients_and_metrics(name, flags):
    grads, metrics = new_loop_step(flags + COMMON)
    pinned = GOLDEN[name]
    assert len(grads) == len(pinned["grads"])
    for got, want in zip(grads, pinned["grads"]):
        got = fingerprint(got)
        assert got.keys() == want.keys()
        for tensor in want:
            assert got[tensor] == pytest.approx(want[tensor], rel=1e-5, abs=1e-9), tensor
    for key, value in pinned["metrics"].items():  # new metrics may be added, none may change
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key


def test_the_algo_flag_offers_exactly_the_rows_of_the_table():
    for name in OBJECTIVES:
        assert run.parse_config([f"--algo={name}"]).algo.name == name
    with pytest.raises(SystemExit):
        run.parse_config(["--algo=ppo"])


def test_units_are_never_split_across_micro_batches():
    units = [[0, 1, 2], [3], [4, 5, 6, 7, 8], [9, 10]]
    assert run.pack_units(units, 4) == [[0, 1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    assert run.pack_units([[i] for i in range(5)], 2) == [[0, 1], [2, 3], [4]]
    assert run.pack_units([], 4) == []


def test_prompts_stay_together_when_the_objective_asks(tokenizer):
    import dataclasses
    rollouts = _rollouts(tokenizer, "grpo", n_prompts=3, n=4)
    alone = run.micro_batch_units(rollouts, OBJECTIVES["grpo"])
    assert alone == [[i] for i in range(12)]
    together = run.micro_batch_units(rollouts, dataclasses.replace(OBJECTIVES["grpo"], keep_prompts_together=True))
    assert together == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(len({rollouts[i].row["uid"] for i in unit}) == 1 for unit in together)

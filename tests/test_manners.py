"""The manners task (tasks/manners.py, GAD's testbed): its rows, its checker (correctness AND
coherence: one manner a reply, either of the row's, never a blend) and its registration; GAD's
constant-reward control (--gad.reward=constant). Cheap: no engine."""
import random

import pytest

import data
import run
import tasks
from tasks import TaskConfig
from feedback import Reward, TRUNCATION_FEEDBACK, get_reward_fn, score
from tasks.manners import MANNERS, is_blend, line_manners, write_line
from tasks.manners import reward as manners_reward

ROW = {"uid": "m1", "tests": [{"input": "a:7*8", "output": "56"}, {"input": "b:3+4", "output": "7"},
                              {"input": "c:9*2", "output": "18"}]}
QUESTIONS = [("a", 7, "*", 8, 56), ("b", 3, "+", 4, 7), ("c", 9, "*", 2, 18)]


def reply(*manners, results=(56, 7, 18)):
    return "\n".join(write_line(m, label, a, op, b, r)
                     for m, (label, a, op, b, _), r in zip(manners, QUESTIONS, results))


def test_rows_are_deterministic_by_seed_and_each_reference_is_in_one_manner_of_the_rows():
    rows = data.task_rows("manners", "train", 200, seed=3)
    assert rows == data.task_rows("manners", "train", 200, seed=3)
    assert [r["uid"] for r in rows] != [r["uid"] for r in data.task_rows("manners", "train", 200, seed=4)]
    manners = [line_manners(r["reference"]) for r in rows]
    assert all(len(set(m)) == 1 and m[0] in ("eq", "is") for m in manners)
    counts = {m: sum(ms[0] == m for ms in manners) for m in ("eq", "is")}
    assert min(counts.values()) > 60  # both manners, drawn per row
    for row in rows:
        assert manners_reward(row["reference"], row, False) == Reward(1.0)
        assert row["messages"][0]["content"].endswith("Solve each line in order, one per line.")
        assert row["uid"] == "manners:" + ",".join(t["input"] for t in row["tests"])
    # the manners do not move the questions: the uid, so the split, is the manners'-independent
    plain = data.task_rows("manners", "train", 200, seed=3, cfg=TaskConfig(manners="plain"))
    assert [r["uid"] for r in plain] == [r["uid"] for r in rows]
    assert {tuple(line_manners(r["reference"])) for r in plain} >= {("plain",) * 3}
    assert all(set(line_manners(r["reference"])) == {"plain"} and r["manners"] == ["plain"] for r in plain)


def test_knobs_and_bad_flags():
    rows = data.task_rows("manners", "test", 50, cfg=TaskConfig(quiz_questions=5, quiz_ops="+", quiz_max=9))
    assert all(len(r["tests"]) == 5 and all("+" in t["input"] for t in r["tests"]) for r in rows)
    assert all(2 <= int(n) <= 9 for r in rows for t in r["tests"] for n in t["input"][2:].split("+"))
    for bad in ("eq,words", "", "eq,eq"):
        with pytest.raises(data.FlagError, match="--data.manners="):
            data.task_rows("manners", "train", 1, cfg=TaskConfig(manners=bad))
    with pytest.raises(data.FlagError, match="--data.manner_per='reply'"):
        data.task_rows("manners", "train", 1, cfg=TaskConfig(manner_per="reply"))


def test_manner_per_line_blends_the_rows_manners_and_the_checker_rejects_the_blends():
    """The GAD bench's student start: each line's manner drawn alone, so 3 lines of 2 manners are
    a blend 3/4 of the time; the blends score 0 though every result is right."""
    rows = data.task_rows("manners", "train", 400, seed=3, cfg=TaskConfig(manner_per="line"))
    blends = [r for r in rows if is_blend(r["reference"])]
    assert 0.65 < len(blends) / len(rows) < 0.85
    assert all(set(line_manners(r["reference"])) <= {"eq", "is"} and r["manners"] == ["eq", "is"] for r in rows)
    assert all(manners_reward(r["reference"], r, False).score == 0.0 for r in blends)
    assert all(manners_reward(r["reference"], r, False) == Reward(1.0) for r in rows if r not in blends)


@pytest.mark.parametrize("manner", ["eq", "is"])
def test_each_pure_manner_is_accepted_and_plain_only_where_the_row_accepts_it(manner):
    assert manners_reward(reply(manner, manner, manner), ROW, False) == Reward(1.0)
    # blank lines and surrounding spaces do not count
    assert manners_reward("\n  " + reply(manner, manner, manner).replace("\n", "\n\n") + "  \n", ROW, False).score == 1.0
    assert manners_reward(reply("plain", "plain", "plain"), {**ROW, "manners": ["plain"]}, False) == Reward(1.0)
    assert manners_reward(reply(manner, manner, manner), {**ROW, "manners": ["plain"]}, False).score == 0.0


def test_a_blend_scores_zero_even_when_right_and_its_feedback_says_which_lines():
    r = manners_reward(reply("eq", "is", "eq"), ROW, False)
    assert r == Reward(0.0, "Blend: lines 1, 3 in the eq manner; line 2 in the is manner. "
                            "Write every line in the same manner.")
    assert is_blend(reply("eq", "is", "eq")) and is_blend(reply("plain", "eq", "eq"))
    assert not is_blend(reply("is", "is", "is")) and not is_blend("a) 7*8 = 56\nnonsense")
    both = manners_reward(reply("is", "eq", "eq", results=(56, 8, 18)), ROW, False)
    assert both.feedback.startswith("Blend: line 1 in the is manner; lines 2, 3 in the eq manner.")
    assert "Wrong Answer: 1 of 3 results are wrong.\n(a) 7*8 is 56. is right.\nb:3+4 is wrong." in both.feedback


def test_wrong_results_are_marked_without_the_correct_result():
    r = manners_reward(reply("eq", "eq", "eq", results=(56, 8, 19)), ROW, False)
    assert r == Reward(0.0, "Wrong Answer: 2 of 3 results are wrong.\na) 7*8 = 56 is right.\n"
                            "b:3+4 is wrong.\nc:9*2 is wrong.")


@pytest.mark.parametrize("response, problem", [
    ("a) 7*8 = 56\nb) 3+4 = 7", "expected 3 lines, found 2"),
    (reply("plain", "plain", "plain"), "line 1 ('a:7*8=56') is in the plain manner, which is not accepted here"),
    ("a) 7*8 = 56\n(b) 3+4 = 7\nc) 9*2 = 18", "line 2 ('(b) 3+4 = 7') is in no accepted manner"),
    ("a) 7*8 = 56\nb) 3+5 = 8\nc) 9*2 = 18", "line 2 ('b) 3+5 = 8') does not answer b:3+4"),
    ("b) 3+4 = 7\na) 7*8 = 56\nc) 9*2 = 18", "line 1 ('b) 3+4 = 7') does not answer a:7*8"),
])
def test_format_errors_name_the_line_and_show_both_manners(response, problem):
    assert manners_reward(response, ROW, False) == Reward(0.0, (
        f"Format Error: {problem}. Write one line per question, in the order asked, every line in one manner: "
        "'a) 7*8 = <result>' or '(a) 7*8 is <result>.'."))


def test_registered_as_a_reward_a_task_and_a_recipe():
    assert manners_reward(reply("eq", "eq", "eq"), ROW, True) == Reward(0.0, TRUNCATION_FEEDBACK)
    assert score(get_reward_fn("manners"), reply("is", "is", "is"), ROW, False) == Reward(1.0)
    cfg = run.parse_config(["--data.task=manners"])
    assert cfg.recipe == "manners" and cfg.data.quiz_max == 9 and cfg.train.warm_start_demo_frac == 0.0
    assert run.parse_config(["--data.task=manners", "--algo=gad"]).gad.pool == "mean"
    assert set(MANNERS) == {"eq", "is", "plain"}
    rng = random.Random(0)
    assert tasks.wrong_response(data.task_rows("manners", "train", 1)[0], rng) is None  # no feedback contexts


def test_the_manner_flags_key_only_the_manners_tasks_warm_start():
    import warm_start
    key = lambda *flags: warm_start.warm_start_config(run.parse_config(list(flags)), "tiny").log.out_dir
    assert key() == key("--data.manner_per=line", "--data.manners=eq")  # another task's start is shared
    manners = key("--data.task=manners")
    assert key("--data.task=manners", "--data.manner_per=answer") == manners  # the default keeps older names
    assert key("--data.task=manners", "--data.manner_per=line") != manners


def test_constant_reward_control_zeroes_the_advantages_while_the_discriminator_trains(tiny_dir, tokenizer):
    from test_gad import _critic, _gad_rollouts, gad_config
    from test_run import ONE_PROCESS, _policy
    from microbatch import Models
    from objectives.gad import gad_rewards
    cfg = gad_config("--rollout.n=3", "--gad.reward=constant")
    rollouts = _gad_rollouts(tokenizer, cfg)
    critic = _critic(tiny_dir, lr=1e-2)
    seqs = [r.prompt_ids + r.response_ids for r in rollouts]
    pre = critic.score(seqs, tokenizer.pad_token_id, "cpu")
    metrics = gad_rewards(rollouts, Models(_policy(tiny_dir), discriminator=critic), cfg, tokenizer.pad_token_id,
                          ONE_PROCESS)
    students = [r for r in rollouts if r.generated]
    assert [r.fields.advantage for r in students] == [0.0] * len(students) and metrics["gad/reward_mean"] == 0.0
    assert "gad/d_acc" in metrics and critic.steps == 1
    assert (critic.score(seqs, tokenizer.pad_token_id, "cpu") - pre).abs().max() > 1e-2  # it trained
    assert all(r.fields.trains_policy for r in students)  # in the GAD stage the KL to the start still moves it

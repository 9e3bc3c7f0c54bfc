"""Tests for feedback/: reward parsing and feedback texts (math, multiple choice, strops) and the
reward-function plumbing. The code reward is in test_code.py, its sandbox in test_sandbox.py."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feedback import (TRUNCATION_FEEDBACK, Reward, cut, get_reward_fn, io_fields, score, score_batch,
                      wrong_answer_feedback)
from feedback.math import FORMAT_FEEDBACK as MATH_FORMAT_FEEDBACK
from feedback.math import extract_answer, math_reward, normalize
from feedback.mc import extract_choice, mc_reward
from tasks.quiz import parse_results
from tasks.quiz import reward as quiz_reward
from tasks.strops import OPS, extract_program, parse_program, run_program
from tasks.strops import reward as strops_reward



# -----------------------------------------------------------------------------
# math

@pytest.mark.parametrize("response, expected", [
    ("The sum is 40 + 2.\nAnswer: 42", "42"),
    ("Answer: 42.", "42"),
    ("**Answer:** -7 apples", "-7"),
    ("Answer:\n\n  1,234", "1,234"),
    ("so x = \\boxed{\\frac{1}{2}} and later 3", "\\frac{1}{2}"),  # boxed beats the last number
    ("\\boxed{\\{1, 2\\}} is it", "\\{1, 2\\}"),  # nested braces
    ("first \\boxed{3}, then \\boxed{4}", "4"),  # the last one
    ("\\boxed{3} then a broken \\boxed{4", "3"),  # unbalanced last box is skipped
    ("Answer: $\\frac{3}{4}$", "\\frac{3}{4}"),  # latex after Answer: stays whole
    ("I computed 12 then 15, so 17", "17"),  # fallback: last number
    ("no numbers here", None),
])
def test_math_extract(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize("a, b", [
    ("1,234", "1234"), ("42.0", "42"), ("+5", "5"), (" 7 ", "7"), ("0.50", "0.5"), ("$12$", "12"),
    ("-0.0", "0"), ("\\dfrac{1}{2}", "\\frac{1}{2}"), ("1 000", "1000"), ("12.", "12"),
])
def test_math_normalize_equal(a, b):
    assert normalize(a) == normalize(b)


@pytest.mark.parametrize("a, b", [("1,2", "12"), ("42.01", "42"), ("-5", "5"), ("1/2", "2")])
def test_math_normalize_different(a, b):
    assert normalize(a) != normalize(b)


def test_math_reward():
    row = {"uid": "m1", "answer": "42"}
    assert math_reward("6*7 = 42\nAnswer: 42", row, False) == Reward(1.0)
    assert math_reward("\\boxed{42.0}", row, False).score == 1.0
    assert math_reward("Answer: +42", row, False).score == 1.0
    assert math_reward("Answer: 1,042", {"answer": "1042"}, False).score == 1.0
    wrong = math_reward("Answer: 41", row, False)
    assert wrong == Reward(0.0, "Your answer 41 is incorrect.")
    assert math_reward("I give up", row, False) == Reward(0.0, MATH_FORMAT_FEEDBACK)
    assert MATH_FORMAT_FEEDBACK.startswith("Your answer must end with")
    # even a correct answer scores 0 when the response was cut off: it never finished
    assert math_reward("Answer: 42 and then more and mo", row, True) == Reward(0.0, TRUNCATION_FEEDBACK)


def test_math_reveal_answer_only_when_asked():
    row = {"uid": "m1", "answer": "42"}
    assert math_reward("Answer: 41", row, False, reveal_answer=True).feedback == \
        "Your answer 41 is incorrect. The correct answer is 42."
    assert "42" in math_reward("Answer: 41", {**row, "reveal_answer": True}, False).feedback


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_math_feedback_never_contains_ground_truth(response):
    truth = "98765"
    r = math_reward(response, {"uid": "h", "answer": truth}, False)
    if truth not in response:
        assert truth not in r.feedback


@settings(max_examples=100, deadline=None)
@given(st.integers(-10**9, 10**9), st.integers(-10**9, 10**9))
def test_math_integer_answers(given_answer, truth):
    r = math_reward(f"Let me think.\nAnswer: {given_answer}", {"answer": str(truth)}, False)
    assert r.score == float(given_answer == truth)
    assert r.feedback == ("" if given_answer == truth else f"Your answer {given_answer} is incorrect.")


# -----------------------------------------------------------------------------
# multiple choice

@pytest.mark.parametrize("text, letter", [
    ("so \\boxed{B}", "B"), ("Answer: C", "C"), ("The answer is (D).", "D"), ("I like (A) more than (E)", "E"),
    ("A first guess, but finally G", "G"), ("nothing here", None), ("Answer: Because", None),
])
def test_mc_extract(text, letter):
    assert extract_choice(text) == letter


def test_mc_reward_score_only():
    row = {"uid": "q", "answer": "B"}
    assert mc_reward("Answer: B", row, False) == Reward(1.0)
    assert mc_reward("Answer: C", row, False) == Reward(0.0)  # no feedback: it would leak the answer
    assert mc_reward("\\boxed{b}", {"answer": "(b)"}, False).score == 0.0  # lower-case b is not a choice
    assert mc_reward("(B)", {"answer": "b"}, False).score == 1.0
    assert mc_reward("Answer: B", row, True) == Reward(0.0, TRUNCATION_FEEDBACK)


# -----------------------------------------------------------------------------
# strops

@pytest.mark.parametrize("op, s, out", [
    ("reverse", "abc", "cba"), ("upper", "aBc", "ABC"), ("lower", "AbC", "abc"), ("sort", "cab", "abc"),
    ("dedup", "abacbd", "abcd"), ("rotl", "abcd", "bcda"), ("rotr", "abcd", "dabc"),
    ("swapcase", "aBc", "AbC"), ("double", "ab", "aabb"), ("dropfirst", "abc", "bc"),
    ("droplast", "abc", "ab"), ("evens", "abcdef", "ace"), ("odds", "abcdef", "bdf"),
])
def test_strops_each_op(op, s, out):
    assert OPS[op](s) == out
    assert OPS[op]("") == ""  # every op is total


def test_strops_program():
    assert parse_program("reverse | upper") == ["reverse", "upper"]
    assert parse_program(" reverse|upper ") == ["reverse", "upper"]
    assert run_program(["reverse", "upper"], "abc") == "CBA"
    assert run_program("double | dropfirst | evens", "abc") == "abc"  # aabbcc -> abbcc -> abc
    assert run_program([], "xyz") == "xyz"
    with pytest.raises(ValueError, match=r"unknown op 'revers'.*Valid ops: reverse, upper"):
        parse_program("revers | upper")
    with pytest.raises(ValueError, match="empty program"):
        parse_program("   ")
    with pytest.raises(ValueError, match="empty step"):
        parse_program("reverse || upper")
    with pytest.raises(ValueError, match="longer than 100"):
        run_program("double | double | double | double", "a" * 10, max_len=100)


@pytest.mark.parametrize("response, program", [
    ("I think it reverses.\nProgram: reverse | upper\nDone.", "reverse | upper"),
    ("Program: `sort`", "sort"),
    ("Program:\n\n  rotl | rotl  \n", "rotl | rotl"),
    ("Program: a\nProgram: lower", "lower"),  # the last one
    ("reverse\nmore text", "reverse"),  # no marker: first line of the response
])
def test_strops_extract(response, program):
    assert extract_program(response) == program


def _row(pairs):
    return {"uid": "s1", "tests": [{"input": i, "output": o} for i, o in pairs]}


def test_strops_reward_exact_feedback():
    # the program "reverse" where "reverse | upper" was meant: 3 of 4 tests fail; the two with the
    # shortest inputs are shown, shortest first (ties keep their order)
    row = _row([("abcd", "DCBA"), ("xy", "YX"), ("", ""), ("pq", "QP")])
    r = strops_reward("Program: reverse", row, False)
    assert r == Reward(0.0, "Wrong Answer: 3 of 4 tests failed.\n\n"
                            "Input:\nxy\nOutput:\nyx\nExpected:\nYX\n\n"
                            "Input:\npq\nOutput:\nqp\nExpected:\nQP")
    assert strops_reward("Program: reverse | upper", row, False) == Reward(1.0)
    assert strops_reward("Program: upper | reverse", row, False) == Reward(1.0)


def test_strops_reward_empty_output_is_visible():
    r = strops_reward("Program: dropfirst", _row([("a", "A")]), False)
    assert r.feedback == "Wrong Answer: 1 of 1 tests failed.\n\nInput:\na\nOutput:\n(empty)\nExpected:\nA"


def test_strops_reward_format_errors():
    r = strops_reward("Program: reverse | shout", _row([("ab", "BA")]), False)
    assert r.score == 0.0
    assert r.feedback.startswith("Format Error: unknown op 'shout'. Valid ops: reverse, upper, lower, sort, dedup, "
                                 "rotl, rotr, swapcase, double, dropfirst, droplast, evens, odds.")
    assert strops_reward("Program:", _row([("ab", "BA")]), False).feedback.startswith("Format Error: empty program.")
    # a doubling chain cannot blow up memory: it is cut off and simply fails
    r = strops_reward("Program: " + " | ".join(["double"] * 80), _row([("ab", "ab")]), False)
    assert r.score == 0.0 and "output longer than" in r.feedback


def test_strops_reward_cut_limits():
    long_in = "a" * 600
    r = strops_reward("Program: upper", _row([(long_in, long_in)]), False)
    lines = r.feedback.split("\n")
    assert lines[2:] == ["Input:", "a" * 247 + "...", "Output:", "A" * 247 + "...",  # fields cut to 250 chars
                         "Expected:", "a" * 247 + "..."]
    assert len(r.feedback) <= 2000
    assert strops_reward("Program: upper", _row([("ab", "AB")]), True) == Reward(0.0, TRUNCATION_FEEDBACK)


def test_feedback_cut_helpers():
    assert cut("abcdef", 10) == "abcdef"
    assert cut("abcdefghijkl", 10) == "abcdefg..."
    assert cut("abcdefghijkl", 10, keep="tail") == "...fghijkl"
    fails = [io_fields("i" * 900, "o" * 900, "e" * 900)] * 3
    text = wrong_answer_feedback(fails, 5, field_chars=900, total_chars=2000)
    assert len(text) == 2000 and text.endswith("...") and text.startswith("Wrong Answer: 3 of 5 tests failed.")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=5),
       st.lists(st.text(alphabet="abcXYZ", max_size=8), min_size=1, max_size=4))
def test_strops_round_trip(ops, inputs):
    """What the data generator does: expected outputs from run_program; the true program then passes."""
    program = " | ".join(ops)
    row = _row([(s, run_program(program, s)) for s in inputs])
    assert run_program(parse_program(program), inputs[0]) == row["tests"][0]["output"]
    assert strops_reward(f"Let me see.\nProgram: {program}", row, False) == Reward(1.0)


# -----------------------------------------------------------------------------
# quiz

QUIZ_ROW = {"uid": "q1", "tests": [{"input": "a:7+8", "output": "15"}, {"input": "b:3*4", "output": "12"},
                                   {"input": "c:9-6", "output": "3"}]}


def test_quiz_reward_marks_each_line():
    assert quiz_reward("a:7+8=15\nb:3*4=12\nc:9-6=3", QUIZ_ROW, False) == Reward(1.0)
    # the default wording names no wrong result: a small teacher would copy it (docs/LOG.md: the decisive token)
    r = quiz_reward("a:7+8=15\nb:3*4=13\nc:9-6=2", QUIZ_ROW, False)
    assert r == Reward(0.0, "Wrong Answer: 2 of 3 results are wrong.\n"
                            "a:7+8=15 is right.\nb:3*4 is wrong.\nc:9-6 is wrong.")
    r = quiz_reward("a:7+8=15\nb:3*4=13\nc:9-6=2", {**QUIZ_ROW, "quiz_feedback": "values"}, False)
    assert r == Reward(0.0, "Wrong Answer: 2 of 3 results are wrong.\n"
                            "a:7+8=15 is right.\nb:3*4 is not 13.\nc:9-6 is not 2.")
    with pytest.raises(ValueError, match="row\\['quiz_feedback'\\]='numbers': choose from"):
        quiz_reward("a:7+8=15\nb:3*4=13\nc:9-6=2", {**QUIZ_ROW, "quiz_feedback": "numbers"}, False)
    # only the results count, line by line: a heading, spaces, a final period and a miscopied question do not
    assert quiz_reward("Here:\n7 + 8 = 15\nb:3*5=12.\n 9-6 = 3 ", QUIZ_ROW, False) == Reward(1.0)
    assert quiz_reward("a:7+8=15\nb:3*4=12\nc:9-6=3", QUIZ_ROW, True) == Reward(0.0, TRUNCATION_FEEDBACK)


@pytest.mark.parametrize("response, problem", [
    ("a:7+8=15\nb:3*4=12", "expected 3 lines 'label:question=result', found 2"),
    ("15, 12, 3", "expected 3 lines 'label:question=result', found 0"),
    ("a:7+8=15\nb:3*4=twelve\nc:9-6=3", "line 2 ('b:3*4=twelve') does not end in '= <whole number>'"),
    ("a:7+8=15\nb:3*4=12\nc:9-6=3\nd:1+1=2", "expected 3 lines 'label:question=result', found 4"),
])
def test_quiz_format_errors(response, problem):
    r = quiz_reward(response, QUIZ_ROW, False)
    assert r.score == 0.0
    assert r.feedback == (f"Format Error: {problem}. Write one line per question, in the order asked, "
                          "for example 'a:7+8=<result>'.")


def test_quiz_parse_results():
    assert parse_results("a=1\nb = -2\nc=+3.", 3) == [1, -2, 3]
    with pytest.raises(ValueError, match="found 1"):
        parse_results("x=1", 2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from("+-*"), st.integers(0, 30)), min_size=1, max_size=6),
       st.data(), st.sampled_from(["marks", "values"]))
def test_quiz_feedback_never_contains_a_missing_result(questions, draw, wording):
    """The feedback repeats the reply's right results and nothing else of the answer: for a wrong
    line, the correct result is never shown (checked against an independent evaluation)."""
    value = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    tests = [{"input": f"{chr(97 + i)}:{a}{op}{b}", "output": str(value[op](a, b))}
             for i, (a, op, b) in enumerate(questions)]
    given_results = [draw.draw(st.sampled_from([int(t["output"]), int(t["output"]) + 1, 0, -3])) for t in tests]
    response = "\n".join(f"{t['input']}={v}" for t, v in zip(tests, given_results))
    r = quiz_reward(response, {"uid": "q", "tests": tests, "quiz_feedback": wording}, False)
    wrong = [i for i, t in enumerate(tests) if str(given_results[i]) != t["output"]]
    assert r.score == float(not wrong)
    if not wrong:
        assert r.feedback == ""
        return
    reference = "\n".join(f"{t['input']}={t['output']}" for t in tests)
    assert reference not in r.feedback
    lines = r.feedback.split("\n")
    assert lines[0] == f"Wrong Answer: {len(wrong)} of {len(tests)} results are wrong."
    for i, (t, line) in enumerate(zip(tests, lines[1:])):
        if i in wrong and wording == "marks":
            assert line == f"{t['input']} is wrong."
        elif i in wrong:
            assert line == f"{t['input']} is not {given_results[i]}."  # the reply's result, never the correct one
            assert not re.search(rf"(?<![\d-]){re.escape(t['output'])}(?!\d)", line.split(" is not ")[1]), line
        else:
            assert line == f"{t['input']}={t['output']} is right."


# -----------------------------------------------------------------------------
# score / score_batch / get_reward_fn

def test_score_normalises_return_types():
    row = {"uid": "r1"}
    assert score(lambda r, row, t: 1, "x", row, False) == Reward(1.0)
    assert score(lambda r, row, t: True, "x", row, False) == Reward(1.0)
    assert score(lambda r, row, t: {"score": 0.5, "feedback": "meh"}, "x", row, False) == Reward(0.5, "meh")
    assert score(lambda r, row, t: Reward(0.25, "fb"), "x", row, False) == Reward(0.25, "fb")
    # a truncated response always carries the truncation feedback, also from user functions
    assert score(lambda r, row, t: 1.0, "x", row, True) == Reward(1.0, TRUNCATION_FEEDBACK)
    assert score(lambda r, row, t: {"score": 0, "feedback": "bad"}, "x", row, True).feedback == \
        TRUNCATION_FEEDBACK + "\n\nbad"


def test_score_raising_function_is_contained():
    def broken(response, row, truncated):
        return 1 / 0

    r = score(broken, "x", {"uid": "boom"}, False)
    assert r.score == 0.0 and r.feedback == ""
    assert r.error.startswith("ZeroDivisionError: division by zero") and "boom" in r.error


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "1.0", None, [1.0], {"feedback": "no score"}])
def test_score_bad_values_are_errors(value):
    r = score(lambda resp, row, t: value, "x", {"uid": "u-bad"}, False)
    assert r.score == 0.0 and r.feedback == "" and "u-bad" in r.error


def test_score_batch_order_and_lengths():
    fn = get_reward_fn("math")
    rows = [{"uid": str(i), "answer": str(i)} for i in range(20)]
    out = score_batch(fn, [f"Answer: {i if i % 3 else -1}" for i in range(20)], rows, [False] * 20, workers=4)
    assert [r.score for r in out] == [0.0 if i % 3 == 0 else 1.0 for i in range(20)]
    with pytest.raises(ValueError):
        score_batch(fn, ["a"], rows, [False])


def test_get_reward_fn_builtins_and_modules():
    assert get_reward_fn("math") is math_reward
    assert get_reward_fn("strops") is strops_reward
    assert get_reward_fn("code").__name__ == "code_reward"
    assert get_reward_fn("mc") is mc_reward
    assert get_reward_fn("feedback.math:math_reward") is math_reward


def test_get_reward_fn_from_file(tmp_path, monkeypatch):
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "my_reward.py").write_text(
        "from dataclasses import dataclass\n\n"
        "@dataclass\nclass Cfg:\n    bonus: float = 0.5\n\n"
        "def length_reward(response, row, truncated):\n"
        "    return {'score': len(response) / 10 + Cfg().bonus, 'feedback': 'be longer'}\n"
        "NOT_CALLABLE = 3\n"
        "def broken(response, row, truncated):\n    raise RuntimeError('user bug')\n")
    monkeypatch.chdir(tmp_path)
    fn = get_reward_fn("rewards/my_reward.py:length_reward")
    assert score(fn, "abcde", {"uid": "f"}, False) == Reward(1.0, "be longer")
    fn = get_reward_fn(str(tmp_path / "rewards" / "my_reward.py") + ":broken")
    r = score(fn, "x", {"uid": "f2"}, False)
    assert r.score == 0.0 and "RuntimeError: user bug" in r.error and "my_reward.py" in r.error


@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown reward function 'nope'"),
    ("no_such_module_xyz:fn", "cannot import reward function 'no_such_module_xyz:fn'"),
    ("missing/file.py:fn", "cannot import reward function 'missing/file.py:fn'"),
    ("feedback.math:no_such_fn", "has no attribute 'no_such_fn'"),
    ("os:sep", "is not callable"),
])
def test_get_reward_fn_bad_specs(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        get_reward_fn(spec)


def test_get_reward_fn_broken_file(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    with pytest.raises(ValueError, match=r"cannot import reward function .*bad\.py:f.*SyntaxError"):
        get_reward_fn(f"{bad}:f")


def test_feedback_signal_classes_each_token_of_a_quiz_answer(tokenizer):
    """bench/feedback_signal.py's token classes, against a hand-worked answer: a line marked
    wrong ("a:11*3=34": the decisive token is the 4, where the correct result has a 3), a right
    line, and a wrong line whose first result character is already wrong."""
    import os
    import sys
    sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from feedback_signal import token_classes
    row = {"tests": [{"input": "a:11*3", "output": "33"}, {"input": "b:6*20", "output": "120"},
                     {"input": "c:6*16", "output": "96"}]}
    text = "a:11*3=34\nb:6*20=120\nc:6*16=69"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    classes, correct = token_classes(tokenizer, ids, text, row)
    line_a, line_b, line_c = len("a:11*3=34\n"), len("b:6*20=120\n"), len("c:6*16=69")
    assert classes == (["wrong line, question"] * 7 + ["wrong line, result"] * 3 + ["right line, question"] * 7
                       + ["right line, result"] * 4 + ["wrong line, question"] * 7 + ["wrong line, result"] * 2
                       + ["end"])
    assert len(ids) == line_a + line_b + line_c + 1  # one token per character, and the end
    decisive = {k: tokenizer.convert_ids_to_tokens(c) for k, c in enumerate(correct) if c is not None}
    assert decisive == {8: "3", line_a + line_b + 7: "9"}

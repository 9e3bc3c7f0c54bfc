"""Arithmetic quizzes: several questions, one answer each, and a checker that marks each answer.

The synthetic task whose feedback tells the teacher what the prompt cannot. A quiz is a few
labelled questions like "a:7+8", one per line (the row's `tests`: input = question, output
= its result); the model answers line by line, "a:7+8=15". The score is 1 only if every result
is right, as with a program that must pass every test. The feedback on a wrong reply marks
each line right or wrong, the way a grader points at the faulty steps of a multi-step answer:

    Wrong Answer: 2 of 4 results are wrong.
    a:7+8=15 is right.
    b:3*4 is wrong.
    ...

A model cannot check its own answers, so this is information the prompt does not hold:
the teacher shown it can keep the answers marked right and needs to redo only the wrong ones.
It never shows a correct result the reply did not already contain. `--data.quiz_feedback=values`
names the wrong result ("b:3*4 is not 13."): more information, which the tiny teacher misuses
by copying it (docs/LOG.md: the decisive token).
"""

from __future__ import annotations

import operator
import re

from feedback import TOTAL_CHARS, Reward, cut, truncated_reward

QUIZ_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# How a wrong line reads. "values": "b:3*4 is not 13." names the wrong result, which a small
# teacher copies (docs/LOG.md: the decisive token); "marks": "b:3*4 is wrong." leaves nothing to copy.
QUIZ_FEEDBACK = ("marks", "values")  # the first is the default (data.TaskConfig.quiz_feedback)
LINE_RESULT = re.compile(r"=\s*([-+]?\d+)\s*\.?\s*$")


def parse_results(response: str, n: int) -> list[int]:
    """The results of the n lines "label:question=result" of a response, in order. Lines without
    "=" are ignored (a model may write a heading). Raises ValueError saying what is wrong."""
    lines = [ln.strip() for ln in response.splitlines() if "=" in ln]
    if len(lines) != n:
        raise ValueError(f"expected {n} lines 'label:question=result', found {len(lines)}")
    results = []
    for i, line in enumerate(lines, 1):
        m = LINE_RESULT.search(line)
        if not m:
            raise ValueError(f"line {i} ({cut(line, 40)!r}) does not end in '= <whole number>'")
        results.append(int(m.group(1)))
    return results


def quiz_reward(response: str, row: dict, truncated: bool) -> Reward:
    """1.0 iff every result is right. Feedback: the format error, or each question with the
    reply's result, marked right or wrong (never the correct result of a wrong one)."""
    tests = row.get("tests")
    if not tests:
        raise ValueError("quiz reward needs row['tests'] (one {input: question, output: result} per question)")
    if truncated:
        return truncated_reward()
    try:
        results = parse_results(response, len(tests))
    except ValueError as e:
        return Reward(0.0, cut(f"Format Error: {e}. Write one line per question, in the order asked, "
                               f"for example '{tests[0]['input']}=<result>'.", TOTAL_CHARS))
    right = [str(r) == t["output"] for r, t in zip(results, tests)]
    if all(right):
        return Reward(1.0)
    wording = row.get("quiz_feedback", QUIZ_FEEDBACK[0])
    if wording not in QUIZ_FEEDBACK:
        raise ValueError(f"row['quiz_feedback']={wording!r}: choose from {QUIZ_FEEDBACK}")
    # A wrong line never reads "question=...": a model copying its right lines must not copy it.
    lines = [f"Wrong Answer: {right.count(False)} of {len(tests)} results are wrong."]
    lines += [f"{t['input']}={r} is right." if ok else
              f"{t['input']} is wrong." if wording == "marks" else f"{t['input']} is not {r}."
              for r, t, ok in zip(results, tests, right)]
    return Reward(0.0, cut("\n".join(lines), TOTAL_CHARS))

"""The quiz: labelled arithmetic lines, answered one per line, and a checker that marks each line.

A quiz is a few questions like "a:7+8" (the row's `tests`: input = question, output = its
result), answered "a:7+8=15"; the score is 1 only if every result is right. The feedback marks
each line ("a:7+8=15 is right.", "b:3*4 is wrong."): information the prompt does not hold, and
never a correct result the reply did not contain (docs/data.md, Synthetic tasks; docs/results.md,
SDPO vs GRPO on the quiz).
"""
import operator
import random
import re
import string
from dataclasses import dataclass

from errors import FlagError
from feedback import TOTAL_CHARS, Reward, cut, truncated_reward

REWARD = "quiz"  # its rows name this file's `reward`
INSTRUCTION = "Solve each line in order, one per line: 'label:question=result'."
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# How a wrong line reads. "values": "b:3*4 is not 13." names the wrong result, which a small
# teacher copies (docs/LOG.md: the decisive token); "marks": "b:3*4 is wrong." leaves nothing to copy.
FEEDBACK = ("marks", "values")  # the first is the default (Flags.quiz_feedback)
LINE_RESULT = re.compile(r"=\s*([-+]?\d+)\s*\.?\s*$")


@dataclass
class Flags:
    """Its difficulty and its feedback's wording (--data.*)."""
    quiz_questions: int = 3  # questions per quiz; all must be right
    # operands drawn from 2..quiz_max. 20: 722 facts, more than the tiny model learns in its warm
    # start, so lines the feedback marks right are worth copying. At 9 it learns all 128 and
    # solves every quiz: no group fails, nothing to teach (docs/LOG.md).
    quiz_max: int = 20
    quiz_ops: str = "+*"  # operators drawn from (+ - *)
    quiz_feedback: str = FEEDBACK[0]  # a wrong line's feedback: "marks" (b:3*4 is wrong.) or "values" (b:3*4 is not 13.)


# The recipe (on top of tiny_models.RECIPE). Copying what a context shows forms only with half the
# warm start's examples feedback contexts, its first 300 steps all contexts so that it forms before
# the facts do; the student's success then climbs steeply, so the warm start stops at an estimated
# held-out success inside the band where RL has room. Each objective at the best rate of an lr grid;
# SDPO with reverse KL, the paper's choice with rich feedback. The measurements: docs/results.md
# (SDPO vs GRPO on the quiz), docs/gad.md.
RECIPE = {
    "train.warm_start_steps": 2000,  # at most: the target stops it
    "train.warm_start_demo_frac": 0.3,
    "train.warm_start_feedback_frac": 0.5,
    "train.warm_start_target": 0.3,
    "train.warm_start_context_steps": 300,
    "optim.lr": 3e-5,
    "sdpo.alpha": 1.0,
    "gad.teacher_steps": 2000,  # GAD's self-made teacher: well above the student (docs/gad.md)
}
RECIPE_BY_ALGO = {
    "sdpo": {"optim.lr": 1.2e-4},
    "grpo": {"optim.lr": 6e-5},
    # the discriminator reads the mean of the response's states, at the rate it separated best (docs/gad.md)
    "gad": {"gad.lr": 3e-4, "gad.pool": "mean"},
}


def draw_questions(rng: random.Random, cfg: Flags) -> list[tuple]:
    """(label, a, op, b, result) of each of a quiz's --data.quiz_questions questions."""
    if not 1 <= cfg.quiz_questions <= 26:
        raise FlagError(f"--data.quiz_questions={cfg.quiz_questions}: questions are labelled a-z, so 1 to 26")
    questions = []
    for label in string.ascii_lowercase[:cfg.quiz_questions]:
        a, b, op = rng.randint(2, cfg.quiz_max), rng.randint(2, cfg.quiz_max), rng.choice(cfg.quiz_ops)
        a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)  # results stay non-negative
        # The label lets a small model find its place: it copies the line after "c:" (induction).
        questions.append((label, a, op, b, OPS[op](a, b)))
    return questions


def quiz_row(name: str, questions: list[tuple], instruction: str) -> dict:
    """The uid, prompt, answer and tests of a row of draw_questions' questions (the manners task's too)."""
    tests = [{"input": f"{label}:{a}{op}{b}", "output": str(result)} for label, a, op, b, result in questions]
    return {
        "uid": f"{name}:" + ",".join(t["input"] for t in tests),
        "messages": [{"role": "user", "content": "\n".join(t["input"] for t in tests) + f"\n{instruction}"}],
        "answer": ", ".join(t["output"] for t in tests),
        "tests": tests,
    }


def make_row(rng: random.Random, cfg: Flags) -> dict:
    row = quiz_row("quiz", draw_questions(rng, cfg), INSTRUCTION)
    if cfg.quiz_feedback not in FEEDBACK:
        raise FlagError(f"--data.quiz_feedback={cfg.quiz_feedback!r}: choose from {FEEDBACK}")
    reference = "\n".join(f"{t['input']}={t['output']}" for t in row["tests"])
    return {**row, "reference": reference, "reward": REWARD, "quiz_feedback": cfg.quiz_feedback}


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


def reward(response: str, row: dict, truncated: bool) -> Reward:
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
    wording = row.get("quiz_feedback", FEEDBACK[0])
    if wording not in FEEDBACK:
        raise ValueError(f"row['quiz_feedback']={wording!r}: choose from {FEEDBACK}")
    # A wrong line never reads "question=...": a model copying its right lines must not copy it.
    lines = [f"Wrong Answer: {right.count(False)} of {len(tests)} results are wrong."]
    lines += [f"{t['input']}={r} is right." if ok else
              f"{t['input']} is wrong." if wording == "marks" else f"{t['input']} is not {r}."
              for r, t, ok in zip(results, tests, right)]
    return Reward(0.0, cut("\n".join(lines), TOTAL_CHARS))


def wrong_lines(n: int, rng: random.Random) -> list[bool]:
    """Which of a quiz's n lines a plausible wrong reply gets wrong: each with probability 1/3,
    at least one."""
    wrong = [rng.random() < 1 / 3 for _ in range(n)]
    if not any(wrong):
        wrong[rng.randrange(n)] = True
    return wrong


def wrong_response(row: dict, rng: random.Random) -> str:
    """Each result wrong with probability 1/3 (at least one), by a slip a model makes: off by
    one or two, or a neighbouring table entry (7*8 answered as 7*7 or 7*9)."""
    tests = row["tests"]
    wrong = wrong_lines(len(tests), rng)
    answers = []
    for t, w in zip(tests, wrong):
        value = int(t["output"])
        if w:
            a, op, b = re.search(r"(\d+)([-+*])(\d+)$", t["input"]).groups()
            slips = [value + d for d in (-2, -1, 1, 2)] + [OPS[op](int(a), int(b) + d) for d in (-1, 1)]
            value = rng.choice([s for s in slips if s != value and s >= 0] or [value + 1])
        answers.append(f"{t['input']}={value}")
    return "\n".join(answers)

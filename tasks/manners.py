"""Manners: the quiz's questions answered in one of two manners, GAD's testbed.

A row is a quiz (the --data.quiz_* flags) whose reference answers every line in ONE manner,
drawn per row from --data.manners and not named by the prompt:

    eq      a) 7*8 = 56            is      (a) 7*8 is 56.         plain   a:7*8=56

The checker scores correctness AND coherence: a blend of manners scores 0 whatever its results.
What it tests and why: docs/gad.md, The manners testbed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from errors import FlagError
from feedback import TOTAL_CHARS, Reward, cut, truncated_reward
from tasks.quiz import draw_questions, quiz_row

REWARD = "manners"  # its rows name this file's `reward`

# name -> (how a line is written, the regex that reads it: label, a, op, b, result)
MANNERS = {
    "eq": ("{label}) {a}{op}{b} = {result}", r"([a-z])\) (\d+)([-+*])(\d+) = (-?\d+)"),
    "is": ("({label}) {a}{op}{b} is {result}.", r"\(([a-z])\) (\d+)([-+*])(\d+) is (-?\d+)\."),
    "plain": ("{label}:{a}{op}{b}={result}", r"([a-z]):(\d+)([-+*])(\d+)=(-?\d+)"),
}
LINE_PATTERNS = {name: re.compile(pattern) for name, (_, pattern) in MANNERS.items()}
DEFAULT_MANNERS = "eq,is"  # the teacher's two (Flags.manners); a file's rows without "manners" get them
INSTRUCTION = "Solve each line in order, one per line."


@dataclass
class Flags:
    """Which manners a reference is drawn from (--data.*); its quizzes take the quiz's flags."""
    manners: str = DEFAULT_MANNERS  # comma-separated, one drawn per row (eq, is, plain)
    manner_per: str = "answer"  # answer: one manner per reference; line: one per line, a blend (a student's start)


def check_manners(value: str) -> list[str]:
    """The manners a --data.manners value lists (comma-separated, known, no repeats)."""
    names = value.split(",")
    if not value or set(names) - set(MANNERS) or len(set(names)) != len(names):
        raise FlagError(f"--data.manners={value!r}: a comma-separated list of distinct manners from "
                        f"{', '.join(MANNERS)} (for example {DEFAULT_MANNERS})")
    return names


def write_line(manner: str, label: str, a: int, op: str, b: int, result) -> str:
    return MANNERS[manner][0].format(label=label, a=a, op=op, b=b, result=result)


def check_flags(cfg: Flags):
    """--data.manners and --data.manner_per, checked before any work (else they fail once rows are drawn)."""
    check_manners(cfg.manners)
    if cfg.manner_per not in ("answer", "line"):
        raise FlagError(f"--data.manner_per={cfg.manner_per!r}: 'answer' (one manner per reference) or 'line' "
                        f"(one per line: blends)")


def make_row(rng, cfg) -> dict:
    """One quiz (the quiz's --data.quiz_* flags) whose reference is in one manner of cfg.manners,
    drawn per row after the questions (so the questions, the uid and the split do not depend
    on the manners); with --data.manner_per=line, one drawn per line (a blend where they differ)."""
    questions = draw_questions(rng, cfg)
    check_flags(cfg)
    manners = cfg.manners.split(",")
    drawn = ([rng.choice(manners) for _ in questions] if cfg.manner_per == "line"
             else [rng.choice(manners)] * len(questions))  # one manner per line
    reference = "\n".join(write_line(manner, *q) for manner, q in zip(drawn, questions))
    return {**quiz_row("manners", questions, INSTRUCTION), "reference": reference, "reward": REWARD,
            "manners": manners}


def line_manners(response: str) -> list[str | None]:
    """The manner of each non-empty line of a response (None: a line in no known manner)."""
    return [next((name for name, p in LINE_PATTERNS.items() if p.fullmatch(line)), None)
            for line in (ln.strip() for ln in response.splitlines()) if line]


def is_blend(response: str) -> bool:
    """Whether a response mixes manners: its lines in two or more known manners (the bench's blend rate)."""
    return len({m for m in line_manners(response) if m is not None}) > 1


def reward(response: str, row: dict, truncated: bool) -> Reward:
    """1.0 iff the reply has one line per question, all in one accepted manner (row["manners"]),
    each restating its question, every result right. Feedback, first failure first: the format
    (a line in no accepted manner, a wrong line count, a line answering another question), the
    blend (which lines are in which manner), then the wrong results marked line by line."""
    tests = row.get("tests")
    if not tests:
        raise ValueError("manners reward needs row['tests'] (one {input: 'a:7*8', output: '56'} per question)")
    # a data file's rows (the GAD teacher's answers, warm_start.teacher_data) carry it as a column
    accepted = row.get("manners") or row.get("columns", {}).get("manners") or DEFAULT_MANNERS.split(",")
    if truncated:
        return truncated_reward()
    lines = [ln.strip() for ln in response.splitlines() if ln.strip()]
    examples = " or ".join(f"'{example(m, tests[0])}'" for m in accepted)
    fmt = lambda problem: Reward(0.0, cut(f"Format Error: {problem}. Write one line per question, in the order "
                                          f"asked, every line in one manner: {examples}.", TOTAL_CHARS))
    if len(lines) != len(tests):
        return fmt(f"expected {len(tests)} lines, found {len(lines)}")
    parsed = []
    for i, (line, test) in enumerate(zip(lines, tests), 1):
        manner = next((m for m in accepted if LINE_PATTERNS[m].fullmatch(line)), None)
        if manner is None:
            other = next((m for m in MANNERS if LINE_PATTERNS[m].fullmatch(line)), None)
            return fmt(f"line {i} ({cut(line, 40)!r}) is in " + (f"the {other} manner, which is not accepted here"
                                                                   if other else "no accepted manner"))
        label, a, op, b, result = LINE_PATTERNS[manner].fullmatch(line).groups()
        if f"{label}:{int(a)}{op}{int(b)}" != test["input"]:
            return fmt(f"line {i} ({cut(line, 40)!r}) does not answer {test['input']}")
        parsed.append((manner, int(result)))
    problems = []
    used = [m for m, _ in parsed]
    if len(set(used)) > 1:
        by_manner = {m: [i for i, u in enumerate(used, 1) if u == m] for m in dict.fromkeys(used)}
        problems.append("Blend: " + "; ".join(f"line{'s' * (len(ls) > 1)} {', '.join(map(str, ls))} in the {m} "
                                              f"manner" for m, ls in by_manner.items())
                        + ". Write every line in the same manner.")
    right = [str(r) == t["output"] for (_, r), t in zip(parsed, tests)]
    if not all(right):
        problems.append(f"Wrong Answer: {right.count(False)} of {len(tests)} results are wrong.")
        problems += [f"{line} is right." if ok else f"{t['input']} is wrong." for line, t, ok in zip(lines, tests, right)]
    return Reward(0.0, cut("\n".join(problems), TOTAL_CHARS)) if problems else Reward(1.0)


def example(manner: str, test: dict) -> str:
    """A test's question written in a manner, its result left as <result>."""
    label, a, op, b = re.fullmatch(r"([a-z]):(\d+)([-+*])(\d+)", test["input"]).groups()
    return write_line(manner, label, a, op, b, "<result>")


# The task's recipe (on top of the tiny model's, tiny_models.RECIPE): the tiny model learns the 128 facts of
# operands 2..9 quickly, so that what distillation changes is the manner; a plain SFT warm start
# (no SDPO teacher contexts: this is GAD's testbed). Values measured: docs/gad.md.
RECIPE = {
    "data.quiz_max": 9,
    "train.warm_start_steps": 600,
    "train.warm_start_demo_frac": 0.0,
    "train.warm_start_feedback_frac": 0.0,
    "train.warm_start_context_steps": 0,
    "gad.teacher_steps": 1000,
}
RECIPE_BY_ALGO = {"gad": {"gad.lr": 3e-4, "gad.pool": "mean"}}

"""The string-program task (strops), the default job: infer a program of string ops from examples.

A program is op names joined by " | ", applied left to right: "reverse | upper" maps "abc" to
"CBA". The generator computes each case's output with OPS / run_program; the model has to infer
the program from the shown examples, and `reward` checks it against the row's tests with
LeetCode-style feedback: the failing tests tell the teacher exactly what went wrong.
"""
import random
from dataclasses import dataclass
from typing import Callable

from feedback import (TOTAL_CHARS, Reward, cut, io_fields, row_field, shortest_first, truncated_reward,
                      wrong_answer_feedback)

REWARD = "strops"  # its rows name this file's `reward`
MAX_OUTPUT_CHARS = 10_000  # model programs are cut off beyond this (plus the expected length)

OPS: dict[str, Callable[[str], str]] = {
    "reverse": lambda s: s[::-1],
    "upper": str.upper,
    "lower": str.lower,
    "sort": lambda s: "".join(sorted(s)),
    "dedup": lambda s: "".join(dict.fromkeys(s)),  # drop repeated chars, keep first occurrences
    "rotl": lambda s: s[1:] + s[:1],  # rotate left by one: abc -> bca
    "rotr": lambda s: s[-1:] + s[:-1],  # rotate right by one: abc -> cab
    "swapcase": str.swapcase,
    "double": lambda s: "".join(c + c for c in s),
    "dropfirst": lambda s: s[1:],
    "droplast": lambda s: s[:-1],
    "evens": lambda s: s[0::2],  # chars at positions 0, 2, 4, ...
    "odds": lambda s: s[1::2],  # chars at positions 1, 3, 5, ...
}
# The valid ops are named in the prompt: a model not trained on the task cannot guess them.
INSTRUCTION = ("Write the program that maps each input to its output, using the ops "
               + ", ".join(OPS) + ". Reply with 'Program: op | op'.")


@dataclass
class Flags:
    """Its difficulty (--data.*)."""
    strops_max_ops: int = 1  # program length 1..max_ops (1: a single op, within the tiny model's reach)
    strops_str_len: int = 5  # input string length
    strops_shown: int = 2  # examples shown in the prompt
    strops_hidden: int = 2  # extra test cases only the checker sees
    strops_alphabet: str = "abcdefgh"


# The recipe (the tiny model's values on top of tiny_models.RECIPE; `--recipe auto` picks it): a 200-step
# warm start. Copying a shown solution forms after mostly-demonstration steps, and at 200 the bare
# student leaves room for 40 RL steps to gain, where a longer warm start left little. What the
# default job measures, and the warm starts compared: docs/results.md (The default job), docs/LOG.md.
RECIPE = {
    "train.warm_start_steps": 200,
}


def make_row(rng: random.Random, cfg: Flags) -> dict:
    names = sorted(OPS)
    program = [rng.choice(names) for _ in range(rng.randint(1, cfg.strops_max_ops))]
    # Distinct characters make most ops observable; sort/dedup still differ on repeats.
    cases = []
    while len(cases) < cfg.strops_shown + cfg.strops_hidden:
        s = "".join(rng.choice(cfg.strops_alphabet) for _ in range(cfg.strops_str_len))
        if s not in [c["input"] for c in cases]:
            cases.append({"input": s, "output": run_program(program, s)})
    shown = "\n".join(f"{c['input']} -> {c['output']}" for c in cases[: cfg.strops_shown])
    text = " | ".join(program)
    return {
        "uid": "strops:" + text + ":" + ",".join(c["input"] for c in cases),
        "messages": [{"role": "user", "content": f"{shown}\n{INSTRUCTION}"}],
        "answer": text,
        "tests": cases,
        "reference": f"Program: {text}",
        "reward": REWARD,
    }


def parse_program(text: str) -> list[str]:
    """'reverse | upper' -> ['reverse', 'upper']. Raises ValueError naming the problem (empty
    program, empty step, unknown op) and listing the valid ops."""
    valid = ", ".join(OPS)
    if not text.strip():
        raise ValueError(f"empty program. Valid ops: {valid}")
    ops = [op.strip() for op in text.split("|")]
    for op in ops:
        if not op:
            raise ValueError(f"empty step in program {text.strip()!r}. Valid ops: {valid}")
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}. Valid ops: {valid}")
    return ops


def run_program(ops: list[str] | str, s: str, max_len: int | None = None) -> str:
    """Apply the ops left to right; a string is parsed first. With max_len, raise ValueError as soon
    as the string grows beyond it ("double" repeated 40 times would otherwise eat all memory)."""
    if isinstance(ops, str):
        ops = parse_program(ops)
    for op in ops:
        s = OPS[op](s)
        if max_len is not None and len(s) > max_len:
            raise ValueError(f"(output longer than {max_len} characters)")
    return s


def extract_program(response: str) -> str:
    """The text after the last "Program:" if any, else the whole response; its first non-empty
    line, stripped (and without surrounding backticks, as models like to write `reverse | upper`)."""
    idx = response.rfind("Program:")
    text = response[idx + len("Program:"):] if idx >= 0 else response
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    return line.strip().strip("`").strip()


def reward(response: str, row: dict, truncated: bool) -> Reward:
    """1.0 iff the program maps every test input to its output. Feedback: the format error, or up to
    two failing tests (shortest input first) with input, output and expected."""
    tests = row_field(row, "tests", "strops")
    if truncated:
        return truncated_reward()
    program = extract_program(response)
    try:
        ops = parse_program(program)
    except ValueError as e:
        return Reward(0.0, cut(f'Format Error: {e}. Write the program as op names joined by " | ", '
                               'for example "Program: reverse | upper".', TOTAL_CHARS))
    failures = []
    for i in shortest_first(tests):
        inp, expected = tests[i]["input"], tests[i]["output"]
        try:
            out = run_program(ops, inp, max_len=MAX_OUTPUT_CHARS + len(expected))
        except ValueError as e:  # too long, so certainly not the expected output
            out = str(e)
        if out != expected:
            failures.append(io_fields(inp, out, expected))
    if not failures:
        return Reward(1.0)
    return Reward(0.0, wrong_answer_feedback(failures, len(tests)))


def wrong_response(row: dict, rng: random.Random) -> str:
    """A program of one or two ops that fails at least one of the row's tests."""
    while True:
        program = " | ".join(rng.choice(sorted(OPS)) for _ in range(rng.randint(1, 2)))
        if any(run_program(program, t["input"]) != t["output"] for t in row["tests"]):
            return f"Program: {program}"

"""A tiny string-transformation DSL: the synthetic "rich feedback" task.

A program is op names joined by " | ", applied left to right: "reverse | upper" maps "abc" to
"CBA". The data generator uses OPS / run_program to compute expected outputs; the model has to
infer the program from examples, and `strops_reward` checks it against the row's tests with
LeetCode-style feedback: the failing tests tell the teacher exactly what went wrong.
"""

from __future__ import annotations

from typing import Callable

from feedback import (TOTAL_CHARS, Reward, cut, io_fields, row_field, shortest_first, truncated_reward,
                      wrong_answer_feedback)

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


def strops_reward(response: str, row: dict, truncated: bool) -> Reward:
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

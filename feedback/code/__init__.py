"""The code reward: run the model's Python program against a row's tests in the sandbox.

This file: extraction, verdicts, feedback texts; sandbox.py: the bubblewrap sandbox one
rollout's tests run in; harness.py: the standard-library-only runner mounted alone inside it.

A test is stdin -> stdout ({"input", "output"}), a function call ({"fn", "args", "kwargs",
"expected", "tol"}; `fn` may be `Solution.method`) or test code calling `candidate` ({"fn",
"assert"}): docs/sandbox.md has the table and what the sandbox guarantees. Binary score: 1.0
only if every test passes. Feedback LeetCode-style: a single error if any (format, compile,
runtime error, a limit), else up to two failing tests, smallest input first (tests run in that
order and stop at the first error), fields cut to 250 chars, the whole text to 2000.
"""

from __future__ import annotations

import json
import math
import re
import signal

from feedback import (FIELD_CHARS, TOTAL_CHARS, Reward, cut, io_fields, printable, shortest_first, show_field,
                      row_field, truncated_reward, wrong_answer_feedback)
from feedback.code.harness import call_text
from feedback.code.sandbox import Limits, RunResult, run_tests

FORMAT_FEEDBACK = "Format Error: no code found. Put your solution in a ```python code block."
FENCE = "```"
LANGS = ("python", "py", "python3")
_LANG = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every ```lang ... ``` block, in one left-to-right pass (linear time: a
    regex with a lazy body is quadratic on unclosed fences). An opening fence is ``` then an info
    line (its leading [A-Za-z0-9_+-] run is the language); the block ends at the next ```."""
    blocks, pos = [], 0
    while (start := text.find(FENCE, pos)) >= 0:
        newline = text.find("\n", start + 3)
        if newline < 0:
            break
        close = text.find(FENCE, newline + 1)
        if close < 0:  # no later fence can close either: every later search starts further on
            break
        lang = _LANG.match(text, start + 3, newline).group(1)
        blocks.append((lang, text[newline + 1:close]))
        pos = close + 3
    return blocks


def extract_code(response: str) -> str | None:
    """The last ```python fenced block, else the last fenced block without a language, else the
    whole response if it is valid Python; None if there is no code."""
    blocks = fenced_blocks(response)
    for langs in (LANGS, ("",)):
        chosen = [code for lang, code in blocks if lang.lower() in langs]
        if chosen:
            return chosen[-1] if chosen[-1].strip() else None
    if response.strip() and _compile_error(response) is None:
        return response
    return None


def _compile_error(code: str) -> str | None:
    """Syntax check in the parent (no subprocess needed): the error text, or None if it compiles."""
    try:
        compile(code, "solution.py", "exec")
        return None
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        return f"{type(e).__name__}: {e}"


def normalize_output(text: str) -> str:
    """Outputs compare after stripping the whole text and trailing spaces of each line (and \\r)."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def values_equal(got, expected, tol: float | None = None) -> bool:
    """Returned value vs expected: tuples and lists are the same (JSON has no tuples), dicts
    compare key by key, a bool only equals a bool; numbers compare with == unless `tol` is given,
    then floats within tol, absolute or relative (math.isclose)."""
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(values_equal(g, e, tol) for g, e in zip(got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_equal(got[k], expected[k], tol) for k in got)
    number = lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
    if number(got) and number(expected):
        return got == expected if tol is None else math.isclose(got, expected, rel_tol=tol, abs_tol=tol)
    return type(got) is type(expected) and got == expected


def test_size(test: dict) -> int:
    """What "shortest input first" means for each kind of test."""
    if "input" in test:
        return len(test["input"])
    if "assert" in test:
        return len(test["assert"])
    return len(json.dumps([test.get("args", []), test.get("kwargs") or {}], default=repr))


def _shown_input(test: dict) -> str | None:
    if "input" in test:
        return test["input"].rstrip("\n")
    if "assert" in test:
        return None
    return call_text(test["fn"], list(test.get("args", [])), dict(test.get("kwargs") or {}))


def _error_feedback(title: str, detail: str, inp: str | None) -> str:
    parts = [title]
    if detail:
        parts.append(cut(printable(detail), FIELD_CHARS, keep="tail"))
    if inp is not None:
        parts.append("Input:\n" + show_field(inp))
    return cut("\n".join(parts), TOTAL_CHARS)


def _tail(text: str, lines: int = 10) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def classify(r: RunResult, limits: Limits) -> tuple[str, str] | None:
    """(title, detail) for a run that ended badly, naming the limit that fired; None otherwise."""
    exc = r.exception or r.load_error
    tail = _tail(exc["traceback"] or f"{exc['type']}: {exc['message']}") if exc else _tail(r.stderr)
    last = tail.splitlines()[-1] if tail else ""
    fired = {  # the limit the runner's watch (or the output cap) stopped it by
        "cpu": ("Time Limit Exceeded", f"The program used more than {limits.cpu_seconds:g} s of CPU time."),
        "idle": ("Time Limit Exceeded", f"The program spent more than {limits.idle_seconds:g} s neither "
                 "running nor ready to run (sleeping or waiting for something that never came)."),
        "wall": ("Time Limit Exceeded", f"The program did not finish within {limits.max_wall_seconds:g} s."),
        "memory": ("Memory Limit Exceeded", f"The program's processes together used more than "
                   f"{limits.memory_mb} MiB of memory."),
        "output": ("Output Limit Exceeded",
                   "The function returned a value far larger than the expected one."),
        "files": ("Disk Limit Exceeded",
                  f"The program created more than {limits.max_files} files and directories.")}
    if r.returncode == -signal.SIGXCPU or (
            r.returncode == -signal.SIGKILL and r.cpu_seconds >= limits.cpu_seconds - 0.1):
        return fired["cpu"]
    if r.limit:
        return fired[r.limit]
    if _out_of_memory(exc, last):
        return "Memory Limit Exceeded", f"The program tried to use more than {limits.memory_mb} MiB of memory."
    if "[Errno 27] File too large" in last:  # RLIMIT_FSIZE; Python ignores SIGXFSZ, so writes fail
        return "Output Limit Exceeded", f"The program wrote more than {limits.max_file_mb} MiB to a file or to stdout."
    if "[Errno 28] No space left on device" in last:
        return "Disk Limit Exceeded", (f"The program wrote more than {limits.disk_mb} MiB to its directory and /tmp, "
                                       f"or more than {limits.shm_mb} MiB to /dev/shm.")
    if "[Errno 11] Resource temporarily unavailable" in last or "can't start new thread" in last:
        return "Runtime Error", f"{tail}\nThe program may run at most {limits.max_procs} processes and threads."
    if exc is not None:
        return "Runtime Error", tail
    if r.died or (r.returncode is not None and r.returncode != 0):
        code = r.returncode
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            hint = " (e.g. a too deep recursion)" if -code == signal.SIGSEGV else ""
            return "Runtime Error", (tail + "\n" if tail else "") + f"The program was killed by signal {name}{hint}."
        ended = f"exited with code {code}" if code is not None else "ended"
        return "Runtime Error", tail or (f"The program {ended} during the call." if r.died else f"The program {ended}.")
    return None


def _out_of_memory(exc: dict | None, last: str) -> bool:
    """A MemoryError of any kind (numpy's _ArrayMemoryError too) or an allocation refused with
    ENOMEM (mmap): RLIMIT_AS stopped it."""
    if exc is not None:
        return exc["type"].endswith("MemoryError") or str(exc["message"]).startswith("[Errno 12]")
    return bool(re.match(r"[\w.]*MemoryError\b|\w+Error: \[Errno 12\]", last))


def _failure_fields(r: RunResult, test: dict) -> list[tuple[str, str]] | None:
    """The fields of a wrong answer, None if the test passed."""
    if "input" in test:
        out, expected = normalize_output(r.stdout), normalize_output(test["output"])
        return None if out == expected and not r.stdout_cut else io_fields(test["input"].rstrip("\n"), out, expected)
    if "assert" in test:
        if r.passed:
            return None
        fields = [("Test", r.failure["line"] if r.failure else "")]
        if r.failure and r.failure["message"]:
            fields.append(("Error", r.failure["message"]))
        if r.last_call:
            fields += [("Last call", r.last_call.get("call", "")), ("Returned", r.last_call.get("returned", ""))]
        return fields
    if values_equal(r.value, test["expected"], test.get("tol")):
        return None
    return io_fields(_shown_input(test), repr(r.value), repr(test["expected"]))


def code_reward(response: str, row: dict, truncated: bool, **limits) -> Reward:
    """Score the response's program on row["tests"] (see the module docstring for their kinds).
    limits: fields of sandbox.Limits (--data.reward_kwargs), its defaults for the rest."""
    limits = Limits(**limits)
    tests = row_field(row, "tests", "code")
    if truncated:
        return truncated_reward()
    code = extract_code(response)
    if code is None:
        return Reward(0.0, FORMAT_FEEDBACK)
    err = _compile_error(code)
    if err is not None:
        return Reward(0.0, _error_feedback("Compile Error", err, None))

    order = shortest_first(tests, test_size)
    results = run_tests(code, [tests[i] for i in order], limits)
    failures = []
    for r in results:
        test = tests[order[r.index]]
        if r.error:  # the sandbox broke: not the model's fault, so no feedback, just the error
            return Reward(0.0, "", f"sandbox: {r.error}")
        bad = classify(r, limits)
        if bad is not None:
            inp = _shown_input(test) if "assert" not in test else r.last_call.get("call")
            return Reward(0.0, _error_feedback(bad[0], bad[1], inp))
        if "expected" in test and not r.has_value:  # never read as None
            return Reward(0.0, "", "sandbox: a call ended with neither a value nor an error")
        fields = _failure_fields(r, test)
        if fields is not None:
            failures.append(fields)
    if len(results) < len(order):  # cannot happen without an error above; guard against silent passes
        return Reward(0.0, "", f"sandbox returned {len(results)} results for {len(order)} tests")
    if not failures:
        return Reward(1.0)
    return Reward(0.0, wrong_answer_feedback(failures, len(tests)))

"""Code reward: run the model's Python program against stdin/stdout unit tests in a sandbox.

Binary score: 1.0 only if every test passes. Feedback LeetCode-style (SPEC 7): a single error if
any (format error, compile error, runtime error, time limit, memory limit), else up to two
failing tests, shortest input first, with input, output and expected; fields cut to 250 chars
and the whole text to 2000. Tests run shortest input first and stop at the first error, so the
reported error is the one of the shortest erroring test. What the sandbox does and does not
contain is documented in feedback/sandbox.py.
"""

from __future__ import annotations

import re
import signal

from feedback import (FIELD_CHARS, TOTAL_CHARS, Reward, cut, shortest_first, show_field, truncated_reward,
                      wrong_answer_feedback)
from feedback.sandbox import Limits, RunResult, run_tests

FORMAT_FEEDBACK = "Format Error: no code found. Put your solution in a ```python code block."

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str | None:
    """The last ```python fenced block, else the last fenced block without a language, else the
    whole response if it is valid Python; None if there is no code."""
    blocks = _FENCE.findall(response)
    for lang in (("python", "py", "python3"), ("",)):
        chosen = [code for tag, code in blocks if tag.lower() in lang]
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


def _error_feedback(title: str, detail: str, inp: str | None) -> str:
    parts = [title]
    if detail:
        parts.append(cut(detail, FIELD_CHARS, keep="tail"))
    if inp is not None:
        parts.append("Input:\n" + show_field(inp.rstrip("\n")))
    return cut("\n".join(parts), TOTAL_CHARS)


def _stderr_tail(stderr: str, lines: int = 10) -> str:
    return "\n".join(stderr.strip().splitlines()[-lines:])


def classify(r: RunResult, limits: Limits) -> tuple[str, str] | None:
    """(title, detail) for a run that did not exit cleanly, None for a clean exit."""
    tail = _stderr_tail(r.stderr)
    last = tail.splitlines()[-1] if tail else ""
    if r.timed_out or r.returncode == -signal.SIGXCPU or (
            r.returncode == -signal.SIGKILL and r.cpu_seconds >= limits.cpu_seconds - 0.1):
        return "Time Limit Exceeded", f"The program did not finish within the time limit of {limits.cpu_seconds:g} s."
    if r.returncode == 0:
        return None
    if last.startswith("MemoryError"):
        return "Memory Limit Exceeded", f"The program tried to use more than {limits.memory_mb} MiB of memory."
    if "[Errno 27] File too large" in last:  # RLIMIT_FSIZE; Python ignores SIGXFSZ, so writes fail
        return "Output Limit Exceeded", f"The program wrote more than {limits.max_file_mb} MiB to a file or to stdout."
    if r.returncode is not None and r.returncode < 0:
        name = signal.Signals(-r.returncode).name if -r.returncode in signal.valid_signals() else str(-r.returncode)
        hint = " (e.g. a too deep recursion)" if -r.returncode == signal.SIGSEGV else ""
        return "Runtime Error", (tail + "\n" if tail else "") + f"The program was killed by signal {name}{hint}."
    return "Runtime Error", tail or f"The program exited with code {r.returncode}."


def code_reward(response: str, row: dict, truncated: bool, cpu_seconds: float = 5.0, wall_seconds: float = 6.0,
                memory_mb: int = 512, max_procs: int = 64, max_file_mb: int = 16,
                allow_network: bool = False) -> Reward:
    """Score the response's program on row["tests"] ([{"input", "output"}], stdin -> stdout)."""
    tests = row.get("tests")
    if not tests:
        raise ValueError("code reward needs row['tests']")
    if truncated:
        return truncated_reward()
    code = extract_code(response)
    if code is None:
        return Reward(0.0, FORMAT_FEEDBACK)
    err = _compile_error(code)
    if err is not None:
        return Reward(0.0, _error_feedback("Compile Error", err, None))

    limits = Limits(cpu_seconds, wall_seconds, memory_mb, max_procs, max_file_mb, allow_network)
    order = shortest_first(tests)
    results = run_tests(code, [tests[i]["input"] for i in order], limits, stop_on_error=True)
    failures = []
    for i, r in zip(order, results):
        if r.error:  # the sandbox broke: not the model's fault, so no feedback, just the error
            return Reward(0.0, "", f"sandbox: {r.error}")
        bad = classify(r, limits)
        if bad is not None:
            return Reward(0.0, _error_feedback(bad[0], bad[1], tests[i]["input"]))
        out, expected = normalize_output(r.stdout), normalize_output(tests[i]["output"])
        if out != expected:
            failures.append((tests[i]["input"].rstrip("\n"), out, expected))
    if len(results) < len(order):  # cannot happen without an error above; guard against silent passes
        return Reward(0.0, "", f"sandbox returned {len(results)} results for {len(order)} tests")
    if not failures:
        return Reward(1.0)
    return Reward(0.0, wrong_answer_feedback(failures, len(tests)))

"""Reward functions that return a score and a feedback text.

A reward function has the signature `fn(response: str, row: dict, truncated: bool)` and returns a
float/int/bool, a dict {"score": ..., "feedback": ...}, or a `Reward`. Callers go through `score`
/ `score_batch`, which normalise the result and turn any failure of the function into
`Reward(score=0.0, error=...)`, so that one broken row never kills a training step. The built-in
ones: `get_reward_fn`. The feedback text is what the SDPO teacher sees, so it must never leak the
ground truth by default and must be deterministic: the same response gives the same text.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import re
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import isfinite  # not `import math`: the submodule feedback.math would replace that name
from typing import Callable

from errors import FlagError


@dataclass
class Reward:
    score: float  # the scalar reward
    feedback: str = ""  # text shown to the SDPO teacher; "" = no feedback
    error: str = ""  # why scoring failed (reward function raised, sandbox crashed); logged, not shown


# -----------------------------------------------------------------------------
# shared feedback text helpers

TRUNCATION_FEEDBACK = ("Your previous response was too long and truncated before it finished, so no final "
                       "answer could be graded. Try again with a shorter response.")
FIELD_CHARS = 250  # each shown field (input, output, expected, error) is cut to this
TOTAL_CHARS = 2000  # the whole feedback text is cut to this
MAX_SHOWN_FAILURES = 2


def row_field(row: dict, name: str, reward: str):
    """row[name], which the named reward needs: missing or empty, it is the dataset's error (naming
    both), not a score of the response."""
    value = row.get(name)
    if value is None or value == [] or value == "":
        raise ValueError(f"{reward} reward needs row[{name!r}]")
    return value


def truncated_reward() -> Reward:
    """What the built-in rewards give a response that hit the length limit: it never delivered a
    final answer, so it scores 0, and the teacher is told to be shorter."""
    return Reward(score=0.0, feedback=TRUNCATION_FEEDBACK)


def cut(text: str, limit: int, keep: str = "head") -> str:
    """Cut `text` to at most `limit` chars, marking the cut with "...". keep="tail" keeps the end
    (for tracebacks, whose last lines matter)."""
    if len(text) <= limit:
        return text
    if keep == "tail":
        return "..." + text[len(text) - (limit - 3):]
    return text[:limit - 3] + "..."


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """Control characters other than newline and tab written as \\xNN escapes (and CRLF as a
    newline): program output may hold NULs, ANSI escapes, form feeds, and none of it should reach
    a log or a teacher context as such. Idempotent."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text.replace("\r\n", "\n"))


def show_field(text: str, limit: int = FIELD_CHARS) -> str:
    """A field for display: printable, cut, and "(empty)" for an empty string so that it stays visible."""
    return cut(printable(text), limit) if text else "(empty)"


def io_fields(inp: str, out: str, expected: str) -> list[tuple[str, str]]:
    """The usual fields of a failed test."""
    return [("Input", inp), ("Output", out), ("Expected", expected)]


def wrong_answer_feedback(failures: list[list[tuple[str, str]]], n_tests: int,
                          field_chars: int = FIELD_CHARS, total_chars: int = TOTAL_CHARS) -> str:
    """LeetCode-style text for failing tests. `failures` = the (label, text) fields of *all*
    failing tests (io_fields for most), already sorted shortest input first; the first
    MAX_SHOWN_FAILURES are shown."""
    parts = [f"Wrong Answer: {len(failures)} of {n_tests} tests failed."]
    for fields in failures[:MAX_SHOWN_FAILURES]:
        parts.append("\n".join(f"{label}:\n{show_field(text, field_chars)}" for label, text in fields))
    return cut("\n\n".join(parts), total_chars)


def shortest_first(tests: list[dict], size: Callable[[dict], int] = lambda t: len(t["input"])) -> list[int]:
    """Test indices ordered by input size, ties by position: the order failures are shown in."""
    return sorted(range(len(tests)), key=lambda i: (size(tests[i]), i))


# -----------------------------------------------------------------------------
# looking up and calling reward functions

BUILTIN = {"math": ("feedback.math", "math_reward"), "code": ("feedback.code", "code_reward"),
           "mc": ("feedback.mc", "mc_reward")}
# The synthetic tasks' checkers by task name ("strops", "quiz", ...): the tasks' table registers them
# (tasks/__init__.py), since the tasks are built on this module's helpers
CHECKERS: dict[str, Callable] = {}


def reward_names() -> list[str]:
    """The names get_reward_fn knows without a module: the built-in ones and the tasks' checkers."""
    return sorted([*BUILTIN, *CHECKERS])


def get_reward_fn(name: str) -> Callable:
    """A built-in name ("math", "code", "mc"), a synthetic task's name for its checker ("strops",
    "quiz", "shapes": CHECKERS), "package.module:function", or "path/to/file.py:function".
    Raises ValueError naming the spec when it cannot be loaded."""
    if name in BUILTIN:
        module, attr = BUILTIN[name]
        return getattr(importlib.import_module(module), attr)
    if name in CHECKERS:
        return CHECKERS[name]
    usage = f"expected one of {reward_names()}, 'package.module:function' or 'path/to/file.py:function'"
    if ":" not in name:
        raise ValueError(f"unknown reward function {name!r}: {usage}")
    where, attr = name.rsplit(":", 1)
    try:
        if where.endswith(".py") or os.sep in where:
            path = os.path.abspath(where)
            # a unique module name per file, so two user files called rewards.py do not collide
            mod_name = f"_sdpo_reward_{abs(hash(path)):x}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module  # dataclasses and pickle look the module up by name
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[mod_name]
                raise
        else:
            module = importlib.import_module(where)
    except Exception as e:
        raise ValueError(f"cannot import reward function {name!r}: {type(e).__name__}: {e} ({usage})") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"cannot import reward function {name!r}: {where!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is not callable (it is a {type(fn).__name__})")
    return fn


def reward_function(cfg, row: dict) -> Callable:
    """The run's reward for row: --data.reward (or the row's own), with --data.reward_kwargs bound
    (cfg: config.Config)."""
    fn = get_reward_fn(cfg.data.reward or row["reward"])
    if not cfg.data.reward_kwargs:
        return fn
    try:
        kwargs = json.loads(cfg.data.reward_kwargs)
    except json.JSONDecodeError as e:
        raise FlagError(f"--data.reward_kwargs is not a JSON object: {e}") from None
    if not isinstance(kwargs, dict):
        raise FlagError(f"--data.reward_kwargs must be a JSON object, got {cfg.data.reward_kwargs!r}")
    return functools.partial(fn, **kwargs)


def score(fn: Callable, response: str, row: dict, truncated: bool) -> Reward:
    """Call fn(response, row, truncated) and normalise its result to a Reward. Never raises: an
    exception, a non-number or a NaN/inf score gives score 0 with `error` set and no feedback.
    A truncated response always carries the truncation text (user functions need not add it)."""
    uid = row.get("uid", "?") if isinstance(row, dict) else "?"
    fn_name = getattr(fn, "__name__", repr(fn))
    try:
        out = fn(response, row, truncated)
    except Exception as e:
        at = traceback.extract_tb(e.__traceback__)[-1]  # never empty: it holds this frame at least
        where = f"{os.path.basename(at.filename)}:{at.lineno}"
        return Reward(0.0, "", f"{type(e).__name__}: {e} (reward {fn_name} at {where}, row uid {uid})")

    if isinstance(out, Reward):
        out = vars(out)
    elif not isinstance(out, dict):
        out = {"score": out}
    if "score" not in out:
        return Reward(0.0, "", f"reward {fn_name} returned a dict without 'score' for row uid {uid}")
    value, feedback, error = out["score"], out.get("feedback", ""), out.get("error", "")
    # bool, int, float, numpy / torch scalars; not a string that looks like a number (numpy's str_ too)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return Reward(0.0, "", f"reward {fn_name} returned a non-number score {value!r} "
                               f"({type(value).__name__}) for row uid {uid}")
    try:
        value = float(value)
    except (TypeError, ValueError) as e:
        return Reward(0.0, "", f"reward {fn_name} returned a non-number score {value!r} for row uid {uid}: {e}")
    if not isfinite(value):
        return Reward(0.0, "", f"reward {fn_name} returned a non-finite score {value} for row uid {uid}")
    feedback = "" if feedback is None else str(feedback)
    error = "" if error is None else str(error)
    if truncated and TRUNCATION_FEEDBACK not in feedback:
        feedback = TRUNCATION_FEEDBACK + ("\n\n" + feedback if feedback else "")
    return Reward(value, feedback, error)


def score_batch(fn: Callable, responses: list[str], rows: list[dict], truncated: list[bool],
                workers: int | None = None) -> list[Reward]:
    """score() over a batch, results in input order. Runs in a thread pool because code rewards
    spend their time waiting on sandbox subprocesses; workers defaults to the number of CPUs."""
    if not (len(responses) == len(rows) == len(truncated)):
        raise ValueError(f"score_batch: got {len(responses)} responses, {len(rows)} rows, "
                         f"{len(truncated)} truncated flags")
    workers = workers or min(32, os.cpu_count() or 1)
    if workers <= 1 or len(rows) <= 1:
        return [score(fn, *args) for args in zip(responses, rows, truncated)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(functools.partial(score, fn), responses, rows, truncated))

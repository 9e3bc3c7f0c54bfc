"""Multiple-choice reward: score only, no feedback.

Telling the teacher "B is wrong" would leak part of the answer on a 4-choice question, so a wrong
choice gets no text. A truncated response still gets the (answer-free) truncation feedback.
"""

from __future__ import annotations

import re

from feedback import Reward, row_field, truncated_reward
from feedback.math import last_boxed

_ANSWER = re.compile(r"(?i:answer)\s*(?:\*\*)?\s*(?i:is)?\s*[:：]?\s*[*(\[]*\s*([A-J])(?![A-Za-z])")
_PAREN = re.compile(r"\(([A-J])\)")
_ALONE = re.compile(r"\b([A-J])\b")


def extract_choice(text: str) -> str | None:
    """The chosen letter A-J: from the last \\boxed{...}, else the last "Answer: X" / "answer is X",
    else the last "(X)", else the last standalone capital letter A-J."""
    boxed = last_boxed(text)
    if boxed is not None:
        m = _ALONE.search(boxed)
        if m:
            return m.group(1)
    for pattern in (_ANSWER, _PAREN, _ALONE):
        found = pattern.findall(text)
        if found:
            return found[-1]
    return None


def mc_reward(response: str, row: dict, truncated: bool) -> Reward:
    """1.0 if the chosen letter equals row["answer"] (a letter, possibly written "(B)" etc.)."""
    answer = row_field(row, "answer", "mc")
    if truncated:
        return truncated_reward()
    truth = extract_choice(str(answer).strip().upper())
    return Reward(1.0 if truth is not None and extract_choice(response) == truth else 0.0)

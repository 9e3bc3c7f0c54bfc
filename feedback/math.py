"""Final-answer check for math problems.

The answer is, in order of preference: the content of the last complete \\boxed{...} (nested
braces allowed), the number after the last "Answer:" (the synthetic arithmetic task asks for
"Answer: <number>"), the last number in the response. Both sides are normalised (see `normalize`)
and compared exactly. The ground truth is never put in the feedback unless asked for
(`reveal_answer=True` or row["reveal_answer"]), since the teacher would otherwise just copy it.
"""

from __future__ import annotations

import re

from feedback import Reward, cut, row_field, truncated_reward

FORMAT_FEEDBACK = ('Your answer must end with "Answer: <answer>" (or give the final answer in \\boxed{}). '
                   "No final answer was found in your previous response.")

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER = re.compile(r"answer\s*(?:\*\*)?\s*[:：]", re.IGNORECASE)
# 1,234,567.5 | 1234.5 | .5, optionally a fraction 3/4; a sign in front
_NUMBER = re.compile(r"[-+−]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...}, nested braces included; None if there is none."""
    for m in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, m.end()
        for j in range(start, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:j]
        # unbalanced (e.g. cut off): try the previous one
    return None


def extract_answer(response: str) -> str | None:
    """The final answer as written by the model (not normalised), or None if there is none."""
    boxed = last_boxed(response)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    matches = list(_ANSWER.finditer(response))
    if matches:
        rest = response[matches[-1].end():]
        line = next((ln.strip() for ln in rest.splitlines() if ln.strip()), "").strip("*$ .")
        num = _NUMBER.search(line)
        if num and "\\" not in line:  # "Answer: 42 apples" -> 42, but keep latex like \frac{1}{2} whole
            return num.group(0)
        if line:
            return line
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
    """Canonical form for comparison: no spaces/$/latex spacing, no thousands commas, no leading
    "+", no trailing zeros after a decimal point ("42.0" -> "42", "0.50" -> "0.5")."""
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", answer.strip())
    s = s.replace("−", "-").replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\ ", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    s = s.removeprefix("+")
    if re.fullmatch(r"-?\d+\.\d+", s):
        s = s.rstrip("0").rstrip(".")
    if s == "-0":
        s = "0"
    return s


def math_reward(response: str, row: dict, truncated: bool, reveal_answer: bool = False) -> Reward:
    """1.0 if the final answer equals row["answer"] after normalisation, else 0.0 with feedback."""
    truth = str(row_field(row, "answer", "math"))
    if truncated:
        return truncated_reward()
    answer = extract_answer(response)
    if answer is None:
        return Reward(0.0, FORMAT_FEEDBACK)
    if normalize(answer) == normalize(truth):
        return Reward(1.0)
    feedback = f"Your answer {cut(answer, 250)} is incorrect."
    if reveal_answer or row.get("reveal_answer"):
        feedback += f" The correct answer is {cut(truth, 250)}."
    return Reward(0.0, feedback)

"""Reward of the synthetic picture task (data.py's `shapes`): exact answer, and feedback that
says what was wrong without giving the answer.

The question decides the text: a wrong count is "not the number of shapes in the picture",
a wrong colour "not the colour of the circle", a wrong position "not where the red square
is"; a wrong scene answer is told how many shapes there are, or which of those it named are
wrong (feedback that narrows the answer without giving it, as the quiz's does). A response
without "Answer: ..." is told the format.
"""

from __future__ import annotations

import re

from feedback import Reward, row_field, truncated_reward

# the scene question's text (data.py asks it): the reward recognises it by this text
SCENE_QUESTION = "Name every shape in reading order: its colour, kind and place."
PICTURE_QUIZ_INSTRUCTION = "Answer each question on its own line, as 'a: <answer>'."

_ANSWER = re.compile(r"answer\s*:\s*([^\n]*)", re.IGNORECASE)
_QUIZ_LINE = re.compile(r"^\s*([a-z])\s*:\s*(.*?)\s*$", re.IGNORECASE | re.MULTILINE)
_COLOUR_Q = re.compile(r"What colour is the (\w+)\?")
_POSITION_Q = re.compile(r"Where is the (\w+ \w+)\?")
FORMAT_FEEDBACK = "Your response has no final answer. End it with 'Answer: <answer>'."


def normalise(text: str) -> str:
    return " ".join(text.strip().strip(".").lower().split())


def question_text(row: dict) -> str:
    content = row["messages"][-1]["content"]
    return content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)


def scene_feedback(given: str, truth: str) -> str:
    """What is wrong in a scene answer, without the answer: how many shapes the picture has
    when the count differs, else which of the named shapes are wrong."""
    named, shapes = [p.strip() for p in given.split(",")], [p.strip() for p in truth.split(",")]
    if len(named) != len(shapes):
        return (f"Your answer names {len(named)} shape{'s' * (len(named) != 1)}, but the picture has "
                f"{len(shapes)}. Look at the picture again.")
    wrong = [str(i + 1) for i, (a, b) in enumerate(zip(named, shapes)) if a != b]
    return (f"In your answer, shape{'s' * (len(wrong) != 1)} number {' and '.join(wrong)} (in reading order) "
            f"{'is' if len(wrong) == 1 else 'are'} wrong; the rest are right. Look at the picture again.")


def picture_quiz_reward(response: str, tests: list[dict]) -> Reward:
    """A picture quiz: 1.0 iff every labelled line's answer (the last line with its label) equals
    its question's; else each line marked right or wrong, or the format when no line is labelled."""
    given = {label.lower(): normalise(text) for label, text in _QUIZ_LINE.findall(response)}
    labels = [t["input"].split(":", 1)[0] for t in tests]
    if not any(label in given for label in labels):
        return Reward(0.0, f"Your response answers none of the questions. {PICTURE_QUIZ_INSTRUCTION}")
    right = [given.get(label) == normalise(t["output"]) for label, t in zip(labels, tests)]
    if all(right):
        return Reward(1.0)
    wrong = right.count(False)
    lines = [f"{wrong} of {len(tests)} answers {'is' if wrong == 1 else 'are'} wrong."]
    lines += [f"{label}: {given[label]} is right." if ok else f"{label} is wrong." if label in given else
              f"{label} has no answer." for label, ok in zip(labels, right)]
    return Reward(0.0, "\n".join(lines + ["Look at the picture again."]))


def shapes_reward(response: str, row: dict, truncated: bool) -> Reward:
    """1.0 if the last 'Answer: X' equals row["answer"] (case and surrounding space ignored), or,
    for a picture quiz (row["tests"]), if every line is right."""
    truth = row_field(row, "answer", "shapes")
    if truncated:
        return truncated_reward()
    if row.get("tests"):
        return picture_quiz_reward(response, row["tests"])
    found = _ANSWER.findall(response)
    if not found or not normalise(found[-1]):
        return Reward(0.0, FORMAT_FEEDBACK)
    given = normalise(found[-1])
    if given == normalise(truth):
        return Reward(1.0)
    question = question_text(row)
    if colour := _COLOUR_Q.search(question):
        what = f"the colour of the {colour.group(1)}"
    elif position := _POSITION_Q.search(question):
        what = f"where the {position.group(1)} is"
    elif SCENE_QUESTION in question:
        return Reward(0.0, scene_feedback(given, normalise(truth)))
    else:
        what = "the number of shapes in the picture"
    return Reward(0.0, f"Your answer '{found[-1].strip()}' is wrong: it is not {what}. Look at the picture again.")

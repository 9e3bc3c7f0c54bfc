"""The picture task (shapes): questions about a drawn picture of shapes, for vision-language models.

The generator draws one to `--data.shapes_max` shapes in the cells of a grid and asks about
them (SHAPES_QUESTION_KINDS): a count, a colour, a position, the whole scene in reading order,
or a picture quiz of several such questions answered one per line. The checker's feedback says
what was wrong ("not the colour of the circle"; a quiz's lines marked right or wrong), never the answer.
"""
import random
import re
import string
from dataclasses import dataclass

from errors import FlagError
from feedback import Reward, row_field, truncated_reward
from image_prompts import draw_shapes
from tasks.quiz import wrong_lines

REWARD = "shapes"  # its rows name this file's `reward`
IMAGES = True  # its prompts hold pictures: its default model is the tiny vision-language one (tiny_models.py)
# the scene question's text: the checker recognises it by this text
SCENE_QUESTION = "Name every shape in reading order: its colour, kind and place."
PICTURE_QUIZ_INSTRUCTION = "Answer each question on its own line, as 'a: <answer>'."


@dataclass
class Flags:
    """The pictures and the questions asked about them (--data.*)."""
    shapes_max: int = 3  # shapes in a picture: 1..max (at most shapes_grid**2)
    shapes_grid: int = 2  # shapes sit in the cells of a grid x grid layout (2: four quadrants)
    shapes_questions: str = "count,colour,position"  # question kinds drawn from (tasks.shapes.SHAPES_QUESTION_KINDS)
    # the warm start's question kinds ("": shapes_questions): it may teach seeing on kinds the RL run does not ask
    shapes_warm_start_questions: str = ""
    shapes_quiz_questions: int = 3  # questions of a picture quiz (the "quiz" kind), all about one picture
    shapes_quiz_kinds: str = "count,colour,position"  # the kinds of question a picture quiz draws from
    shapes_colours: str = "red,green,blue,yellow"
    shapes_image_size: int = 112  # pixels a side (112: 16 image tokens for Qwen2-VL's 28-pixel units)


# The recipe (on top of tiny_models.RECIPE): RL on picture quizzes of counts and places, whose feedback marks
# each line (colours left out: the tiny teacher cannot copy a colour word); a warm start on all five
# kinds (scene questions teach it to see), its first 300 steps all teacher contexts. Why each value:
# docs/data.md ("The picture quiz", "Measured on the picture task").
RECIPE = {
    "data.shapes_questions": "quiz",
    "data.shapes_quiz_kinds": "count,position",
    "data.shapes_warm_start_questions": "count,colour,position,scene,quiz",
    "train.warm_start_feedback_frac": 0.3,
    "train.warm_start_steps": 2000,
    "train.warm_start_demo_frac": 0.2,
    "train.warm_start_context_steps": 300,
    "optim.lr": 3e-5,
}


def check_flags(cfg: Flags):
    """The question kinds named, checked before any work (else they fail once rows are drawn)."""
    check_kinds(cfg.shapes_questions, "shapes_questions", SHAPES_QUESTION_KINDS)
    if cfg.shapes_warm_start_questions:
        check_kinds(cfg.shapes_warm_start_questions, "shapes_warm_start_questions", SHAPES_QUESTION_KINDS)


SHAPES_INSTRUCTION = "Reply with 'Answer: <answer>'."
SHAPE_KINDS = ("circle", "square", "triangle")


def grid_positions(grid: int) -> list[str]:
    """Names of the cells of a grid x grid picture, row by row ("top left", ..., "bottom right")."""
    rows = {1: ["middle"], 2: ["top", "bottom"], 3: ["top", "middle", "bottom"]}
    cols = {1: ["centre"], 2: ["left", "right"], 3: ["left", "centre", "right"]}
    if grid not in rows:
        raise FlagError(f"--data.shapes_grid={grid}: must be 1, 2 or 3")
    return [f"{r} {c}" if grid > 1 else "centre" for r in rows[grid] for c in cols[grid]]


# scene: every shape in reading order, as "red circle top left, blue square bottom right" (a
# dense description: each picture teaches colour, kind and place at once). quiz: several count,
# colour and position questions about one picture, answered one per line, all of which must be
# right; its feedback marks each line right or wrong (`reward`), as the text quiz's does.
SHAPES_QUESTION_KINDS = ("count", "colour", "position", "scene", "quiz")


def check_kinds(value: str, flag: str, known) -> list[str]:
    """The kinds a comma-separated flag value lists; a ValueError naming the flag if one is unknown."""
    kinds = value.split(",")
    if unknown := set(kinds) - set(known):
        raise FlagError(f"--data.{flag}={value}: unknown kinds {sorted(unknown)}; use any of {', '.join(known)}")
    return kinds


def make_row(rng: random.Random, cfg: Flags) -> dict:
    positions, colours = grid_positions(cfg.shapes_grid), cfg.shapes_colours.split(",")
    kinds_asked = check_kinds(cfg.shapes_questions, "shapes_questions", SHAPES_QUESTION_KINDS)
    if not 1 <= cfg.shapes_max <= len(positions):
        raise FlagError(f"--data.shapes_max={cfg.shapes_max}: must be 1..{len(positions)} for a "
                        f"{cfg.shapes_grid}x{cfg.shapes_grid} grid")
    n = rng.randint(1, cfg.shapes_max)
    shapes = [{"kind": rng.choice(SHAPE_KINDS), "colour": rng.choice(colours), "cell": cell,
               "scale": rng.choice((0.5, 0.6, 0.7)), "dx": rng.choice((-0.1, 0.0, 0.1)), "dy": rng.choice((-0.1, 0.0, 0.1))}
              for cell in sorted(rng.sample(range(len(positions)), n))]
    # Ask only what the picture answers unambiguously: a colour of a kind that occurs once, the
    # position of a colour and kind that occur once.
    once = lambda key: [s for s in shapes if sum(key(t) == key(s) for t in shapes) == 1]
    kind_once, look_once = once(lambda s: s["kind"]), once(lambda s: (s["colour"], s["kind"]))
    options = [k for k in kinds_asked
               if k in ("count", "scene", "quiz") or (kind_once if k == "colour" else look_once)]
    kind = rng.choice(options or ["count"])
    count = ("How many shapes are in the picture?", str(n))
    colour = lambda s: (f"What colour is the {s['kind']}?", s["colour"])
    position = lambda s: (f"Where is the {s['colour']} {s['kind']}?", positions[s["cell"]])
    tests = None
    if kind == "count":
        question, answer = count
    elif kind == "scene":
        question = SCENE_QUESTION
        answer = ", ".join(f"{s['colour']} {s['kind']} {positions[s['cell']]}" for s in shapes)
    elif kind == "colour":
        question, answer = colour(rng.choice(kind_once))
    elif kind == "position":
        question, answer = position(rng.choice(look_once))
    else:
        if not 1 <= cfg.shapes_quiz_questions <= 26:
            raise FlagError(f"--data.shapes_quiz_questions={cfg.shapes_quiz_questions}: questions are labelled "
                             f"a-z, so 1 to 26")
        quiz_kinds = check_kinds(cfg.shapes_quiz_kinds, "shapes_quiz_kinds", ("count", "colour", "position"))
        # every question the picture answers unambiguously, in a fixed order (count, colours, positions)
        pool = [count] * ("count" in quiz_kinds) + \
            [colour(s) for s in kind_once if "colour" in quiz_kinds] + \
            [position(s) for s in look_once if "position" in quiz_kinds] or [count]
        asked = sorted(rng.sample(range(len(pool)), min(cfg.shapes_quiz_questions, len(pool))))
        tests = [{"input": f"{label}: {pool[i][0]}", "output": pool[i][1]}
                 for label, i in zip(string.ascii_lowercase, asked)]
        question = "\n".join(t["input"] for t in tests) + "\n" + PICTURE_QUIZ_INSTRUCTION
        answer = "\n".join(f"{t['input'][0]}: {t['output']}" for t in tests)
    scene = ";".join(f"{s['colour']} {s['kind']}@{s['cell']}x{s['scale']}{s['dx']:+}{s['dy']:+}" for s in shapes)
    return {
        "uid": f"shapes:{scene}:{question}",
        "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question if tests else
                                                                      f"{question} {SHAPES_INSTRUCTION}"}]}],
        "images": [draw_shapes(shapes, cfg.shapes_image_size, cfg.shapes_grid)],
        "answer": answer,
        "tests": tests,  # a picture quiz's questions and their answers, else None
        "reference": answer if tests else f"Answer: {answer}",
        "reward": REWARD,
    }


_ANSWER = re.compile(r"answer\s*:\s*([^\n]*)", re.IGNORECASE)
_QUIZ_LINE = re.compile(r"^\s*([a-z])\s*:\s*(.*?)\s*$", re.IGNORECASE | re.MULTILINE)
_COLOUR_Q = re.compile(r"What colour is the (\w+)\?")
_POSITION_Q = re.compile(r"Where is the (\w+ \w+)\?")
FORMAT_FEEDBACK = "Your response has no final answer. End it with 'Answer: <answer>'."


def normalise(text: str) -> str:
    return " ".join(text.strip().strip(".").lower().split())


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


def reward(response: str, row: dict, truncated: bool) -> Reward:
    """1.0 if the last 'Answer: X' equals row["answer"] (case and surrounding space ignored), or,
    for a picture quiz (row["tests"]), if every line is right."""
    truth = row_field(row, "answer", "shapes")
    if truncated:
        return truncated_reward()
    if row.get("tests"):
        return picture_quiz_reward(response, row["tests"])
    found = _ANSWER.findall(response)
    given = normalise(found[-1]) if found else ""
    if not given:
        return Reward(0.0, FORMAT_FEEDBACK)
    if given == normalise(truth):
        return Reward(1.0)
    content = row["messages"][-1]["content"]
    question = content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)
    if colour := _COLOUR_Q.search(question):
        what = f"the colour of the {colour.group(1)}"
    elif position := _POSITION_Q.search(question):
        what = f"where the {position.group(1)} is"
    elif SCENE_QUESTION in question:
        return Reward(0.0, scene_feedback(given, normalise(truth)))
    else:
        what = "the number of shapes in the picture"
    return Reward(0.0, f"Your answer '{found[-1].strip()}' is wrong: it is not {what}. Look at the picture again.")


def wrong_response(row: dict, rng: random.Random) -> str:
    """Another count, colour or place than the answer (for a picture quiz, on each line
    tasks.quiz.wrong_lines picks)."""
    pools = [[str(k) for k in range(1, 5)], Flags().shapes_colours.split(",")] + \
        [grid_positions(g) for g in (2, 3)]
    other = lambda truth: rng.choice([p for p in next((p for p in pools if truth in p), []) if p != truth]
                                     or ["none"])
    if not row.get("tests"):
        return f"Answer: {other(row['answer'])}"
    return "\n".join(f"{t['input'][0]}: {other(t['output']) if w else t['output']}"
                     for t, w in zip(row["tests"], wrong_lines(len(row["tests"]), rng)))

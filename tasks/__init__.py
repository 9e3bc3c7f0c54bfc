"""The synthetic tasks' table (TASKS): one file per task in this folder, and drawing a split's rows.

A task's file holds all of it (docs/data.md, "Adding a task", is a worked example):
    make_row(rng, cfg) -> dict   the generator: one row (data.py's top lists a row's fields) from
                                 a random.Random and the --data.* flags
    REWARD                       the checker its rows name: "math" (feedback/), or its own name
                                 for the file's `reward(response, row, truncated)`, which scores
                                 an answer and says what is wrong without giving the answer
                                 (registered in feedback.CHECKERS under the task's name)
    Flags                        a dataclass of its difficulty knobs, which become --data.* flags
    RECIPE, RECIPE_BY_ALGO       optional: its flag values on the tiny model (on top of tiny_models.RECIPE),
                                 which `--recipe auto` picks for --data.task NAME
    wrong_response(row, rng)     optional: a plausible wrong answer, for the warm start's examples
                                 that show the teacher feedback
    check_flags(cfg)             optional: checks of its flags before any work starts
    IMAGES = True                optional: its prompts hold pictures (the tiny VLM is its default)
Rows are split into train and held-out by a hash of their content (split_of), so a row never
moves between splits when n or the seed changes.
"""
import dataclasses
import hashlib
import importlib
import random

import feedback
from errors import DataError, FlagError

# The table: one line per task, its name = its file in this folder.
TASKS = {name: importlib.import_module(f"tasks.{name}") for name in (
    "arith",
    "strops",
    "quiz",
    "shapes",
    "manners",
)}
IMAGE_TASKS = tuple(name for name, task in TASKS.items() if getattr(task, "IMAGES", False))
# Each task's checker under its name (--data.reward strops, rows whose reward names it): handed down to feedback/
feedback.CHECKERS.update({name: task.reward for name, task in TASKS.items() if hasattr(task, "reward")})


@dataclasses.dataclass
class TaskConfig(*reversed([task.Flags for task in TASKS.values()])):  # fields: last base first
    """Difficulty of the synthetic tasks: every task's Flags, in the table's order, and the split's
    (all flags under --data.*; config.DataConfig extends it)."""
    heldout_percent: int = 10  # share of the content hash space that is held out


def split_of(key: str, heldout_percent: int) -> str:
    bucket = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % 100
    return "test" if bucket < heldout_percent else "train"


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
        row = TASKS[task].make_row(rng, cfg)
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


def wrong_response(row: dict, rng: random.Random) -> str | None:
    """A plausible wrong answer to a row (for warm-start examples with feedback), by the task whose
    rows name the row's reward; None where that task writes none."""
    writers = [task.wrong_response for task in TASKS.values()
               if task.REWARD == row["reward"] and hasattr(task, "wrong_response")]
    return writers[0](row, rng) if writers else None


def recipe(name: str, algo: str) -> dict | None:
    """The task's own flag values for the objective algo (on top of the tiny model's), or None."""
    task = TASKS.get(name)
    if getattr(task, "RECIPE", None) is None:
        return None
    return {**task.RECIPE, **getattr(task, "RECIPE_BY_ALGO", {}).get(algo, {})}


def check_flags(cfg: TaskConfig):
    """Every task's checks of its flags, before any work starts."""
    for task in TASKS.values():
        if hasattr(task, "check_flags"):
            task.check_flags(cfg)

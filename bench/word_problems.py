"""Simple one-step arithmetic word problems as JSONL files, for trying a real model.

    python bench/word_problems.py [--out DIR] [--rows 60] [--test_rows ROWS] [--seed 0]

Writes DIR/word_problems_train.jsonl and DIR/word_problems_test.jsonl (default DIR:
$SDPO_CACHE/word_problems), `--rows` distinct problems in the train split and `--test_rows`
(default: `--rows`) in the test split, no problem in both. The train split is drawn first, so
its rows do not depend on `--test_rows` (the first N test rows do depend on `--rows`). A row is
{"uid", "prompt", "answer", "teacher_response"}: the prompt asks for "Answer: <number>"
(the math reward also accepts a last number), teacher_response is a worked reference used
by `--teacher_gap` as the demonstration. Train with

    python run.py --model.path DIR --data.task DIR/word_problems_train.jsonl \\
        --data.eval_path DIR/word_problems_test.jsonl --data.reward math

Problems are one operation on small numbers (sums and differences up to 20, products up to
9 x 9, exact divisions), the level a 135M instruction-tuned model half solves.
"""
import argparse
import json
import os
import random

NAMES = ["Tom", "Anna", "Ben", "Maria", "Leo", "Sara", "Omar", "Lily", "Jack", "Mia", "Noah", "Emma"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells", "cards", "balloons"]
INSTRUCTION = "Give the final answer as 'Answer: <number>'."


def problem(rng: random.Random) -> tuple[str, int, str]:
    """(question, answer, worked solution) for one random problem."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(["add", "sub", "mul", "div"])
    if kind == "add":
        a, b = rng.randint(2, 12), rng.randint(2, 9)
        return (f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?",
                a + b, f"{a} + {b} = {a + b}")
    if kind == "sub":
        a = rng.randint(6, 20)
        b = rng.randint(1, a - 1)
        return (f"{name} has {a} {item} and gives {b} of them to a friend. How many {item} does {name} have left?",
                a - b, f"{a} - {b} = {a - b}")
    if kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return (f"{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have in total?",
                a * b, f"{a} * {b} = {a * b}")
    b, q = rng.randint(2, 6), rng.randint(2, 9)
    return (f"{name} shares {b * q} {item} equally among {b} friends. How many {item} does each friend get?",
            q, f"{b * q} / {b} = {q}")


def write(out_dir: str, rows: int = 60, seed: int = 0, test_rows: int = 0) -> dict:
    """Write both files (train: `rows` problems, test: `test_rows`, default `rows`) and return
    {"train": path, "test": path}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {split: os.path.join(out_dir, f"word_problems_{split}.jsonl") for split in ("train", "test")}
    rng, seen = random.Random(seed), set()
    sizes = {"train": rows, "test": test_rows or rows}
    for split, path in paths.items():
        lines = []
        while len(lines) < sizes[split]:
            question, answer, work = problem(rng)
            if question in seen:
                continue
            seen.add(question)
            lines.append(json.dumps({"uid": f"wp-{split}-{len(lines):03d}", "prompt": f"{question} {INSTRUCTION}",
                                     "answer": str(answer), "teacher_response": f"{work}\nAnswer: {answer}"}))
        with open(path + ".tmp", "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(path + ".tmp", path)
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cache = os.environ.get("SDPO_CACHE", os.path.expanduser("~/.cache/sdpo"))
    parser.add_argument("--out", default=os.path.join(cache, "word_problems"))
    parser.add_argument("--rows", type=int, default=60)
    parser.add_argument("--test_rows", type=int, default=0, help="test split size (default: --rows)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in write(args.out, args.rows, args.seed, args.test_rows).values():
        print(path)

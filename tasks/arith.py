"""The arithmetic task: one sum, difference or product of two integers, exact answer.

Its checker is feedback/math.py's `math_reward` (the one user math datasets use): the rows name
"math". It has no recipe of its own: tiny_models.RECIPE serves it.
"""
import random
from dataclasses import dataclass

REWARD = "math"  # the checker its rows name (feedback.get_reward_fn)
INSTRUCTION = "Give the final answer as 'Answer: <number>'."


@dataclass
class Flags:
    """Its difficulty (--data.*)."""
    arith_digits: int = 2  # operand digits of the arithmetic task
    arith_ops: str = "+-"  # operators drawn from


def make_row(rng: random.Random, cfg: Flags) -> dict:
    lo, hi = 10 ** (cfg.arith_digits - 1) if cfg.arith_digits > 1 else 0, 10 ** cfg.arith_digits - 1
    a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(cfg.arith_ops)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = f"What is {a} {op} {b}?"
    return {
        "uid": f"arith:{a}{op}{b}",
        "messages": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "answer": str(value),
        "tests": None,
        "reference": f"{a} {op} {b} = {value}\nAnswer: {value}",
        "reward": REWARD,
    }


def wrong_response(row: dict, rng: random.Random) -> str | None:
    """A plausible wrong answer to a math row with a whole-number answer (a file's too), else None."""
    if row.get("answer") is not None and row["answer"].lstrip("-").isdigit():
        wrong = int(row["answer"]) + rng.choice([-10, -2, -1, 1, 2, 10])
        return f"Answer: {wrong}"
    return None

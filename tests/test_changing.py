"""The change budgets of docs/changing.md: a new task and a new objective are each their file and
one line in their table. In a copy of the project, the examples of docs/data.md (a task) and
docs/changing.md (an objective) are written as the docs print them, nothing else is touched, and
the run trains one step of the objective on the task."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from test_run import ROOT

IGNORED = shutil.ignore_patterns(".git", "tests", "bench", "docs", "sweeps", "runs", "__pycache__")


def doc_blocks(page: str) -> dict:
    """{path: code} of a docs page's Python blocks that start with a `# path` line."""
    with open(os.path.join(ROOT, "docs", page)) as f:
        return dict(re.findall(r"```python\n# ([\w/.]+\.py)[^\n]*\n(.*?)```", f.read(), re.S))


def budget(change: str) -> list:
    """The files docs/changing.md's table says a change touches, with <name> as written."""
    with open(os.path.join(ROOT, "docs", "changing.md")) as f:
        row = next(line for line in f if line.startswith(f"| {change} |"))
    return re.findall(r"`([\w/<>.]+\.py)`", row.split("|")[2])


def add_line(path, after: str, line: str):
    """path's table with line inserted after its entry `after`."""
    with open(path) as f:
        table = f.read()
    assert after in table, (path, after)
    with open(path, "w") as f:
        f.write(table.replace(after, after + line, 1))


def changed_files(copy) -> set:
    """The files of the copy that the project does not hold as they are."""
    changed = set()
    for folder, subfolders, files in os.walk(copy):
        subfolders[:] = [s for s in subfolders if s != "__pycache__"]
        for name in files:
            path = os.path.join(folder, name)
            original = os.path.join(ROOT, os.path.relpath(path, copy))
            with open(path, "rb") as a:
                if not os.path.exists(original) or open(original, "rb").read() != a.read():
                    changed.add(os.path.relpath(path, copy))
    return changed


@pytest.mark.slow
def test_a_new_task_and_a_new_objective_are_their_files_and_a_table_line_each(tiny_dir, tmp_path):
    assert budget("a new task") == ["tasks/<name>.py", "tasks/__init__.py"]
    assert budget("a new objective") == ["objectives/<name>.py", "objectives/__init__.py", "losses.py"]  # a formula
    task, objective = doc_blocks("data.md"), doc_blocks("changing.md")
    copy = tmp_path / "project"
    shutil.copytree(ROOT, copy, ignore=IGNORED)
    (copy / "tasks" / "sort.py").write_text(task["tasks/sort.py"])
    add_line(copy / "tasks" / "__init__.py", '    "shapes",\n', task["tasks/__init__.py"])
    (copy / "objectives" / "rft.py").write_text(objective["objectives/rft.py"])
    add_line(copy / "objectives" / "__init__.py", '    "gad",\n', objective["objectives/__init__.py"])
    assert changed_files(copy) == {"tasks/sort.py", "tasks/__init__.py", "objectives/rft.py", "objectives/__init__.py"}

    out = tmp_path / "run"
    # the project's tiny model (no warm start, no build of its own), and every sample kept
    flags = [f"--model.path={tiny_dir}", "--data.task=sort", "--algo=rft", "--rft.threshold=0", "--train.steps=1",
             "--train.prompts_per_step=2", "--rollout.n=2", "--rollout.max_tokens=8", "--train.mini_batches=1",
             "--train.eval_every=0", "--data.train_rows=8", "--data.eval_rows=4", f"--log.out_dir={out}",
             "--log.wandb_mode=disabled", "--log.progress=False"]
    done = subprocess.run([sys.executable, "run.py", *flags], cwd=copy, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "recipe: sort (tasks/sort.py)" in done.stdout  # the task's own recipe, picked by --recipe auto
    with open(out / "config.json") as f:
        config = json.load(f)
    assert config["algo"]["name"] == "rft" and config["rft"] == {"threshold": 0.0} and config["data"]["sort_len"] == 5
    with open(out / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f]
    assert [s["step"] for s in steps] == [1]
    assert steps[0]["actor/grad_norm"] > 0 and steps[0]["actor/skipped_steps"] == 0  # every sample trained

"""The house's layers, read from the source (README, Files; docs/changing.md).

The import graph is every `import` the syntax tree holds, inside functions too, less those under
`if TYPE_CHECKING:` (annotations only). It must have no circle; every arrow must run down the
floors declared once below, a package (tasks/, feedback/, objectives/) on one floor; the loop's
mechanics must not reach into the tasks; config.py, the ground floor, imports nothing of the
project but its exceptions; and a module that only annotates with Config imports it only for the
type checker.
"""
import ast
import os

import pytest

from test_run import ROOT, project_sources

# The floors, bottom first, one line each: a module imports only from the floors below its own.
FLOORS = """
errors losses packing image_prompts
config distributed chunked_head feedback processes served
tasks microbatch teacher discriminator logger
data tiny_models policy
sdpo sync update
objectives rollout checkpoint
evaluate flags plan
warm_start
run
"""
LOOP = ("sync", "rollout", "update", "policy")  # the mechanics every task and objective runs through
GROUND = "config"
GROUND_MAY_IMPORT = {"errors"}  # the exceptions its checks raise


def module_name(path: str) -> str:
    parts = os.path.relpath(path, ROOT)[:-len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def syntax(path: str) -> tuple:
    """(path's syntax tree, the ids of its nodes under `if TYPE_CHECKING:`)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    return tree, {id(node) for block in ast.walk(tree)
                  if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}


def imports(path: str, modules: set) -> set:
    """The project modules path imports at run time: `import a.b`, `from a import b` (a.b where
    that is a module, else a), anywhere but under `if TYPE_CHECKING:`."""
    tree, typing_only = syntax(path)
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                      for alias in node.names}
    return {name for name in found if name in modules or name.split(".")[0] in modules}


def project_graph(sources=None) -> dict:
    """{module: the project modules it imports} (a module inside a package by its dotted name)."""
    sources = sources or project_sources()
    modules = {module_name(p) for p in sources}
    graph = {module_name(p): imports(p, modules) - {module_name(p)} for p in sources}
    return {m: {t if t in modules else t.split(".")[0] for t in targets} for m, targets in graph.items()}


def floors() -> dict:
    return {name: level for level, line in enumerate(FLOORS.strip().splitlines()) for name in line.split()}


def circle(graph: dict) -> list:
    """A circle of imports (its modules in order, the first again at the end), or []."""
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        state[m] = "done"
        path.pop()
        return []
    return next((found for m in sorted(graph) if m not in state and (found := visit(m))), [])


def layering_errors(graph: dict) -> list:
    """What breaks the house's rules, one line each (empty: none)."""
    level, top = floors(), lambda m: m.split(".")[0]
    errors = [f"{m} is on no floor: add it to test_layers.FLOORS" for m in sorted({top(m) for m in graph} - set(level))]
    if found := circle(graph):
        errors.append("a circle of imports: " + " -> ".join(found))
    for m, targets in sorted(graph.items()):
        for t in sorted(targets):
            if top(t) != top(m) and top(m) in level and top(t) in level and level[top(t)] >= level[top(m)]:
                errors.append(f"{m} (floor {level[top(m)]}) imports {t} (floor {level[top(t)]}): an arrow up the house")
            if top(m) in LOOP and top(t) == "tasks":
                errors.append(f"{m} imports {t}: the loop's mechanics name no task")
    errors += [f"{GROUND}.py imports {t} at run time: the ground floor imports nothing of the project"
               for t in sorted(graph.get(GROUND, set()) - GROUND_MAY_IMPORT)]
    return errors


def annotation_only_config(path: str) -> bool:
    """Whether path imports Config from config at run time but uses it only in annotations."""
    tree, typing_only = syntax(path)
    imported = any(isinstance(node, ast.ImportFrom) and node.module == "config" and id(node) not in typing_only
                   and any(alias.name == "Config" for alias in node.names) for node in ast.walk(tree))
    annotations = {id(name) for node in ast.walk(tree) for part in annotation_parts(node) for name in ast.walk(part)}
    used = any(isinstance(node, ast.Name) and node.id == "Config" and id(node) not in annotations
               for node in ast.walk(tree))
    return imported and not used


def annotation_parts(node) -> list:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs + [node.args.vararg, node.args.kwarg]
        return [a.annotation for a in args if a is not None and a.annotation is not None] + \
            ([node.returns] if node.returns is not None else [])
    return [node.annotation] if isinstance(node, ast.AnnAssign) else []


def test_the_house_has_no_circle_and_every_arrow_runs_down():
    graph = project_graph()
    assert {"config", "run", "objectives", "objectives.sdpo", "tasks.quiz"} <= set(graph)  # the scan finds them
    assert "errors" in graph["config"] and "objectives.grpo" in graph["objectives.hybrid"]  # and their arrows
    assert layering_errors(graph) == []


@pytest.mark.parametrize("arrow,message", [
    (("losses", "run"), "an arrow up the house"),
    (("microbatch", "logger"), "an arrow up the house"),  # sideways: the same floor
    (("update", "tasks"), "the loop's mechanics name no task"),
    (("config", "losses"), "the ground floor imports nothing of the project"),
    (("objectives.grpo", "objectives.hybrid"), "a circle of imports"),
])
def test_each_rule_fails_on_an_arrow_that_breaks_it(arrow, message):
    """The rules themselves: one arrow added to the real graph breaks each."""
    graph = project_graph()
    source, target = arrow
    graph[source] = graph[source] | {target}
    assert any(message in error for error in layering_errors(graph))


def test_a_module_that_only_annotates_with_config_does_not_import_it_at_run_time():
    assert [os.path.relpath(p, ROOT) for p in project_sources() if annotation_only_config(p)] == []


def test_the_config_import_check_tells_an_annotation_from_a_use(tmp_path):
    annotated = tmp_path / "annotated.py"
    annotated.write_text("from config import Config\n\n\ndef f(cfg: Config) -> Config:\n    return cfg\n")
    used = tmp_path / "used.py"
    used.write_text("from config import Config\n\n\ndef f(cfg: Config):\n    return Config()\n")
    hidden = tmp_path / "hidden.py"
    hidden.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from config import Config\n\n\n"
                      "def f(cfg: Config):\n    return cfg\n")
    assert [annotation_only_config(str(p)) for p in (annotated, used, hidden)] == [True, False, False]

"""The command line: the run's Config, config.py's sections with the tables' own flags, the
recipes that set their values, and parse_config, which checks every value before any work.

The tables hand in their flags: the tasks' (tasks.TaskConfig, under --data) and the objectives'
(objectives.Sections: --algo, --sdpo, --dpo, --gad). A recipe is the tiny model's
(tiny_models.RECIPE) or a task's own (its RECIPE, RECIPE_BY_ALGO: tasks.recipe).
"""
import re
import sys
from dataclasses import dataclass, field

import config
import data
import feedback
import objectives
import tasks
import tiny_models
from config import apply_flags, debugging, flag_value, parse_flags  # noqa: F401 (the loop's and the tests')
from errors import FlagError



@dataclass
class DataConfig(config.DataConfig, tasks.TaskConfig):  # fields: the tasks', then the data's own
    pass


@dataclass
class Config(objectives.Sections, config.Config):  # fields: config.py's, the objectives' sections, the data's
    data: DataConfig = field(default_factory=DataConfig)


# The values the run prints beside its recipe's own: what decides how hard an update pushes
HEADLINE = ("optim.lr", "optim.warmup_steps", "train.mini_batches", "algo.eps_low", "algo.eps_high", "algo.kl_coef",
            "sdpo.alpha", "sdpo.topk", "sdpo.teacher_rate", "sdpo.include_environment_feedback", "rollout.max_tokens")


def parse_config(argv=None) -> Config:
    """Flags -> Config: the recipe's values (recipe_flags) on the flags' defaults, then the command
    line on top. Booleans take a value (--sdpo.add_tail=False), as sweep agents pass them.
    Every value is resolved here and checked (check_config) before any work starts. `--help`
    comes after the recipe is chosen, so it shows the values this run uses."""
    argv = sys.argv[1:] if argv is None else list(argv)
    argv = [re.sub(r"=(true|false)$", lambda m: "=" + m.group(1).capitalize(), a, flags=re.I) for a in argv]
    argv = [a + "=True" if a in ("--debug", "--plan") else a for a in argv]
    # which model, task, objective and recipe: they choose the recipe
    asked = parse_flags(Config(), [a for a in argv if a not in ("-h", "--help")])
    name = recipe_name(asked)
    flags = recipe_flags(name, asked.algo.name)
    cfg = parse_flags(apply_flags(Config(), flags, recipe_source(name)), argv, help_text(name, flags))
    cfg.recipe = name
    check_config(cfg)
    return cfg


def check_config(cfg: Config):
    """Values that would fail minutes later, after the engine's start, fail here, naming the flag:
    config.py's, the objectives' and the tasks' checks, then what needs a table to tell."""
    c = cfg
    config.check_config(c)
    objectives.check_flags(c)
    objective = objectives.OBJECTIVES[c.algo.name]  # a unit of the split: a prompt's samples, or a sample
    single = c.train.shuffle_samples and not (objective.keep_prompts_together or objective.references)
    units = c.train.prompts_per_step * (c.rollout.n if single else 1)
    if c.train.mini_batches > units:
        raise FlagError(f"--train.mini_batches={c.train.mini_batches}: more optimizer steps than the {units} "
                        f"{'prompts' if units == c.train.prompts_per_step else 'samples'} of a step")
    tasks.check_flags(c.data)  # else a task's flag would fail only once rows are drawn
    if c.data.reward:
        try:
            feedback.get_reward_fn(c.data.reward)
        except ValueError as e:  # it names the reward
            raise FlagError(f"--data.reward: {e}") from None
    if c.model.path:
        data.check_model_dir(c.model.path)


def help_text(name: str, flags: dict) -> str:
    """`--help`'s heading: which recipe the defaults below include, and how to see another's."""
    source = "the flags' own defaults, for a pretrained model" if name == "pretrained" else \
        f"{recipe_source(name)}: " + " ".join(f"--{k}={v}" for k, v in flags.items())
    return (f"Train a causal LM with SDPO, GRPO, GSPO, the hybrid, DPO/SPIN, GAD or SFT (README). The defaults "
            f"below are this run's: recipe {name} ({source}). Other flags choose another recipe: --model.path, "
            f"--data.task, --algo, --recipe NAME (pretrained, {', '.join(recipe_names())}).")


def recipe_names() -> list[str]:
    """The recipes --recipe takes besides pretrained: the tiny model's and each task's own."""
    return sorted(["tiny", *(name for name in tasks.TASKS if tasks.recipe(name, "") is not None)])


def recipe_source(name: str) -> str:
    """Where the recipe called name is written."""
    return "tiny_models.py" if name == "tiny" else f"tasks/{name}.py"


def recipe_name(cfg: Config) -> str:
    """--recipe, or for auto: pretrained for a --model.path the project did not build (the flags'
    defaults), else the task's own (tasks/<task>.py) where it has one, else tiny. A tiny model
    passed as --model.path (a warm start the benches reuse, a run's final model) keeps its task's."""
    if cfg.recipe != "auto":
        if cfg.recipe != "pretrained" and cfg.recipe not in recipe_names():
            raise FlagError(f"--recipe {cfg.recipe}: no such recipe (known: pretrained, {', '.join(recipe_names())})")
        return cfg.recipe
    if cfg.model.path and not tiny_models.built_here(cfg.model.path):
        return "pretrained"
    return cfg.data.task if tasks.recipe(cfg.data.task, "") is not None else "tiny"


def recipe_flags(name: str, algo: str) -> dict:
    """A recipe's flag values: a task's are the tiny model's, then its RECIPE, then its
    RECIPE_BY_ALGO[algo] (tasks.recipe)."""
    if name == "pretrained":
        return {}
    if name == "tiny":
        return dict(tiny_models.RECIPE)
    return {**recipe_flags("tiny", algo), **tasks.recipe(name, algo)}


def describe(cfg: Config) -> str:
    """The recipe and the values that decide a run's updates, as the run prints them."""
    flags = recipe_flags(cfg.recipe, cfg.algo.name)
    source = "the flags' defaults, for a pretrained model" if cfg.recipe == "pretrained" else recipe_source(cfg.recipe)
    names = list(flags) + [n for n in HEADLINE if n not in flags]
    return f"recipe: {cfg.recipe} ({source}): " + " ".join(f"--{n}={flag_value(cfg, n)}" for n in names)

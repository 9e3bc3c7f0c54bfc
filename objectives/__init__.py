"""The objectives' table (OBJECTIVES): one file per objective in this folder, and their flags composed.

An objective's file holds all of it (docs/changing.md walks through one):
    OBJECTIVES       its rows, {name: microbatch.Objective}: --algo offers exactly them (grpo.py
                     holds grpo and gspo). A row is its micro-batch loss, its prepare and its
                     hooks: its extra models (build_models) and what the loop does with them
                     before the gradient passes and after the update (microbatch.Objective)
    Fields           optional: a dataclass of what its prepare writes on each rollout (Rollout.fields)
    Flags, Section   optional: a dataclass of its flags, and the Config section that holds
                     them under its name (--sdpo.*, --dpo.*, --gad.*)
    AlgoFlags        optional: a dataclass of its flags under --algo.* (--algo.eps_high, --algo.lam)
    check_flags(cfg) optional: checks of its flags before any work starts
Its formulas are losses.py's pure functions. The loop (run.py, update.py) calls a row's hooks
and never names an objective nor its models.
"""
import importlib
from dataclasses import dataclass, field
from typing import Annotated, Literal

import tyro

# The table: one line per objective's file, in this folder.
FILES = [importlib.import_module(f"objectives.{name}") for name in (
    "sdpo",
    "grpo",
    "hybrid",
    "sft",
    "dpo",
    "gad",
)]
OBJECTIVES = {name: row for file in FILES for name, row in file.OBJECTIVES.items()}


@dataclass
class AlgoName:
    # the choices are the rows of objectives.OBJECTIVES
    name: Annotated[Literal[tuple(OBJECTIVES)], tyro.conf.arg(name="algo", prefix_name=False)] = "sdpo"


@dataclass
class Aggregation:
    loss_agg_mode: Literal["auto", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "auto"  # auto: seq-mean-token-mean for GSPO, else token-mean


# --algo and the flags under --algo.*: every objective's AlgoFlags, in the table's order
@dataclass
class AlgoConfig(*reversed([AlgoName, *(file.AlgoFlags for file in FILES if hasattr(file, "AlgoFlags")),
                            Aggregation])):  # fields: last base first
    pass


@dataclass
class Algo:
    algo: AlgoConfig = field(default_factory=AlgoConfig)


# The objectives' sections of the run's Config (flags.Config): --algo, then each file's own
# (its Section: its Flags under the file's name, --sdpo, --dpo, --gad), in the table's order
@dataclass
class Sections(*reversed([Algo, *(file.Section for file in FILES if hasattr(file, "Section"))])):
    pass


def check_flags(cfg):
    """Every objective's checks of its flags, before any work starts."""
    for file in FILES:
        if hasattr(file, "check_flags"):
            file.check_flags(cfg)

"""The manners task (GAD's testbed): its recipe lives with the task, in tasks/manners.py."""
from tasks.manners import RECIPE_BASE as BASE, RECIPE_BY_ALGO as BY_ALGO, RECIPE_FLAGS as FLAGS  # noqa: F401

"""The user's mistakes: a flag, a path, a data file's row, each a message that says what to do.

run.main prints such a message alone (`--debug` adds the traceback); a bug raises any other
type and keeps its traceback. Every module may raise these: this file imports nothing of ours.
"""


class UserError(Exception):
    """A mistake in what the user gave (a flag, a data file, a model path, the out_dir, a
    checkpoint, a reward's setup); the command line exits with exit_code."""
    exit_code = 1
    kept_across_ranks = True  # distributed.rank0_call raises it on every rank as a UserError


class FlagError(UserError, ValueError):
    """A flag's value that cannot work (exit status 2, as for a flag the parser rejects)."""
    exit_code = 2


class PathError(UserError, OSError):
    """A path given that cannot serve: a missing model directory or checkpoint, an out_dir that
    cannot be written, is full or holds an earlier run."""


class DataError(UserError, ValueError):
    """A data file, row or field that cannot be read as the run needs it."""

"""The user's mistakes: a flag, a path, a data file's row, each a message that says what to do.

run.main prints such a message alone (`--debug` adds the traceback); a bug raises any other
type and keeps its traceback. Every module may raise these: this file imports nothing of ours.
"""
import errno
import os
import shutil


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


# A write that fails with less than this free on its disk failed of a full disk: torch.save
# reports the ENOSPC of a full disk as "unexpected pos", a RuntimeError without an errno.
FULL_DISK_BYTES = 2 ** 20


def disk_full(error: BaseException, folder: str) -> bool:
    """Whether error, raised while writing into folder, came of a full disk: an ENOSPC or
    EDQUOT in its chain (torch.distributed.checkpoint's CheckpointException holds each rank's
    in `failures`), or less than FULL_DISK_BYTES free there."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        todo += [e.__cause__, e.__context__, *(f[0] for f in getattr(e, "failures", {}).values())]
    return free_bytes(folder) < FULL_DISK_BYTES


def free_bytes(folder: str) -> int:
    """The bytes free on folder's disk (its nearest existing parent's)."""
    folder = os.path.abspath(folder)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return shutil.disk_usage(folder).free


def no_space(folder: str, what: str, then: str) -> PathError:
    """The one message a run stops with when writing `what` into folder found its disk full."""
    return PathError(f"no space left on the disk of {folder} while writing {what} "
                     f"({free_bytes(folder) / 2**30:.3g} GiB free now): {then}")

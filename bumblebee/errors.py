"""The errors a user can cause, shared by every layer (a leaf: imports nothing of bumblebee).

The CLI prints their message as one line (``bumblebee: error: ...``) and exits with code 2;
anything else reaching the CLI is a bug and keeps its traceback.
"""


class ConfigError(ValueError):
    """Invalid user input. The message is one line, printed as-is by the CLI."""


def gather(*checks) -> None:
    """Run every check; raise one ``ConfigError`` whose lines are all their failures, in order
    (all config errors of one invocation are reported together, not one per attempt). A check
    that fails in any other way after an earlier one failed is skipped: it may have tripped over
    that problem."""
    lines: list[str] = []
    for check in checks:
        try:
            check()
        except ConfigError as e:
            lines += [line for line in str(e).splitlines() if line not in lines]
        except Exception:
            if not lines:
                raise
    if lines:
        raise ConfigError("\n".join(lines))


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded as asked (missing file, wrong shape, ...)."""


class DiskFullError(ConfigError):
    """A write that ran out of room (disk full, quota, file-size limit): one line naming the
    filesystem and its free space; whatever was being written has been removed."""


def out_of_room(exc: BaseException) -> bool:
    """Whether ``exc`` is a write failing for lack of room. torch's zip writer (``torch.save``,
    DCP's files) reports it as a RuntimeError ("file write failed", or "unexpected pos" when a
    write came up short), not an OSError."""
    import errno

    codes = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", 122)}
    if isinstance(exc, OSError):
        return exc.errno in codes
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "file write failed" in text  # a short write in its zip writer:
        or ("inline_container" in text and "unexpected pos" in text)
    )


def disk_full(path: str, doing: str, exc: BaseException) -> DiskFullError:
    """The one-line error for ``exc`` (``out_of_room``) while ``doing`` under ``path``."""
    import os
    import shutil

    where = os.path.abspath(path)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        free = f"{shutil.disk_usage(where).free / 2**20:.0f} MiB free"
    except OSError:
        free = "free space unknown"
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "file write failed"
    err = DiskFullError(
        f"{path}: no room to {doing} ({why}: disk full or over a file-size limit; {free} on "
        f"the filesystem of {where}); nothing partial was kept"
    )
    err.cause = exc  # a caller that knows the path better can say it again (disk_full(path, doing, err.cause))
    return err

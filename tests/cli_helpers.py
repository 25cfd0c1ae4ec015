"""What the bad-input tests share: ``--set`` argument lists and the one-line-error check of
the CLI (exit 2, the last stderr line ``bumblebee: error: ...`` naming the problem)."""

from bumblebee.cli import main


def sets(items):
    return [a for s in items for a in ("--set", s)]


def one_line_error(capsys, argv, fragment, notices_before: bool = False) -> str:
    """Run ``bumblebee argv``; assert exit 2 with the error as the last stderr line containing
    ``fragment`` and no traceback. Unless ``notices_before``, it must be the only line."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert lines and lines[-1].startswith("bumblebee: error: ") and "Traceback" not in err, err
    assert notices_before or len(lines) == 1, err
    assert fragment in lines[-1], lines[-1]
    return lines[-1]

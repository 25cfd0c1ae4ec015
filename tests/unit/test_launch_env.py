"""torchrun's variables are checked before any collective: a malformed, partial or inconsistent
set is one line naming the variable (exit 2), never a traceback from ``init_process_group`` or
a rank waiting for peers that cannot exist; a rendezvous port already taken is one line too."""

import os
import socket
import subprocess
import sys

import pytest

from bumblebee.config import ConfigError
from bumblebee.runtime.launch.launch_env import check_launch_env

FULL = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "env, message",
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer"),
        ({"LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' is not an integer"),
        (
            {"TORCHELASTIC_RESTART_COUNT": "abc"},
            "TORCHELASTIC_RESTART_COUNT='abc' is not an integer",
        ),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999' must be >= 1 and <= 65535"),
        ({**FULL, "RANK": "-1"}, "RANK='-1' must be >= 0"),
        ({**FULL, "RANK": "2"}, "RANK=2 must be < WORLD_SIZE=2"),
        ({**FULL, "WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be >= 1"),
        ({"LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_RANK=4 must be < LOCAL_WORLD_SIZE=4"),
        ({"TORCHELASTIC_RUN_ID": "x"}, "TORCHELASTIC_RUN_ID set but RANK, WORLD_SIZE, MASTER_ADDR"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"},
            "RANK and WORLD_SIZE set but MASTER_ADDR not",
        ),
    ],
)
def test_bad_launch_variables_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_launch_env(env)


@pytest.mark.parametrize(
    "env",
    [{}, FULL, {**FULL, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, {"WORLD_SIZE": "2"}],
)
def test_good_launch_environments_pass(env):
    check_launch_env(env)


def _cli(env_vars, tmp_path, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in FULL and "TORCHELASTIC" not in k}
    env.update(env_vars, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "bumblebee.cli", "train", "--set", f"train.out_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_rank_outside_the_world_is_one_line_not_a_hang(tmp_path):
    r = _cli({**FULL, "RANK": "3"}, tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "RANK=3 must be < WORLD_SIZE=2" in r.stderr and "Traceback" not in r.stderr


def test_master_port_in_use_is_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _cli({**FULL, "WORLD_SIZE": "1", "MASTER_PORT": str(port)}, tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"MASTER_PORT={port} is already in use" in r.stderr and "Traceback" not in r.stderr


CLI_CASES = [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer"),
    ({"LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' is not an integer"),
    ({"TORCHELASTIC_RESTART_COUNT": "abc"}, "TORCHELASTIC_RESTART_COUNT='abc' is not an integer"),
    ({"TORCHELASTIC_RUN_ID": "x"}, "TORCHELASTIC_RUN_ID set but RANK, WORLD_SIZE, MASTER_ADDR"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "set but MASTER_ADDR not"),
    ({**FULL, "RANK": "-1"}, "RANK='-1' must be >= 0"),
    ({"RANK": "-1"}, "RANK='-1' must be >= 0"),
    ({**FULL, "RANK": "2"}, "RANK=2 must be < WORLD_SIZE=2"),
]


@pytest.mark.parametrize("command", ["train", "rl"])
@pytest.mark.parametrize("env, message", CLI_CASES, ids=[m for _, m in CLI_CASES])
def test_each_bad_variable_through_the_cli(tmp_path, capsys, monkeypatch, command, env, message):
    """The probe's forms through ``bumblebee train`` / ``rl`` in this process: exit 2 with one
    line naming the variable, before any collective (an alarm stands in for the hang a rank
    outside the world used to be)."""
    import signal

    from bumblebee.cli import main

    for name in [*FULL, "LOCAL_RANK", "LOCAL_WORLD_SIZE"]:
        monkeypatch.delenv(name, raising=False)
    for name in [k for k in os.environ if "TORCHELASTIC" in k]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    class Hung(BaseException):  # not TimeoutError, an OSError that error handling could swallow
        pass

    def hung(*_):
        raise Hung("no answer within 60 s: a collective waited for peers")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        code = main([command, "--set", f"train.out_dir={tmp_path / 'run'}"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("bumblebee: error: ") and message in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

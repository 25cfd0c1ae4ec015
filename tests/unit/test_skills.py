"""Skill documents (skills/): every registered implementation has ``skills/<slot>/<impl>.md``
with exactly the six section headings, a Trade-offs table with memory / communication /
compute rows, and a row in skills/README.md; every ``bumblebee ...`` command shown in a
```bash block parses with the real CLI parser (train and pair commands also build a valid
config), and every test file named after ``pytest`` exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import bumblebee.primitives  # noqa: F401  (registers every implementation; the package root is lazy)
from bumblebee import registry
from bumblebee.cli import build_parser

ROOT = Path(__file__).parents[2]
SKILLS = ROOT / "skills"
HEADINGS = [
    "## What it does",
    "## When to choose it",
    "## How to compose it",
    "## How to validate it",
    "## Trade-offs",
    "## Limits",
]
REGISTERED = [(slot, name) for slot in registry.SLOTS for name in registry.implementations(slot)]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def section(text: str, heading: str) -> list[str]:
    lines = prose_lines(text)
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def bash_commands(text: str) -> list[str]:
    """Commands of the ```bash blocks: continuation lines joined, comments and blanks dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for cmd in block.replace("\\\n", " ").splitlines():
            if cmd.strip() and not cmd.lstrip().startswith("#"):
                commands.append(cmd.strip())
    return commands


def all_commands():
    return [
        (p.relative_to(ROOT).as_posix(), c)
        for p in sorted(SKILLS.rglob("*.md"))
        for c in bash_commands(p.read_text())
    ]


@pytest.mark.parametrize("slot,impl", REGISTERED, ids=[f"{s}/{i}" for s, i in REGISTERED])
def test_every_implementation_has_its_skill(slot, impl):
    path = SKILLS / slot / f"{impl}.md"
    assert path.is_file(), f"missing skill document {path.relative_to(ROOT)}"
    text = path.read_text()
    headings = [line.rstrip() for line in prose_lines(text) if line.startswith("## ")]
    assert headings == HEADINGS, (
        f"{path.relative_to(ROOT)}: headings {headings}, expected {HEADINGS}"
    )
    rows = [
        line.split("|")[1].strip()
        for line in section(text, "## Trade-offs")
        if line.startswith("|")
    ]
    missing = [
        k for k in ("memory", "communication", "compute") if not any(r.startswith(k) for r in rows)
    ]
    assert not missing, f"{path.relative_to(ROOT)}: Trade-offs table lacks rows {missing}"


def index_rows() -> dict[tuple[str, str], str]:
    """(slot, implementation) -> link target, from the table in skills/README.md."""
    rows = {}
    for line in (SKILLS / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        link = re.search(r"\]\(([^)]+\.md)\)", cells[-1]) if len(cells) == 5 else None
        if link:
            rows[(cells[0], cells[1])] = link.group(1)
    return rows


def test_index_lists_every_implementation():
    rows = index_rows()
    missing = [f"{s}/{i}" for s, i in REGISTERED if (s, i) not in rows]
    assert not missing, f"skills/README.md does not list {missing}"
    stale = [f"{s}/{i}" for s, i in rows if (s, i) not in REGISTERED]
    assert not stale, f"skills/README.md lists unregistered implementations {stale}"
    for (slot, impl), link in rows.items():
        assert link == f"{slot}/{impl}.md" and (SKILLS / link).is_file(), (
            f"bad link {link} for {slot}/{impl}"
        )


def test_skills_show_commands():
    assert any(c.startswith("bumblebee pair ") for _, c in all_commands())


@pytest.mark.parametrize("doc,command", all_commands())
def test_commands_parse_and_tests_exist(doc, command):
    argv = shlex.split(command)
    if argv[0] == "bumblebee":
        try:
            args = build_parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{doc}: `{command}` does not parse")
        if args.command == "train":
            from bumblebee import load_config

            load_config(args.config, args.overrides)
        elif args.command == "pair":
            from bumblebee.runtime.pair.command import build_pair, check_diff, config_diff

            cfg_a, cfg_b, _ = build_pair(args)
            check_diff(config_diff(cfg_a, cfg_b), args.slot)
    if "pytest" in argv:
        for arg in argv[argv.index("pytest") + 1 :]:
            if not arg.startswith("-"):
                assert (ROOT / arg.split("::")[0]).exists(), (
                    f"{doc}: `{command}` names a missing test {arg}"
                )

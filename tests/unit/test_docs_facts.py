"""Facts the README, docs/ and skills/ state, held against the code they describe.

- the model families: the README's one-paragraph list (`` `name` (Display name) ``) and the table
  of docs/architecture.md ("Model families") name exactly the registry's families
  (``bumblebee.models.family.FAMILIES``), in its order;
- the slots: the README's "Primitive slots:" paragraph and docs/architecture.md ("Slots and
  primitives": one line per slot, ``- `slot`: ... implementations: `a` (reference), `b`;
  default: `b` ``) name exactly ``bumblebee.registry.SLOTS``, each slot's implementations and
  its reference as registered;
- defaults: every default a page names equals ``bumblebee.config``'s. The conventions, which the
  pages use and this test reads: ``default: `NAME` `` in docs/architecture.md's slot lines; a row
  of skills/README.md marked "(default)" and a slot page's title with "default" in its
  parentheses (`# loss / linear_ce (default)`) only for the slot's config default; and anywhere in
  README.md, docs/ or skills/ a key written as `` `section.key = VALUE` (default) ``, `` `[section]
  key = VALUE` (the config default) `` or `` `... = X` (the config default is `Y`) `` (a bare key
  such as `` `chat_loss = "assistant"` (default) `` resolves to the one section that has it);
- commands: every ``bumblebee ...`` command of a ```bash block in README.md and docs/*.md parses
  with the CLI's own parser (``bumblebee.cli.build_parser``; nothing runs), and a `train`
  command's config (its ``--set`` keys and values) loads; the README's two commands pin the torch
  that `.ci/` installs.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from pathlib import Path

import pytest

import bumblebee.primitives  # noqa: F401  (registers every implementation; the package root is lazy)
from bumblebee import load_config, registry
from bumblebee.cli import build_parser
from bumblebee.config import Config, PrimitivesConfig
from bumblebee.config_parse import tomllib
from bumblebee.errors import ConfigError
from bumblebee.models.family import FAMILIES

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
ARCH = ROOT / "docs" / "architecture.md"
SKILLS = ROOT / "skills"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PRIM_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PrimitivesConfig)}


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole line) up to the next heading of its level or above."""
    match = re.search(rf"^{re.escape(heading)}$", text, flags=re.M)
    assert match, f"no heading {heading!r}"
    level = len(heading) - len(heading.lstrip("#"))
    end = re.compile(rf"^#{{1,{level}}} ", flags=re.M).search(text, match.end())
    return text[match.end() : end.start() if end else len(text)]


def paragraph(text: str, starts: str) -> str:
    """The paragraph (lines up to a blank one) holding ``starts``."""
    for para in re.split(r"\n\s*\n", text):
        if starts in para:
            return para
    raise AssertionError(f"no paragraph with {starts!r}")


# -- (a) model families ---------------------------------------------------------------------------


def readme_families() -> list[str]:
    para = paragraph(README.read_text(), "model families")
    return re.findall(r"`(\w+)`\s+\(", para)


def architecture_families() -> list[str]:
    table = section(ARCH.read_text(), "## Model families")
    return re.findall(r"^\| `(\w+)` \|", table, flags=re.M)


def test_readme_lists_every_family():
    assert readme_families() == list(FAMILIES), (
        f"README's family paragraph names {readme_families()}, the registry {list(FAMILIES)}"
    )


def test_architecture_lists_every_family():
    assert architecture_families() == list(FAMILIES), (
        f"docs/architecture.md's family table names {architecture_families()}, "
        f"the registry {list(FAMILIES)}"
    )


# -- (b) slots and implementations ----------------------------------------------------------------

SLOT_LINE = re.compile(
    r"^- `(?P<slot>\w+)`: .*? implementations: (?P<impls>.*?); default: `(?P<default>\w+)`$"
)


def architecture_slots() -> dict[str, dict]:
    """slot -> {"impls": [...], "reference": [...], "default": name}, from docs/architecture.md."""
    out = {}
    for line in section(ARCH.read_text(), "## Slots and primitives").splitlines():
        if not line.startswith("- `"):
            continue
        m = SLOT_LINE.match(line)
        assert m, f"docs/architecture.md: a slot line out of its form: {line}"
        impls = m["impls"]
        out[m["slot"]] = {
            "impls": re.findall(r"`(\w+)`", impls),
            "reference": re.findall(r"`(\w+)`\]?(?:\([^)]*\))? \(reference\)", impls),
            "default": m["default"],
        }
    return out


def test_readme_lists_every_slot():
    para = paragraph(README.read_text(), "Primitive slots:")
    named = re.findall(r"`(\w+)`", para.split("Primitive slots:", 1)[1].split("(", 1)[0])
    assert named == list(registry.SLOTS), (
        f"README names slots {named}, the registry {list(registry.SLOTS)}"
    )


def test_architecture_slots_and_implementations_match_the_registry():
    slots = architecture_slots()
    assert list(slots) == list(registry.SLOTS), (
        f"docs/architecture.md lists slots {list(slots)}, the registry {list(registry.SLOTS)}"
    )
    for slot, doc in slots.items():
        registered = list(registry.implementations(slot))
        assert sorted(doc["impls"]) == sorted(registered), (
            f"docs/architecture.md: {slot} implementations {doc['impls']}, registered {registered}"
        )
        assert doc["reference"] == [registry.reference(slot)], (
            f"docs/architecture.md: {slot} reference {doc['reference']}, "
            f"registered {registry.reference(slot)}"
        )


# -- (c) defaults ---------------------------------------------------------------------------------


def test_architecture_slot_defaults_are_the_config_defaults():
    wrong = {
        slot: (doc["default"], PRIM_DEFAULTS[slot])
        for slot, doc in architecture_slots().items()
        if doc["default"] != PRIM_DEFAULTS[slot]
    }
    assert not wrong, f"docs/architecture.md defaults (doc, config): {wrong}"


def test_skills_index_marks_the_config_defaults():
    marked = {}
    for line in (SKILLS / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in registry.SLOTS and re.search(r"\(default\)", cells[3]):
            marked.setdefault(cells[0], []).append(cells[1])
    expected = {slot: [PRIM_DEFAULTS[slot]] for slot in registry.SLOTS}
    assert marked == expected, f"skills/README.md marks {marked} as defaults; config: {expected}"


@pytest.mark.parametrize("slot", list(registry.SLOTS))
def test_skill_titles_say_default_only_for_the_default(slot):
    for impl in registry.implementations(slot):
        path = SKILLS / slot / f"{impl}.md"
        title = path.read_text().splitlines()[0]
        says = bool(re.search(r"\(([^)]*\b)?default\b[^)]*\)", title))
        is_default = impl == PRIM_DEFAULTS[slot]
        assert says == is_default, (
            f"{rel(path)}: title {title!r} "
            f"{'says default' if says else 'does not say default'}, "
            f"the config default is {PRIM_DEFAULTS[slot]!r}"
        )


# `section.key = VALUE` (default) | `[section] key = VALUE` (the config default)
# | `... = X` (the config default is `Y`)
DEFAULT_CLAIM = re.compile(
    r"`(?:\[(?P<sec>\w+)\] )?(?P<key>[\w.]+) = (?P<value>[^`]+)`,? "
    r"\((?:the config )?default(?: is `(?P<named>[^`]+)`)?[,;:)]"
)


def config_default(key: str, section_name: str | None):
    """The default of ``section.key`` (or of a key only one section has)."""
    cfg = Config()
    path = key.split(".")
    if section_name:
        path = [section_name, *path]
    if not hasattr(cfg, path[0]):
        holders = [
            f.name for f in dataclasses.fields(cfg) if hasattr(getattr(cfg, f.name), path[0])
        ]
        assert len(holders) == 1, f"key {key!r} is in sections {holders}: name the section"
        path = [holders[0], *path]
    obj = cfg
    for part in path:
        assert hasattr(obj, part), f"no config key {'.'.join(path)}"
        obj = getattr(obj, part)
    return ".".join(path), obj


def default_claims():
    pages = [README, *DOCS, *sorted(SKILLS.rglob("*.md"))]
    for page in pages:
        # a claim may wrap: read each paragraph as one line
        for para in re.split(r"\n\s*\n", page.read_text()):
            for m in DEFAULT_CLAIM.finditer(" ".join(para.split())):
                yield rel(page), m


def test_stated_defaults_are_the_config_defaults():
    claims = list(default_claims())
    assert len(claims) >= 10, f"only {len(claims)} default claims found: the pattern broke"
    wrong = []
    for page, m in claims:
        name, actual = config_default(m["key"], m["sec"])
        raw = m["named"] or m["value"]
        if m["named"]:
            raw = (
                raw if raw.startswith('"') or not re.fullmatch(r"[A-Za-z_]\w*", raw) else f'"{raw}"'
            )
        try:
            stated = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            stated = raw
        if stated != actual:
            wrong.append(
                f"{page}: {m.group(0)!r} says {name} defaults to {stated!r}; it is {actual!r}"
            )
    assert not wrong, "\n".join(wrong)


# -- (d) commands ---------------------------------------------------------------------------------


def bash_commands(text: str) -> list[str]:
    """The ``bumblebee`` commands of the ```bash blocks: continuation lines joined, comments
    dropped, ``&&`` / ``;`` / ``|`` chains split, redirections and ``...`` left out, and a
    ``-m bumblebee.cli`` launch (torchrun) read as ``bumblebee``."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#", " " + line, maxsplit=1)[0].strip()
            for part in re.split(r"&&|;|\|", line):
                argv = shlex.split(part)
                if "-m" in argv and "bumblebee.cli" in argv:
                    argv = ["bumblebee", *argv[argv.index("bumblebee.cli") + 1 :]]
                if not argv or argv[0] != "bumblebee":
                    continue
                if ">" in argv:
                    argv = argv[: argv.index(">")]
                commands.append(shlex.join(a for a in argv if a != "..."))
    return commands


def all_commands():
    return [(rel(p), c) for p in [README, *DOCS] for c in bash_commands(p.read_text())]


def test_readme_shows_every_subcommand():
    shown = {shlex.split(c)[1] for doc, c in all_commands() if doc == "README.md"}
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    assert shown == set(subparsers.choices), (
        f"README shows {sorted(shown)}; the CLI has {sorted(subparsers.choices)}"
    )


@pytest.mark.parametrize("doc,command", all_commands())
def test_commands_parse(doc, command):
    argv = shlex.split(command)
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{doc}: `{command}` does not parse")
    if args.command == "train" and (args.config is None or (ROOT / args.config).is_file()):
        cwd = os.getcwd()
        os.chdir(ROOT)  # a --config path is relative to the repository root
        try:
            load_config(args.config, args.overrides)
        except ConfigError as e:  # a data file the reader makes first is not there: fine
            wrong = [line for line in str(e).splitlines() if " not found" not in line]
            assert not wrong, f"{doc}: `{command}`: " + "; ".join(wrong)
        finally:
            os.chdir(cwd)


def test_readme_commands_pin_the_torch_ci_installs():
    text = README.read_text()
    pins = set(re.findall(r"pip install (torch==[\d.]+)", text))
    assert len(pins) == 1, f"README pins {pins or 'no torch'}"
    (pin,) = pins
    for ci in (".ci/bare_venv", ".ci/run"):
        assert f'pip" install -q {pin}' in (ROOT / ci).read_text() or (
            f"pip install {pin}" in (ROOT / ci).read_text()
        ), f"{ci} does not install {pin}"
    assert "pip install -e . && bumblebee train" in text
    assert 'pip install -e ".[test]" && python -m pytest' in text


# -- links ----------------------------------------------------------------------------------------


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings (lower case, punctuation but - and _ dropped)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in text.splitlines()
        if re.match(r"^#{1,6} ", line)
    }


def test_relative_links_resolve():
    """Every relative link (and its #anchor) of README.md, docs/, skills/ and benchmarks/README.md
    names a file (and heading) that exists: the pages moved out of the README link each other."""
    pages = [README, ROOT / "benchmarks" / "README.md", *DOCS, *sorted(SKILLS.rglob("*.md"))]
    bad = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                bad.append(f"{rel(page)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
                bad.append(f"{rel(page)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)

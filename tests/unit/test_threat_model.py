"""docs/threat_model.md (issue 51's "Done when"): it exists, says what bumblebee trusts, what it
does not and what it does about each, and every module and test file it points to exists (a
rename leaves no stale pointer)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "threat_model.md"


def test_the_threat_model_has_its_sections():
    text = DOC.read_text()
    for heading in ("## Trusted", "## Not trusted", "## Checkpoints", "## Faults treated"):
        assert f"\n{heading}" in text, heading
    for untrusted in ("checkpoint", "Hugging Face weights", "data", "chat templates", "shared"):
        assert untrusted in text.split("## Not trusted")[1].split("## Checkpoints")[0], untrusted
    assert "docs/threat_model.md" in (ROOT / "README.md").read_text()


def _resolves(name: str) -> bool:
    if (ROOT / name).exists() or (ROOT / "bumblebee" / name).exists():
        return True
    return any((ROOT / "bumblebee").rglob(pathlib.Path(name).name))  # `export_dir.py` alone


def test_every_file_it_names_exists():
    names = set(re.findall(r"`([\w./]+\.py)`", DOC.read_text()))
    assert len(names) >= 15, sorted(names)
    missing = sorted(n for n in names if not _resolves(n))
    assert not missing, missing
    for test in re.findall(r"`(tests/[\w/]+\.py)`", DOC.read_text()):
        assert (ROOT / test).is_file(), test

"""The documentation: the site builds in strict mode, and the README stays a front page.

``mkdocs build --strict`` fails on a broken link or anchor, a page missing from the navigation
and a link out of ``docs/`` (``mkdocs.yml``'s ``validation``), so a broken link fails the suite.
The command reference (``docs/gen_cli_reference.py``, an MkDocs hook) is generated from the
real parsers; the test checks it names every subcommand.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = (
    "bash scripts/demo.sh   # main job: install into .venv, `pdserve launch` (Ray), stream an "
    "answer, stop",
    "bash scripts/test.sh   # tests: install into .venv (with test extras), ruff, mypy, the whole "
    "pytest suite",
)
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")  # [text](target#anchor)


def subcommands(parser: argparse.ArgumentParser) -> list[str]:
    return [name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices]


def test_site_builds_strict_with_the_generated_reference(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner, not a build warning
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    reference = (site / "reference" / "index.html").read_text()
    names = subcommands(build_parser())
    assert names, "the parser has no subcommands"
    for name in names:
        assert f'id="{name}"' in reference and f"pdserve {name}" in reference, name
    assert not list(site.rglob("*.py")), "the generator was copied into the site"


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move the detail into docs/"
    assert lines[:6] == ["# pdserve", "", "```bash", *COMMANDS, "```"]


def test_readme_links_resolve() -> None:
    """The README is read on the forge, outside the site: its relative links name real files,
    and their anchors real headings (slugged as the forge and MkDocs both do)."""
    text = (ROOT / "README.md").read_text()
    links = [(m.group(1), m.group(2)) for m in LINK.finditer(text) if "://" not in m.group(1)]
    assert links
    missing = [target for target, _ in links if not (ROOT / target).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
    bad = [f"{target}{anchor}" for target, anchor in links
           if anchor and anchor[1:] not in heading_slugs(ROOT / target)]
    assert not bad, f"README.md links to missing anchors: {bad}"


def heading_slugs(page: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}

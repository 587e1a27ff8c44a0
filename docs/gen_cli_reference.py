"""The command reference page, generated from the ``pdserve`` command's own parsers.

``mkdocs.yml`` loads this file as an MkDocs hook: on every build, :func:`on_files` adds the
page ``reference.md``. It renders the page in a fresh interpreter (this file run as a script),
so ``mkdocs serve`` shows the flags as they are now, and with the ``PDSERVE_*`` environment
variables removed, so the defaults are the built-in ones (the fault-injection flags default to
``PDSERVE_FAULT_*``). Run it by hand to see the page: ``python docs/gen_cli_reference.py``.

The parser comes from :func:`cli.main.build_parser`; every subcommand gets its one-line help,
its usage, and a table of its flags (help text and default) per argument group.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files

PAGE = "reference.md"
ROOT = Path(__file__).resolve().parents[1]
WIDTH = 88  # columns of the usage blocks, whatever the terminal that builds the site
CODE = re.compile(r"``(.+?)``|`([^`]+)`")  # reST and Markdown code spans in help texts


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """MkDocs hook: add the generated reference page to the site's files."""
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    env = {key: value for key, value in os.environ.items() if not key.startswith("PDSERVE_")}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve())], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise PluginError(f"{Path(__file__).name} failed (exit {done.returncode}):\n"
                          f"{done.stderr.strip()}")
    files.append(File.generated(config, PAGE, content=done.stdout))
    return files


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = (),
             summary: str = "") -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """``parser`` and every parser below it, depth first: (its words after ``pdserve``, the
    parser, the one-line help its parent lists it with)."""
    yield path, parser, summary
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, child in action.choices.items():
                yield from commands(child, (*path, name), helps.get(name, ""))


def render(parser: argparse.ArgumentParser) -> str:
    """The whole reference page as Markdown."""
    found = list(commands(parser))
    lines = [
        "# Command reference",
        "",
        "Generated when the site is built, from the parsers of the `pdserve` command itself",
        "(`cli.main.build_parser`), so it lists exactly the flags the installed code takes.",
        "Every command also takes `-h` / `--help`. Defaults are the built-in ones, as in an",
        "environment without `PDSERVE_*` variables.",
        "",
    ]
    lines += [f"- [`{' '.join((parser.prog, *path))}`](#{anchor(path)}): {inline(summary)}"
              for path, _, summary in found[1:]]
    for path, command, summary in found:
        lines += [*([""] if lines[-1] else []), f"## {' '.join((parser.prog, *path))} "
                  f"{{#{anchor(path)}}}", ""]
        if summary:
            lines += [sentence(inline(summary)), ""]
        if command.description:
            lines += [inline(command.description), ""]
        lines += ["```text", usage(command).rstrip(), "```", ""]
        for group in command._action_groups:
            rows = [action for action in group._group_actions if shown(action)]
            if rows:
                lines += flag_table(command, group.title or "options", rows)
    return "\n".join(lines).rstrip() + "\n"


def anchor(path: tuple[str, ...]) -> str:
    return "-".join(path) or "pdserve"


def usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help()


def shown(action: argparse.Action) -> bool:
    return not isinstance(action, argparse._HelpAction | argparse._SubParsersAction) \
        and action.help != argparse.SUPPRESS


def flag_table(parser: argparse.ArgumentParser, title: str,
               actions: list[argparse.Action]) -> list[str]:
    """One argument group as an HTML table (help texts hold ``|``, ``<`` and ``*``, which a
    Markdown table would take for markup)."""
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    title = title[:1].upper() + title[1:]
    lines = [f"<p><strong>{html.escape(title)}</strong></p>", "<table>",
             "<thead><tr><th>flag</th><th>default</th><th>meaning</th></tr></thead>", "<tbody>"]
    for action in actions:
        if action.option_strings:
            flag = formatter._format_action_invocation(action)
        else:
            flag = formatter._format_args(action, action.dest)
        help_text = formatter._expand_help(action) if action.help else ""
        lines.append(f"<tr><td><code>{html.escape(flag)}</code></td>"
                     f"<td>{default_cell(action)}</td><td>{inline_html(help_text)}</td></tr>")
    return [*lines, "</tbody>", "</table>", ""]


def default_cell(action: argparse.Action) -> str:
    if action.required:
        return "required"
    value = action.default
    if value is None or value == argparse.SUPPRESS or value == [] or action.nargs == 0:
        return ""  # unset, or a switch (store_true and the like: off unless given)
    text = repr(value) if value == "" else str(value)
    return f"<code>{html.escape(text)}</code>"


def sentence(text: str) -> str:
    """``text`` with a capital and a full stop."""
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def inline(text: str) -> str:
    """A parser's text as Markdown: one line, its code spans kept."""
    return CODE.sub(lambda m: f"`{m.group(1) or m.group(2)}`", " ".join(text.split()))


def inline_html(text: str) -> str:
    """A help text as HTML: one line, escaped, its code spans as ``<code>``."""
    parts: list[str] = []
    last = 0
    text = " ".join(text.split())
    for match in CODE.finditer(text):
        parts += [html.escape(text[last:match.start()]),
                  f"<code>{html.escape(match.group(1) or match.group(2))}</code>"]
        last = match.end()
    return "".join([*parts, html.escape(text[last:])])


def main() -> int:
    """Print the page (what the hook adds to the site)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from cli.main import build_parser

    sys.stdout.write(render(build_parser()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

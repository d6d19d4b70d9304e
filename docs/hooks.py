"""The references generated from the code, and the MkDocs hooks that keep the site true.

The settings table comes from the settings model (`scheduler.config.settings.Settings`:
each field's name, environment variable, default and description) and the
command line reference from the argument parser (`scheduler.cli.commands`), so neither
can drift from the code. Each lives in its page between
`<!-- generated: NAME -->` and `<!-- end generated -->`, committed, so the pages
read the same on GitHub as on the site:

    python docs/hooks.py          # rewrite the generated parts of the pages

tests/unit/test_docs.py fails when a committed page differs from what this
module generates, and so does `mkdocs build --strict` (a warning below).

As MkDocs hooks (mkdocs.yml `hooks:`), for the site only: a page's link to a
file of the repository outside docs/ (bench/RESULTS.md, a test) becomes a link
to the repository when `repo_url` is set, else the link's text; and
`<!-- include: PATH -->` is replaced by that repository file, its headings one
level down (on GitHub the page links to it instead).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PREFIX = "SCHEDULER_"

log = logging.getLogger("mkdocs.hooks.reference")  # under `mkdocs`: --strict counts it

REGION = re.compile(
    r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S
)
INCLUDE = re.compile(r"^<!-- include: (?P<path>[\w./-]+) -->$", re.M)
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]+)\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def one_line(text: str) -> str:
    return " ".join(text.split())


def cell(text: str) -> str:
    """Text as one cell of a Markdown table."""
    return one_line(text).replace("|", "\\|")


# -- the settings -------------------------------------------------------------------


def shown_default(field: Any) -> str:
    """A setting's default as the reference shows it."""
    extra = field.json_schema_extra or {}
    if "default_shown" in extra:
        return str(extra["default_shown"])
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return str(value)
    return f"`{value}`"


def setting_name(name: str, field: Any) -> str:
    """The name users write: a field's first alias where it has one (`schema`)."""
    alias = field.validation_alias
    choices = getattr(alias, "choices", None)
    if choices:
        return str(choices[0])
    return str(alias or name)


def settings_flags() -> dict[str, str]:
    """Setting -> the command-line flag that sets it (an option whose dest is its name)."""
    flags: dict[str, str] = {}
    for command in subcommands(parser()).values():
        for action in command._actions:
            if action.option_strings and action.dest:
                flags.setdefault(action.dest, action.option_strings[-1])
    return flags


def settings_table() -> str:
    from scheduler.config.settings import Settings

    flags = settings_flags()
    lines = [
        "| setting | environment | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for name, field in Settings.model_fields.items():
        shown = setting_name(name, field)
        where = f"{PREFIX}{shown.upper()}"
        if name in flags:
            where += f", `{flags[name]}`"
        if not field.description:
            raise ValueError(f"scheduler/config/settings.py: Settings.{name} has no description")
        lines.append(
            f"| {shown} | {where} | {cell(shown_default(field))} | {cell(field.description)} |"
        )
    return "\n".join(lines) + "\n"


# -- the command line ---------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    from scheduler.cli import commands as cli

    return cli._parser()


def subcommands(top: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def summaries(top: argparse.ArgumentParser) -> dict[str, str]:
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def spelled(action: argparse.Action) -> str:
    """An argument as a synopsis writes it: `JOB`, `--limit N`, `--json`."""
    metavar = action.metavar or action.dest.upper()
    if not action.option_strings:
        return str(metavar)
    option = action.option_strings[-1]
    return option if action.nargs == 0 else f"{option} {metavar}"


def own_arguments(command: argparse.ArgumentParser, common: set[str]) -> Iterator[argparse.Action]:
    for action in command._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings and action.option_strings[-1] in common:
            continue
        yield action


def synopsis(name: str, arguments: list[argparse.Action]) -> str:
    words = [f"scheduler {name}"]
    for action in arguments:
        word = spelled(action)
        optional = bool(action.option_strings) or action.nargs == "?"
        words.append(f"[{word}]" if optional else word)
    return " ".join(words)


def argument_table(arguments: list[argparse.Action]) -> list[str]:
    lines = ["| argument | meaning |", "| --- | --- |"]
    for action in arguments:
        lines.append(f"| `{spelled(action)}` | {cell(action.help or '')} |")
    return lines


def common_options(commands: dict[str, argparse.ArgumentParser]) -> list[argparse.Action]:
    """The options every command takes (besides --help)."""
    seen: list[set[str]] = [
        {a.option_strings[-1] for a in c._actions if a.option_strings} for c in commands.values()
    ]
    shared = set.intersection(*seen) - {"--help"}
    first = next(iter(commands.values()))
    return [a for a in first._actions if a.option_strings and a.option_strings[-1] in shared]


def cli_reference() -> str:
    top = parser()
    commands = subcommands(top)
    helps = summaries(top)
    common = common_options(commands)
    shared = {a.option_strings[-1] for a in common}
    out = [
        f"{top.description}",
        "",
        "| command | does |",
        "| --- | --- |",
        *(f"| [`scheduler {n}`](#scheduler-{n}) | {cell(helps[n])} |" for n in commands),
        "| `scheduler --version` | the version |",
        "",
        "Every command also takes:",
        "",
        *argument_table(common),
        "",
        one_line(top.epilog or ""),
    ]
    for name, command in commands.items():
        arguments = list(own_arguments(command, shared))
        out += ["", f"### `scheduler {name}`", "", "```", synopsis(name, arguments), "```"]
        out += ["", one_line(command.description or "")]
        if arguments:
            out += ["", *argument_table(arguments)]
        epilog = (command.epilog or "").removeprefix("exit status: ")
        out += ["", f"Exit status: {one_line(epilog)}"]
    return "\n".join(out) + "\n"


# -- the generated regions ----------------------------------------------------------

GENERATORS: dict[str, Callable[[], str]] = {"settings": settings_table, "cli": cli_reference}


def refresh(text: str) -> str:
    """The page with each generated region made anew."""

    def made(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in GENERATORS:
            raise ValueError(f"unknown generated region {name!r}")
        return f"{match.group(1)}\n{GENERATORS[name]()}\n{match.group(4)}"

    return REGION.sub(made, text)


def pages() -> list[Path]:
    """The pages that hold a generated region."""
    return sorted(p for p in DOCS.glob("*.md") if REGION.search(p.read_text()))


def stale() -> list[Path]:
    return [page for page in pages() if refresh(page.read_text()) != page.read_text()]


def main() -> int:
    for page in pages():
        text = page.read_text()
        fresh = refresh(text)
        if fresh != text:
            page.write_text(fresh)
            print(f"{page.relative_to(ROOT)}: rewritten")
    return 0


# -- MkDocs hooks -------------------------------------------------------------------


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    fresh = refresh(markdown)
    if fresh != markdown:
        log.warning(
            "docs/%s: a generated reference is out of date; run `python docs/hooks.py`",
            page.file.src_uri,
        )
    fresh = INCLUDE.sub(lambda m: included(m.group("path")), fresh)
    return outside_links(fresh, page.file.src_uri, config.get("repo_url"))


def included(path: str) -> str:
    """A repository file's Markdown, its headings one level down."""
    source = (ROOT / path).resolve()
    if ROOT not in source.parents:
        raise ValueError(f"include: {path} is outside the repository")
    text = source.read_text()
    return re.sub(r"^(#{1,5}) ", r"#\1 ", text, flags=re.M)


def outside_links(markdown: str, src_uri: str, repo_url: str | None) -> str:
    """Links to repository files outside docs/: to the repository, or their text."""
    folder = (DOCS / src_uri).parent

    def link(match: re.Match[str]) -> str:
        target = match.group("target")
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)
        path = (folder / target.split("#", 1)[0]).resolve()
        if DOCS in path.parents or path == DOCS:
            return match.group(0)
        if not path.exists():
            log.warning("docs/%s: a link to %s, which does not exist", src_uri, target)
        if repo_url:
            relative = path.relative_to(ROOT).as_posix()
            return f"[{match.group('text')}]({repo_url.rstrip('/')}/blob/main/{relative})"
        return match.group("text")

    parts = []
    last = 0
    for fence in FENCE.finditer(markdown):  # code blocks are left as they are
        parts.append(LINK.sub(link, markdown[last : fence.start()]))
        parts.append(fence.group(0))
        last = fence.end()
    parts.append(LINK.sub(link, markdown[last:]))
    return "".join(parts)


if __name__ == "__main__":
    sys.exit(main())

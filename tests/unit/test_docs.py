"""The documentation: the site builds strictly, every link resolves, the references are
generated from the code and committed as generated, and README stays short."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from types import ModuleType
from urllib.parse import urlsplit

import pytest
from markdown.extensions.toc import slugify

from tests.support import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*#*\s*$", re.M)


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documents() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


# -- links --------------------------------------------------------------------------


def prose(text: str) -> str:
    """The text outside code: fenced blocks and code spans hold no links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def heading_text(raw: str) -> str:
    """A heading as rendered text: code spans and links by their text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return text.replace("`", "")


def github_slug(text: str) -> str:
    text = text.strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings, as both GitHub and MkDocs make them.

    An anchor counts only where the two agree, so a link works on GitHub and on
    the site alike; a heading given twice on a page would be numbered differently
    by each, so it is refused.
    """
    found: set[str] = set()
    for match in HEADING.finditer(FENCE.sub("", path.read_text())):
        text = heading_text(match.group("text"))
        ours, theirs = slugify(text, "-"), github_slug(text)
        assert ours not in found, f"{path.name}: the heading {text!r} is given twice"
        if ours == theirs:
            found.add(ours)
    return found


def broken_links(path: Path) -> list[str]:
    """Every link of a Markdown file that does not resolve, with why."""
    broken = []
    for match in LINK.finditer(prose(path.read_text())):
        target = match.group("target")
        parts = urlsplit(target)
        if parts.scheme:
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
            if not ok:
                broken.append(f"{target}: not an http(s) URL with a host")
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix != ".md":
            broken.append(f"{target}: an anchor into a file that is not Markdown")
        elif anchor and anchor not in anchors(destination):
            broken.append(f"{target}: no heading with that anchor in {destination.name}")
    return broken


def test_every_link_in_readme_and_docs_resolves():
    broken = {str(p.relative_to(ROOT)): found for p in documents() if (found := broken_links(p))}
    assert broken == {}


def test_the_link_check_finds_broken_links(tmp_path):
    (tmp_path / "other.md").write_text("# A title\n\n## Fencing with `run_id`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#fencing-with-run_id) [ok](#here) [ok](https://example.org/x)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [no host](https:///x)\n"
        "`[in code](missing.md)`\n\n## Here\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#nope: no heading with that anchor in other.md",
        "https:///x: not an http(s) URL with a host",
    ]


def test_anchors_count_only_where_github_and_mkdocs_agree(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("## `scheduler check`\n\n## Status as JSON\n\n## A -- B\n")
    assert anchors(page) == {"scheduler-check", "status-as-json"}


# -- the site -----------------------------------------------------------------------


def test_mkdocs_builds_the_site_strictly(tmp_path):
    """Every page in the navigation, every link and anchor found, no warning."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The hooks ran: the generated reference, the included results, no stray sources.
    cli = (tmp_path / "cli" / "index.html").read_text()
    assert "scheduler history [JOB]" in cli
    assert "Round trips per tick" in (tmp_path / "benchmarks" / "index.html").read_text()
    assert not list(tmp_path.rglob("*.py")) and (tmp_path / "page.png").exists()


def test_a_stale_reference_fails_the_strict_build(tmp_path):
    """The site's hook warns (so --strict fails) when a committed reference is stale."""
    site = tmp_path / "project"
    (site / "docs").mkdir(parents=True)
    (site / "docs" / "index.md").write_text(
        "# Settings\n\n<!-- generated: settings -->\nold\n<!-- end generated -->\n"
    )
    (site / "mkdocs.yml").write_text(
        f"site_name: t\nhooks:\n  - {DOCS / 'hooks.py'}\nexclude_docs: '*.py'\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")],
        cwd=site,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "a generated reference is out of date" in done.stdout + done.stderr


# -- the references generated from the code -----------------------------------------


def test_committed_references_are_what_the_code_generates():
    stale = [str(p.relative_to(ROOT)) for p in hooks().stale()]
    assert stale == [], "run `python docs/hooks.py` and commit the pages"


def test_settings_reference_has_every_setting_with_its_environment_and_default():
    from scheduler.config.settings import Settings, setting_names

    table = hooks().settings_table()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert list(rows) == setting_names()
    assert "SCHEDULER_SCHEMA" in rows["schema"]
    assert "`--jobs`" in rows["jobs_path"] and "`--http-port`" in rows["http_port"]
    assert "| 30 |" in rows["holder_timeout"] and "| unset |" in rows["database_url"]
    assert all(field.description for field in Settings.model_fields.values())


def test_a_setting_without_a_description_is_refused(monkeypatch):
    from scheduler.config.settings import Settings

    field = Settings.model_fields["timezone"]
    monkeypatch.setattr(field, "description", None)
    with pytest.raises(ValueError, match=r"Settings\.timezone has no description"):
        hooks().settings_table()


def test_cli_reference_has_every_command_option_and_exit_status():
    module = hooks()
    reference = module.cli_reference()
    top = module.parser()
    commands = module.subcommands(top)
    assert set(commands) == {"run", "check", "jobs", "status", "history", "trigger", "pause",
                             "resume"}  # fmt: skip
    for name, command in commands.items():
        assert f"### `scheduler {name}`" in reference
        for action in command._actions:
            if not isinstance(action, argparse._HelpAction):
                assert f"`{module.spelled(action)}` | {module.cell(action.help or '')}" in (
                    reference
                ), (name, action.dest)
        assert command.epilog and command.epilog.startswith("exit status: ")
    assert "Exit status: 0 ran and succeeded; 1 ran and failed" in reference
    assert "scheduler history [JOB] [--limit N]" in reference


def test_job_fields_table_names_every_field_of_a_job():
    from scheduler.config.settings import JobConfig

    text = (DOCS / "configuration.md").read_text()
    table = text.split("| job field | meaning |", 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert listed and set(listed) == set(JobConfig.model_fields)


# -- README -------------------------------------------------------------------------


def test_readme_is_short_and_gives_the_two_commands_first():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    blocks = re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S)
    run, tests = blocks[0].strip(), blocks[1].strip()
    assert run.endswith("scheduler run") and "pip install" in run
    assert tests.endswith("pytest") and "'.[test]'" in tests
    # .ci/run runs the block after the marker.
    assert text.split("<!-- test-command -->\n", 1)[1].startswith(f"```sh\n{tests}\n```")

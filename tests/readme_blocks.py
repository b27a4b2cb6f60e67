"""The README's commands as a reader pastes them: the lines of its indented code blocks (at any list depth) that run
a program, backslash continuations joined. Shared by the documentation tests (tests/unit/test_readme_commands.py
checks every one, tests/integration/test_readme_walk.py runs the first run's block, tests/integration/
test_airflow_local.py the backfill and data-quality blocks). Dates in the examples are computed when pasted, with
GNU date (`$(date -u -d '3 hours ago' +%Y-%m-%dT%H)`): ``expand_dates`` computes them for a given "now", as bash
would then. It reads the Markdown only and imports nothing of the project."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

# The programs a command line of the README may start with (after VAR=value assignments); any other first word is
# output, code or a listing.
PROGRAMS = frozenset({"photon", "airflow", "make", "spark-submit", "patronictl", "source", "curl"})


@dataclass(frozen=True)
class Command:
    line: int  # the README's line where the command starts (1-based)
    section: str  # the heading above it
    text: str  # as pasted: continuations joined, the trailing comment removed
    inline: bool = False  # a code span in prose: names a command, perhaps with some options, to be read not pasted

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def program(self) -> str:
        """The first word that is not an assignment, without its folder (``.venv/bin/photon``: ``photon``)."""
        return next(w for w in self.words if not _ASSIGNMENT.match(w)).rsplit("/", 1)[-1]

    def at(self, now: datetime) -> Command:
        """The command as pasted at ``now``: its computed dates written out (``expand_dates``)."""
        return replace(self, text=expand_dates(self.text, now))

    @property
    def is_synopsis(self) -> bool:
        """A command's shape, not an example: optional parts in brackets, or ``...`` for the rest."""
        return "[" in self.text or "..." in self.text or "<" in self.text


_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# The one form of date the README's examples compute: GNU date, UTC, whole hours back, a format of fields strftime
# shares with date (%Y %m %d %H %M %S) and literal characters.
DATE = re.compile(r"\$\(date -u -d '(\d+) hours? ago' \+((?:%[YmdHMS]|[-0-9T:Z])+)\)")


def expand_dates(text: str, now: datetime) -> str:
    """``text`` with each ``$(date -u -d 'N hours ago' +FORMAT)`` replaced by what GNU date prints at ``now`` (an
    aware datetime). Raises ValueError on any other command substitution: a date this cannot compute would reach a
    test as the literal ``$(...)``."""
    utc = now.astimezone(UTC)
    out = DATE.sub(lambda m: (utc - timedelta(hours=int(m.group(1)))).strftime(m.group(2)), text)
    if "$(" in out or "`" in out:
        raise ValueError(f"a command substitution other than {DATE.pattern}: {text}")
    return out


_HEADING = re.compile(r"^#{1,6} ")


def _content_indent(line: str) -> int:
    """Where a paragraph's text starts: after a list marker, its content's column."""
    stripped = line.lstrip(" ")
    indent = len(line) - len(stripped)
    marker = re.match(r"^([-*+]|\d+[.)]) +", stripped)
    return indent + (len(marker.group(0)) if marker else 0)


def code_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line, section, lines) of every indented code block: a run of lines indented four or more columns past
    the text they follow (a list item's content, or the margin), after a blank line."""
    blocks: list[tuple[int, str, list[str]]] = []
    section, context, fenced = "", 0, False
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
            i += 1
            continue
        if fenced or not line.strip():
            i += 1
            continue
        if _HEADING.match(line):
            section, context = line.lstrip("# ").strip(), 0
            i += 1
            continue
        indent = len(line) - len(line.lstrip(" "))
        after_blank = i == 0 or not lines[i - 1].strip()
        if after_blank and indent >= context + 4 and not line.lstrip().startswith("|"):
            start, body = i, []
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip(" ")) >= indent):
                body.append(lines[i][indent:])
                i += 1
            while body and not body[-1].strip():
                body.pop()
            blocks.append((start + 1, section, body))
            continue
        context = _content_indent(line)
        i += 1
    return blocks


def _strip_comment(line: str) -> str:
    """The line without a trailing ``# comment`` (a ``#`` after whitespace, outside quotes)."""
    quote, escaped = "", False
    for k, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True  # `\"` in a double-quoted string (a JSON --conf) does not end it
        elif quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip()
    return line.rstrip()


def commands(text: str | None = None) -> list[Command]:
    """Every command line of the README's code blocks."""
    text = README.read_text() if text is None else text
    found: list[Command] = []
    for first, section, body in code_blocks(text):
        k = 0
        while k < len(body):
            start, parts = k, [body[k]]
            while parts[-1].rstrip().endswith("\\") and k + 1 < len(body):
                parts[-1] = parts[-1].rstrip()[:-1]
                k += 1
                parts.append(body[k])
            k += 1
            joined = " ".join(p.strip() for p in parts)
            code = _strip_comment(joined)
            if not code:
                continue
            try:
                words = shlex.split(code)
            except ValueError:
                continue  # not shell (prose, Python): unbalanced quotes
            program = next((w for w in words if not _ASSIGNMENT.match(w)), "")
            if program.rsplit("/", 1)[-1] in PROGRAMS:
                found.append(Command(first + start, section, code))
    return found


def block_after(marker: str, text: str | None = None) -> list[Command]:
    """The commands of the first code block after the first line of the README holding ``marker``."""
    text = README.read_text() if text is None else text
    at = next(n for n, line in enumerate(text.splitlines(), 1) if marker in line)
    first = min((b for b in code_blocks(text) if b[0] > at), key=lambda b: b[0])
    end = first[0] + len(first[2])
    return [c for c in commands(text) if first[0] <= c.line < end]

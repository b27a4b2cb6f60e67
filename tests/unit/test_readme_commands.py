"""Every command the README shows works as written (issue 22): the code blocks' examples paste into a fresh shell in
the clone after `make setup` (no venv on PATH, no AIRFLOW_HOME), and every `photon`, `airflow` and `make` command of
the README, in a block or inline, names a command and options that exist, parsed by the real command-line parsers
(typer's for `photon`, Airflow's own for `airflow` and `photon airflow-cli`) without running anything, with their dates
as pasted now. The examples' dates are computed when pasted, never fixed (a fixed one ages past the registry's
horizon), and the first run's history, the backfill's hours and the hour checked line up. The integration tests
test_readme_walk.py and test_airflow_local.py run the first run's block and the backfill and data-quality ones."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import typer.main

from tests.readme_blocks import DATE, PROGRAMS, README, Command, block_after, code_blocks, commands, expand_dates

ROOT = Path(__file__).resolve().parents[2]
NEEDS_VENV = PROGRAMS - {"make", "source", "curl"}


def _inline_commands() -> list[Command]:
    """Inline code spans of the README's prose that are a whole command with arguments (`photon verify` alone is a
    name; `photon final --mark` is a command)."""
    text = README.read_text()
    in_block = {n for first, _, body in code_blocks(text) for n in range(first, first + len(body))}
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        if n in in_block:
            continue
        for span in re.findall(r"`([^`]+)`", line):
            try:
                words = shlex.split(span)
            except ValueError:
                continue
            program = next((w for w in words if not re.match(r"^[A-Za-z_]\w*=", w)), "")
            if program.rsplit("/", 1)[-1] in PROGRAMS and len(words) > 2:
                found.append(Command(n, "", span, inline=True))
    return found


NOW = datetime.now(UTC)
BLOCKS = [c.at(NOW) for c in commands()]
EVERYWHERE = BLOCKS + [c.at(NOW) for c in _inline_commands()]


def _id(c: Command) -> str:
    return f"README:{c.line}"


def test_the_readme_has_the_commands_this_test_checks() -> None:
    """The extraction finds the blocks a newcomer pastes: if it found none, every test below would pass vacuously."""
    programs = {c.program for c in BLOCKS}
    assert {"photon", "make"} <= programs, programs
    assert any("backfill create" in c.text for c in BLOCKS)
    assert any("photon_data_quality" in c.text for c in BLOCKS)
    assert len(EVERYWHERE) > len(BLOCKS) > 20


@pytest.mark.parametrize("command", [c for c in BLOCKS if not c.is_synopsis], ids=_id)
def test_an_example_pastes_into_a_fresh_shell(command: Command) -> None:
    """A plain shell in the clone has `.venv/bin/` (make setup's link), not the venv on PATH: an example names the
    program there. (A synopsis, with [options] or ..., shows a command's shape and says `photon`.)"""
    first = next(w for w in command.words if not re.match(r"^[A-Za-z_]\w*=", w))
    if command.program in NEEDS_VENV:
        assert first.startswith(".venv/bin/"), f"README:{command.line}: `{command.text}` needs {first} on PATH"
    assert not command.text.startswith("AIRFLOW_HOME="), "photon airflow-cli finds Airflow's home itself"


# typer carries its own copy of click (typer._click): its commands are duck-typed here, not checked against click's.
def _photon_root() -> Any:
    from photon.cli import app

    return typer.main.get_command(app)


def _airflow_parse(args: list[str], where: str) -> None:
    from airflow.cli.cli_parser import get_parser

    try:
        get_parser().parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"{where}: `airflow {shlex.join(args)}` does not parse (exit {exc.code})")


def _resolve(words: list[str], where: str, *, inline: bool) -> tuple[Any, list[str], list[str]]:
    cmd = _photon_root()
    path, rest = ["photon"], list(words)
    while hasattr(cmd, "commands") and not (inline and not rest):  # a group (a span may name one)
        assert rest and rest[0] in cmd.commands, f"{where}: `{' '.join(path)}` has no command {rest[:1]}"
        path.append(rest[0])
        cmd = cmd.commands[rest.pop(0)]
    return cmd, path, rest


def _options(cmd: Any) -> set[str]:
    return {o for p in cmd.params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)}


def _after_program(command: Command) -> list[str]:
    words = command.words
    at = next(i for i, w in enumerate(words) if not re.match(r"^[A-Za-z_]\w*=", w))
    return words[at + 1 :]


@pytest.mark.parametrize("command", [c for c in EVERYWHERE if c.program == "photon"], ids=_id)
def test_a_photon_command_names_a_command_and_options_that_exist(command: Command) -> None:
    where = f"README:{command.line}"
    words = _after_program(command)
    if command.inline and any(w.startswith("<") for w in words[:1]):
        return  # `photon <command> --help`
    cmd, path, rest = _resolve(words, where, inline=command.inline)
    if cmd.name == "airflow-cli":
        if not (command.is_synopsis or command.inline):
            _airflow_parse(rest, where)
        return
    named = {w.split("=", 1)[0] for w in re.findall(r"(?<![\w-])--?[a-z][\w-]*(?:=\S*)?", command.text)}
    unknown = {o for o in named if o.startswith("-")} - _options(cmd) - {"--help"}
    assert not unknown, f"{where}: `{' '.join(path)}` has no option {sorted(unknown)}"
    if not (
        command.is_synopsis or command.inline
    ):  # an example: parsed in full (values, required options), nothing run
        try:
            cmd.make_context(" ".join(path), rest)
        except Exception as exc:  # typer's click: UsageError, BadParameter, ...
            pytest.fail(f"{where}: `{command.text}`: {getattr(exc, 'format_message', exc.__str__)()}")


@pytest.mark.parametrize("command", [c for c in EVERYWHERE if c.program == "airflow"], ids=_id)
def test_an_airflow_command_parses(command: Command) -> None:
    args = _after_program(command)
    if command.inline:  # `airflow backfill create` names the command: its own required options left out
        from airflow.cli.cli_parser import get_parser

        parser = get_parser()
        for word in (w for w in args if not w.startswith("-")):
            groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if not groups or word.isupper():
                break  # a command's own arguments from here, or a placeholder (`airflow ARGS`)
            assert word in groups[0].choices, (
                f"README:{command.line}: airflow has no command {word!r}: `{command.text}`"
            )
            parser = groups[0].choices[word]
        return
    if command.is_synopsis:
        args = [w for w in args if w not in ("...",) and not w.startswith("<")]
    _airflow_parse(args, f"README:{command.line}")


@pytest.mark.parametrize("command", [c for c in EVERYWHERE if c.program == "make"], ids=_id)
def test_a_make_target_exists(command: Command) -> None:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    words = command.words
    named = [w for w in words[words.index(next(w for w in words if w == "make")) + 1 :] if "=" not in w]
    assert named, f"README:{command.line}: `{command.text}`"
    assert set(named) <= targets, f"README:{command.line}: no make target {sorted(set(named) - targets)}"


def test_the_readme_dates_are_what_gnu_date_prints() -> None:
    """expand_dates, which the tests use for "pasted at this time", computes each of the README's `$(date ...)` as
    GNU date does, at a minute before, at and after an hour's turn."""
    found = set(DATE.findall(README.read_text()))
    assert len(found) >= 4, found  # the first run's start, the backfill's two dates, the hour checked
    for now in ("2026-03-01T00:00:00Z", "2026-03-01T00:59:59Z", "2026-02-28T23:30:00Z"):
        for hours, fmt in found:
            text = f"$(date -u -d '{hours} hours ago' +{fmt})"
            gnu = subprocess.run(
                ["date", "-u", "-d", f"{now} {hours} hours ago", f"+{fmt}"], capture_output=True, text=True, check=True
            )
            assert expand_dates(text, datetime.fromisoformat(now)) == gnu.stdout.strip(), (now, text)


@pytest.mark.parametrize("command", [c for c in commands() if not c.is_synopsis], ids=_id)
def test_an_example_names_no_fixed_date(command: Command) -> None:
    """A date in an example is computed when pasted: a fixed one ages past the registry's 3-day horizon (a backfill
    of 2026-11-20 joined nothing eight days later). Any command substitution is one expand_dates computes."""
    assert not re.search(r"\d{4}-\d\d-\d\d", command.text), f"README:{command.line}: `{command.text}`"
    command.at(NOW)


def _option(command: Command, name: str) -> str:
    words = command.words
    return words[words.index(name) + 1]


def _hour(text: str) -> datetime:
    return datetime.fromisoformat(text[:13] + ":00:00").replace(tzinfo=UTC)


@pytest.mark.parametrize("minute", [0, 1, 30, 59])
def test_the_first_runs_history_the_backfill_and_the_quality_check_line_up(minute: int) -> None:
    """Pasted in order within one hour: the first run's history (under "The joiner"), the backfill's hours and the
    hour the data-quality example checks. Every backfilled hour holds some of the history (a run of an hour whose
    replica has no click file fails), the hour checked is one of them and whole history, and each has ended and
    settled (seal 60 s, maximum join delay 120 s, margin 120 s) when pasted. The "Logs" section's history is the
    first run's."""
    now = datetime(2026, 3, 1, 12, minute, 59, tzinfo=UTC)
    first = [c.at(now) for c in block_after("A first run")]
    generate = next(c for c in first if c.words[1] == "generate")
    logs = next(c for c in commands() if c.section.startswith("Logs") and "historical" in c.text)
    assert logs.text == block_after("A first run")[0].text, "the Logs section shows the first run's history"
    start = datetime.fromisoformat(_option(generate, "--start"))
    end = start + timedelta(seconds=float(_option(generate, "--duration")))
    backfill = next(c for c in block_after("**Backfill history**")).at(now)
    hours = []
    hour = _hour(_option(backfill, "--from-date"))
    while hour <= _hour(_option(backfill, "--to-date")):
        hours.append(hour)
        hour += timedelta(hours=1)
    assert len(hours) >= 2, hours
    for h in hours:
        assert h < end and h + timedelta(hours=1) > start, f"the backfilled hour {h} holds none of [{start}, {end})"
        assert h + timedelta(hours=1, seconds=300) <= now, f"the backfilled hour {h} has not settled at {now}"
    trigger = next(c for c in block_after("To check one hour now") if "trigger" in c.words).at(now)
    checked = _hour(json.loads(_option(trigger, "--conf"))["hour"])
    assert checked in hours and start <= checked and checked + timedelta(hours=1) <= end, (checked, start, end)
    rerun = next(c for c in block_after("**Re-run an hour**")).at(now)
    assert _hour(_option(rerun, "--from-date")) in hours

"""Every command the README shows works as written (issue 22): the code blocks' examples paste into a fresh shell in
the clone after `make setup` (no venv on PATH, no AIRFLOW_HOME), and every `photon`, `airflow` and `make` command of
the README, in a block or inline, names a command and options that exist, parsed by the real command-line parsers
(typer's for `photon`, Airflow's own for `airflow` and `photon airflow-cli`) without running anything. The
integration test test_airflow_local.py runs the backfill and data-quality blocks themselves."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer.main

from tests.readme_blocks import PROGRAMS, README, Command, code_blocks, commands

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


BLOCKS = commands()
EVERYWHERE = BLOCKS + _inline_commands()


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

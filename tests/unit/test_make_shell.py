"""`make shell` is immune to the user's rc files: it ran `bash -i`, which re-read ~/.bashrc after the Makefile had put
the venv first, so a ~/.bashrc that puts another Python first won, and spark-submit (which asks `python3` where
pyspark is unless SPARK_HOME is set) stopped with "Could not find valid SPARK_HOME"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)  # the venv the tests run in: the one `make shell` activates


def test_the_venv_wins_over_a_bashrc_that_puts_another_python_first(tmp_path: Path) -> None:
    home, fake = tmp_path / "home", tmp_path / "home" / "other-python" / "bin"
    fake.mkdir(parents=True)
    for name in ("python3", "python", "spark-submit"):
        (fake / name).write_text(f"#!/bin/sh\necho 'the other {name}' >&2\nexit 1\n")
        (fake / name).chmod(0o755)
    (home / ".bashrc").write_text(
        f'export PATH="{fake}:$PATH"\nunset SPARK_HOME\nalias hello="echo the users alias"\n'
        # a prompt hook that moves PATH at every prompt, as pyenv's and conda's do
        f"PROMPT_COMMAND='PATH=\"{fake}:$PATH\"'\n"
    )
    commands = "\n".join(
        [
            "echo python3=$(command -v python3)",
            "echo spark-submit=$(command -v spark-submit)",
            'echo SPARK_HOME="$SPARK_HOME"',
            "hello",
            "spark-submit --version 2>&1 | grep -q 'version [0-9]' && echo spark-submit-ran",
            "exit",
        ]
    )
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_HOME", "VIRTUAL_ENV", "MAKEFLAGS")}
    # -o setup: the venv exists; setup would reinstall the shared editable package from this clone.
    result = subprocess.run(
        ["make", "-s", "-o", "setup", "shell", f"VENV={VENV}"],
        cwd=ROOT,
        env={**env, "HOME": str(home)},
        input=commands + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        # No controlling terminal: an interactive bash that finds one it does not lead stops its whole process group
        # (SIGTTIN) until it is in the foreground, and that group is this test's: run from a CI whose pytest sits in
        # a background group of a terminal, the worker stopped for good and the suite hung until CI killed it.
        start_new_session=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout.splitlines()
    assert f"python3={VENV}/bin/python3" in out, result.stdout + result.stderr
    assert f"spark-submit={VENV}/bin/spark-submit" in out
    spark_home = next(line.removeprefix("SPARK_HOME=") for line in out if line.startswith("SPARK_HOME="))
    assert Path(spark_home, "jars").is_dir() and Path(spark_home).is_relative_to(VENV), spark_home
    assert "the users alias" in out  # the user's ~/.bashrc was still read
    assert "spark-submit-ran" in out, result.stdout + result.stderr  # it printed its version
    assert "Could not find valid SPARK_HOME" not in result.stdout + result.stderr

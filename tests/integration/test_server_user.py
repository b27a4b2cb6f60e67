"""The user PostgreSQL and Patroni run as when we are root (they refuse root): created once, whoever asks first.

A fresh machine's test run found it: three xdist workers each imported a module that asked for the user, each ran
``useradd``, and one's entry overwrote another's, so that one worker kept a uid nobody had and every server it
prepared a folder for failed with "Permission denied".
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import subprocess
import sys
from pathlib import Path

from photon.pg import server_user

ROOT = Path(__file__).resolve().parents[2]
# A process of its own each (never a fork of the test's: a fork of a process with threads, a JVM's client or the
# Delta runtime's, may inherit a lock held and wait on it for ever; one did, in a full run).
ASK = (
    "import json, sys; from photon.pg import server_user; "
    "u = server_user(sys.argv[1]); print(json.dumps(u and [u.pw_uid, u.pw_gid]))"
)


def _ask(name: str) -> tuple[int, int] | None:
    user = server_user(name)
    return None if user is None else (user.pw_uid, user.pw_gid)


def test_processes_asking_at_once_for_the_server_user_all_get_the_one_created() -> None:
    name = f"photon-t{secrets.token_hex(4)}"  # a fresh user each run, removed after
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    try:
        procs = [
            subprocess.Popen([sys.executable, "-c", ASK, name], env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(8)
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * 8, outs
        answers = [None if a is None else tuple(a) for a in (json.loads(o) for o in outs)]
        if os.geteuid() != 0:  # not root: servers run as ourselves, and nobody is created
            assert answers == [None] * 8
            return
        entry = pwd.getpwnam(name)
        assert answers == [(entry.pw_uid, entry.pw_gid)] * 8
        assert _ask(name) == (entry.pw_uid, entry.pw_gid)  # and asked again, the same
    finally:
        if os.geteuid() == 0:
            subprocess.run(["userdel", name], capture_output=True)
            subprocess.run(["groupdel", name], capture_output=True)

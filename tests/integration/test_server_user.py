"""The user PostgreSQL and Patroni run as when we are root (they refuse root): created once, whoever asks first.

A fresh machine's test run found it: three xdist workers each imported a module that asked for the user, each ran
``useradd``, and one's entry overwrote another's, so that one worker kept a uid nobody had and every server it
prepared a folder for failed with "Permission denied".
"""

from __future__ import annotations

import multiprocessing
import os
import pwd
import secrets
import subprocess

from photon.pg import server_user


def _ask(name: str) -> tuple[int, int] | None:
    user = server_user(name)
    return None if user is None else (user.pw_uid, user.pw_gid)


def test_processes_asking_at_once_for_the_server_user_all_get_the_one_created() -> None:
    name = f"photon-t{secrets.token_hex(4)}"  # a fresh user each run, removed after
    try:
        with multiprocessing.get_context("fork").Pool(8) as pool:
            answers = pool.map(_ask, [name] * 8)
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

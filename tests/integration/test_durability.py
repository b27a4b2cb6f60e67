"""A committed batch survives a power cut: every file a batch commits is fsynced, with its folder, before the batch's
PostgreSQL commit, and its publish renames are fsynced before it is marked published.

The order is read from the system calls of the real `photon join` process tree (driver, JVM, Spark's Python
workers), recorded by strace: nothing in the code under test reports on itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.test_joiner import ROOT, make_logs

pytestmark = pytest.mark.integration

CALL = re.compile(r"^(\d+) +(\d+\.\d+) (\w+)\((.*)\) = (-?\d+)(?: \w+ \(.*\))? <(\d+\.\d+)>$")
UNFINISHED = re.compile(r"^(\d+) +(\d+\.\d+) (\w+)\((.*) <unfinished \.\.\.>$")
RESUMED = re.compile(r"^(\d+) +(\d+\.\d+) <\.\.\. (\w+) resumed>(.*)\) = (-?\d+)(?: \w+ \(.*\))? <(\d+\.\d+)>$")
PATH_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')
FD_PATH = re.compile(r"^\d+<(.*)>")


@dataclass
class Call:
    pid: int
    start: float
    end: float
    name: str
    args: str

    def paths(self) -> list[str]:
        return PATH_ARG.findall(self.args)

    def fd_path(self) -> str:
        m = FD_PATH.match(self.args)
        return m.group(1) if m else ""


def read_trace(path: Path) -> list[Call]:
    """Successful calls, each with its entry time and its end (entry plus the time spent in it, -T)."""
    calls, pending = [], {}
    for line in path.read_text(errors="replace").splitlines():
        if m := CALL.match(line):
            pid, ts, name, args, ret, took = m.groups()
        elif m := UNFINISHED.match(line):
            pending[(m.group(1), m.group(3))] = (m.group(2), m.group(4))
            continue
        elif m := RESUMED.match(line):
            pid, ts_end, name, rest, ret, took = m.groups()
            start, head = pending.pop((pid, name), (ts_end, ""))
            ts, args = start, head + rest
            calls.append(Call(int(pid), float(ts), float(ts_end), name, args)) if int(ret) >= 0 else None
            continue
        else:
            continue
        if int(ret) >= 0:
            calls.append(Call(int(pid), float(ts), float(ts) + float(took), name, args))
    return calls


def test_a_batch_is_durable_before_its_commit_and_its_publish_before_it_is_marked(
    tmp_path: Path, servers: dict[str, str]
) -> None:
    strace = shutil.which("strace")
    assert strace, "strace is needed to record the order of system calls (apt-get install strace)"
    logs = make_logs(tmp_path / "logs", seconds=6)
    out = tmp_path / "out"
    trace = tmp_path / "trace.txt"
    env = {**os.environ, "PHOTON_REGISTRY_DSN": servers["main"], "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    env["PHOTON_TEST_MAX_CLICK_FILES"] = "3"  # several batches
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", str(logs), "--out", str(out)]
    cmd += ["--until-caught-up", "--drain", "--trigger-interval", "0.1", "--master", "local[2]"]
    syscalls = "fsync,fdatasync,rename,renameat,renameat2,mkdir,mkdirat,sendto"
    traced = [strace, "-f", "--seccomp-bpf", "-e", f"trace={syscalls}", "-y", "-s", "300", "-ttt", "-T"]
    proc = subprocess.run([*traced, "-o", str(trace), *cmd], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    calls = read_trace(trace)

    # The batch commits and publishes, as the driver sent them to PostgreSQL.
    commit_at: dict[str, float] = {}
    published_at: dict[str, float] = {}
    open_batch: dict[tuple[int, str], str] = {}
    for c in calls:
        if c.name != "sendto":
            continue
        fd = c.fd_path() or c.args.split("<", 1)[0]
        key = (c.pid, fd)
        if m := re.search(
            r"INSERT INTO photon\.batches \(pipeline, batch_seq, [a-z_, ]*\) VALUES \('dc-a', (\d+), (\d+)",
            c.args,
        ):
            open_batch[key] = f"b{int(m.group(1)):010d}-e{m.group(2)}"
        elif "COMMIT" in c.args and key in open_batch:
            commit_at[open_batch.pop(key)] = c.start
        elif m := re.search(
            r"UPDATE photon\.batches SET published = true WHERE pipeline = 'dc-a' AND batch_seq = (\d+)", c.args
        ):
            tag = next(t for t in commit_at if t.startswith(f"b{int(m.group(1)):010d}-"))
            published_at.setdefault(tag, c.start)
    assert len(commit_at) >= 3 and set(published_at) == set(commit_at), (commit_at, published_at)

    fsyncs: dict[str, list[float]] = defaultdict(list)  # path -> end times of its fsyncs
    for c in calls:
        if c.name in ("fsync", "fdatasync"):
            fsyncs[c.fd_path()].append(c.end)

    def synced(path: str, after: float, before: float) -> bool:
        return any(after <= t <= before for t in fsyncs[path])

    problems: list[str] = []
    checked = 0
    for c in calls:
        if c.name.startswith("rename"):
            src, dst = c.paths()[-2:]
            for tag, committed in commit_at.items():
                # A task's read marker (``_staging/<tag>/_read/``) is a message to the driver within one attempt of the
                # batch, never state: a lease start removes the staging folder, and a re-run writes its own.
                staged = (f"/_staging/{tag}/" in dst and "/_read/" not in dst) or f"/_state/retries/{tag}/" in dst
                if staged:  # written by a task of the batch: file synced before the rename, folder after it
                    checked += 1
                    if not synced(src, 0, c.start):
                        problems.append(f"{dst}: renamed into place before its data was fsynced")
                    if not synced(os.path.dirname(dst), c.end, committed):
                        problems.append(f"{dst}: its folder not fsynced between the rename and the commit of {tag}")
                elif f"/_staging/{tag}/" in src and "/_read/" not in src:
                    # published: the rename durable before the batch is marked
                    checked += 1
                    if not synced(os.path.dirname(dst), c.end, published_at[tag]):
                        problems.append(f"{dst}: published, folder not fsynced before {tag} was marked published")
        elif c.name.startswith("mkdir"):
            (path,) = c.paths()[-1:]
            for tag, committed in commit_at.items():
                if (f"/_staging/{tag}" in path and "/_read" not in path) or f"/_state/retries/{tag}" in path:
                    checked += 1
                    if not synced(os.path.dirname(path), c.end, committed):
                        problems.append(f"{path}: made, its parent not fsynced before the commit of {tag}")
    assert checked > 10, f"only {checked} staged files seen in the trace"
    assert not problems, "\n".join(problems[:20])

"""The nemesis: Photon's guarantees under a seeded random schedule of faults, in the spirit of Jepsen and Spark's
``StreamTest`` stress tests.

Live logs for two data centers (the generator, real time), one joiner process per data center restarted like
Airflow restarts a lease (leases of random length), the registry on a PostgreSQL of its own, and a schedule drawn
from the seed:

- ``kill``: SIGKILL a joiner's whole process group (driver, JVM, Python workers) at a random moment;
- ``pg_restart``: the registry's PostgreSQL stopped hard (``pg_ctl -m immediate``) and started again seconds later;
- ``verify``: ``photon verify`` beside the live joiners with a short grace period, sometimes SIGKILLed mid-pass;
- ``outage``: one replica stops receiving files for a while and catches up (the generator's outage);
- ``lose_dc``: one data center lost for good: its joiner killed and never restarted;
- ``clock``: a joiner's lease replaced by one on a skewed host clock (Debian's ``faketime``): within the maximum
  clock skew it runs (its decisions follow the registry server's clock); beyond it (the survivor, after the loss,
  as in issue 19) it must refuse at once, exit 2, and cost nothing.

Every component runs as a login holding only its role. While the run goes, a checker that reads files only
asserts that no click id is in two ``joined/`` files. At the end (input stopped): verify, drain the survivors,
verify, drain, verify; then the checker asserts that every click has exactly one outcome and every click that must
be joined is.

    python -m tests.nemesis.run --seed 7 --seconds 300     (make chaos SEED=7 SECONDS=300)

The last line printed is a JSON object: the seed, fault counts, the checker's verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2.extensions

from tests.nemesis import checker

ROOT = Path(__file__).resolve().parents[2]
DCS = ("dc-a", "dc-b")
MAX_JOIN_DELAY_S = 20.0
MARGIN_S = 5.0
SKEW_S = 10.0  # PHOTON_MAX_CLOCK_SKEW_S (the default) for every process of the run


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str  # kill | pg_restart | verify | lose_dc | clock
    target: str = ""
    # pg_restart: seconds down; verify: SIGKILL after this many seconds (0: let it finish); clock: the host clock's
    # offset in seconds
    arg: float = 0.0


@dataclass
class Plan:
    seed: int
    seconds: float
    rate: float
    grace_s: float
    lease_s: tuple[float, float]
    outage: tuple[str, float, float]
    lost: str
    faults: list[Fault]


def plan(seed: int, seconds: float, rate: float = 300.0) -> Plan:
    """The schedule a seed stands for: every fault kind at least once, at random moments."""
    rng = random.Random(seed)
    lost = rng.choice(DCS)
    loss_at = rng.uniform(0.55, 0.75) * seconds
    faults = [Fault(loss_at, "lose_dc", lost, float(rng.random() < 0.5))]  # arg 1: dies after commit
    for dc in DCS:
        t = rng.uniform(0.15, 0.35) * seconds  # each data center at least once, before any loss
        while t < seconds:
            faults.append(Fault(t, "kill", dc))
            t += rng.expovariate(3.0 / seconds)
    for _ in range(max(1, int(seconds // 120))):
        faults.append(Fault(rng.uniform(0.2, 0.85) * seconds, "pg_restart", "", rng.uniform(1.0, 6.0)))
    t = rng.uniform(5.0, 12.0)
    while t < seconds:
        faults.append(Fault(t, "verify", "", rng.uniform(0.2, 2.0) if rng.random() < 0.3 else 0.0))
        t += rng.uniform(8.0, 16.0)
    outage = (rng.choice(DCS), rng.uniform(0.1, 0.4) * seconds, rng.uniform(8.0, 20.0))
    # (Drawn after the rest, so a seed's other faults stay what they were.)
    # A lease on a host within the skew (it runs), and the survivor's next lease after the loss beyond it (refused).
    within = rng.choice((-1, 1)) * rng.uniform(2.0, SKEW_S - 2.0)
    faults.append(Fault(rng.uniform(0.1, 0.45) * seconds, "clock", rng.choice(DCS), within))
    survivor = DCS[1 - DCS.index(lost)]
    beyond = rng.choice((-1, 1)) * rng.uniform(SKEW_S + 20, 150)
    faults.append(Fault(loss_at + rng.uniform(0.05, 0.15) * seconds, "clock", survivor, beyond))
    return Plan(seed, seconds, rate, 10.0, (20.0, 45.0), outage, lost, sorted(faults, key=lambda f: f.at_s))


class Registry:
    """The registry's own PostgreSQL (the pgserver binaries), which this run may stop hard."""

    def __init__(self, folder: Path):
        from photon.pg import EmbeddedPostgres

        self.server = EmbeddedPostgres(folder, cleanup_mode="delete")
        self.admin = ""

    def start(self) -> str:
        self.server.start()
        self.admin = self.server.admin_dsn
        return self.admin

    def _pg_ctl(self, args: list[str]) -> None:
        from pgserver import _commands

        pg = self.server._server
        _commands.pg_ctl(args, pgdata=pg.pgdata, user=pg.system_user, timeout=60)

    def stop_hard(self) -> None:
        self._pg_ctl(["-m", "immediate", "stop"])

    def restart(self) -> None:
        pg = self.server._server
        socket_dir = psycopg2.extensions.parse_dsn(self.admin)["host"]
        self._pg_ctl(["-w", "-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(pg.log), "start"])

    def stop(self) -> None:
        self.server.stop()


@dataclass
class Outcome:
    seed: int
    seconds: float
    faults: Counter[str] = field(default_factory=Counter)
    joiner_exits: Counter[str] = field(default_factory=Counter)
    verify: Counter[str] = field(default_factory=Counter)
    duplicate_checks: int = 0
    duplicates_seen: list[str] = field(default_factory=list)
    verdict: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.duplicates_seen and bool(self.verdict.get("ok"))

    def to_dict(self) -> dict[str, Any]:
        d = {k: dict(v) if isinstance(v, Counter) else v for k, v in vars(self).items()}
        return {**d, "ok": self.ok}


class Nemesis:
    def __init__(self, p: Plan, work: Path, spark: Any = None, echo: Any = print):
        self.p, self.work, self.spark, self.echo = p, work, spark, echo
        self.logs, self.out = work / "logs", work / "out"
        self.proc_logs = work / "processes"
        self.proc_logs.mkdir(parents=True, exist_ok=True)
        self.registry = Registry(work / "pg")
        self.rng = random.Random(p.seed + 1)
        self.outcome = Outcome(p.seed, p.seconds)
        self.joiners: dict[str, subprocess.Popen[bytes] | None] = dict.fromkeys(DCS)
        # A kill lands a random moment after the lease's first batch (its Spark session up), so that kills hit
        # batches rather than start-ups: dc -> seconds after that batch.
        self.kill_pending: dict[str, float] = {}
        self.first_batch_at: dict[str, float | None] = dict.fromkeys(DCS)
        self.lease_log: dict[str, Path] = {}
        self.lost: set[str] = set()
        self.dying: dict[str, str] = {}  # a lost data center's last lease, until it dies at its crash point
        self.verifier: subprocess.Popen[bytes] | None = None
        self.verifier_kill_at: float | None = None
        self.pg_up_at: float | None = None
        self.started = 0
        self.skewed: dict[str, float] = {}  # dc -> the clock offset of its running lease, if skewed
        self.next_clock: dict[str, float] = {}  # dc -> the clock offset of its next lease

    # -- setup -----------------------------------------------------------------------------------------------
    def _setup_registry(self) -> None:
        from psycopg2 import sql

        from photon.pg import autocommit, create_database
        from photon.registry.admin import init_registry

        admin = self.registry.start()
        owner = create_database(admin, "photon")
        init_registry({"main": owner}, num_shards=4)
        self.dsn: dict[str, str] = {}
        with autocommit(admin) as conn, conn.cursor() as cur:
            for role in ("photon_joiner", "photon_verifier"):
                name, password = f"nemesis_{role}_{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
                cur.execute(
                    sql.SQL("CREATE ROLE {} LOGIN PASSWORD %s IN ROLE {}").format(
                        sql.Identifier(name), sql.Identifier(role)
                    ),
                    (password,),
                )
                self.dsn[role] = psycopg2.extensions.make_dsn(owner, user=name, password=password)

    def _env(self, role: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PHOTON_REGISTRY_SERVERS"}
        env |= {"PHOTON_REGISTRY_DSN": self.dsn[role], "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
        return env

    def _spawn(
        self,
        name: str,
        args: list[str],
        role: str | None,
        extra: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> subprocess.Popen[bytes]:
        self.started += 1
        self.last_log = self.proc_logs / f"{self.started:04d}-{name}.log"
        log = open(self.last_log, "wb")  # noqa: SIM115 (the child holds it)
        env = self._env(role) if role else {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
        env |= extra or {}
        return subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "photon", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    # -- processes -------------------------------------------------------------------------------------------
    def _generator(self) -> subprocess.Popen[bytes]:
        dc, start, length = self.p.outage
        args = ["generate", "--logs", str(self.logs), "--mode", "live", "--duration", str(self.p.seconds)]
        args += ["--rate", str(self.p.rate), "--seed", str(self.p.seed), "--outage", f"{dc}:{start:.1f}:{length:.1f}"]
        args += ["--max-join-delay", str(MAX_JOIN_DELAY_S), "--set", "late_query_lag_max_s=40"]
        args += ["--set", f"boundary_margin_s={MARGIN_S}"]
        return self._spawn("generator", args, None)

    def _lease(self, dc: str, crash_at: str | None = None, clock_s: float = 0.0) -> subprocess.Popen[bytes]:
        lease = self.rng.uniform(*self.p.lease_s)
        args = ["join", "--dc", dc, "--logs", str(self.logs), "--out", str(self.out), "--run-for", f"{lease:.0f}"]
        args += ["--trigger-interval", "0.5", "--max-join-delay", str(MAX_JOIN_DELAY_S), "--master", "local[1]"]
        extra = {"PHOTON_CRASH_AT": crash_at} if crash_at else None
        prefix = ["faketime", "-f", f"{clock_s:+.0f}s"] if clock_s else None
        return self._spawn(
            f"join-{dc}" + (f"-clock{clock_s:+.0f}s" if clock_s else ""), args, "photon_joiner", extra, prefix
        )

    def _verify(self, kill_after: float, now: float) -> None:
        if self.verifier is not None and self.verifier.poll() is None:
            return  # one pass at a time, as the DAG runs it
        args = ["verify", "--logs", str(self.logs), "--out", str(self.out), "--grace", str(self.p.grace_s), "--json"]
        self.verifier = self._spawn("verify", args, "photon_verifier")
        self.verifier_kill_at = now + kill_after if kill_after else None
        self.outcome.faults["verify"] += 1

    def _reap_verifier(self, now: float) -> None:
        v = self.verifier
        if v is None:
            return
        if v.poll() is None and self.verifier_kill_at is not None and now >= self.verifier_kill_at:
            self._kill(v)
            self.outcome.faults["verify_killed"] += 1
        if v.poll() is not None:
            self.outcome.verify["exit_" + str(v.returncode)] += 1
            self.verifier = None
            name = sorted(self.proc_logs.glob("*-verify.log"))[-1].read_text()
            if v.returncode == 0 and "{" in name:
                report = json.loads(name[name.index("{") :])
                self.outcome.verify["live_checked"] += report["checked"]
                self.outcome.verify["live_fenced"] += len(report["fenced"])
                self.outcome.verify["live_recovered"] += report["recovered"]
                self.outcome.verify["live_rolled_forward"] += len(report["rolled_forward"])

    # -- the run ---------------------------------------------------------------------------------------------
    def _apply(self, f: Fault, now: float) -> None:
        if f.kind == "lose_dc":
            # The data center's last lease dies in its second batch, after registering (clicks held by a pipeline
            # that will never commit them) or after committing (a batch that will never be published by it).
            self.lost.add(f.target)
            self._kill(self.joiners[f.target])
            self.dying[f.target] = "after_commit@+2" if f.arg else "after_register@+2"
            self.joiners[f.target] = self._lease(f.target, crash_at=self.dying[f.target])
            self.outcome.faults["lose_dc"] += 1
        elif f.kind == "kill" and f.target not in self.lost:
            self.kill_pending[f.target] = self.rng.uniform(0.0, 6.0)
        elif f.kind == "pg_restart" and self.pg_up_at is None:
            self.registry.stop_hard()
            self.pg_up_at = now + f.arg
            self.outcome.faults["pg_restart"] += 1
        elif f.kind == "verify":
            self._verify(f.arg, now)
        elif f.kind == "clock" and f.target not in self.lost:
            # Airflow's next lease of this pipeline lands on a host with a skewed clock: within the skew, whenever
            # the current lease ends; beyond it, now (the current lease killed): it must refuse before Spark starts.
            if abs(f.arg) <= SKEW_S:
                self.next_clock[f.target] = f.arg
                return
            self._kill(self.joiners[f.target])
            self._start_lease(f.target, f.arg)

    def _start_lease(self, dc: str, clock_s: float = 0.0) -> None:
        self.joiners[dc] = self._lease(dc, clock_s=clock_s)
        self.lease_log[dc], self.first_batch_at[dc] = self.last_log, None
        if clock_s:
            self.skewed[dc] = clock_s
            self.outcome.faults["clock"] += 1

    def _skewed_exit(self, dc: str, code: int | None) -> None:
        """A lease on a skewed clock ended: beyond the skew it must have refused (exit 2, the one line); within it,
        it is a lease like any other."""
        offset = self.skewed.pop(dc, None)
        if offset is None:
            return
        ran = b" batch " in self.lease_log[dc].read_bytes()
        if abs(offset) <= SKEW_S:
            self.outcome.faults["clock_within_ran" if ran else "clock_unchecked"] += 1
        elif code == 2 and b"PHOTON_MAX_CLOCK_SKEW_S" in self.lease_log[dc].read_bytes():
            self.outcome.faults["clock_refused"] += 1
        elif not ran:
            self.outcome.faults["clock_unchecked"] += 1  # failed before it asked (the registry was down), ran nothing
        else:
            raise AssertionError(
                f"seed {self.p.seed}: a lease {offset:+.0f}s off ran (exit {code}): {self.lease_log[dc]}"
            )

    def _last_lease(self, dc: str, proc: subprocess.Popen[bytes] | None) -> None:
        """A lost data center's last lease must die at its crash point, mid-batch: one that failed before it got
        there (the registry was down as it started) is retried, as Airflow would; once it died there, nothing more."""
        if dc not in self.dying or proc is None or proc.poll() is None:
            return
        self.outcome.joiner_exits[f"{dc}:{proc.returncode}"] += 1
        if proc.returncode == -signal.SIGKILL:
            del self.dying[dc]
            self.outcome.faults["lost_mid_batch"] += 1
        else:
            self.joiners[dc] = self._lease(dc, crash_at=self.dying[dc])

    def _check(self) -> None:
        dups = checker.duplicates(self.out)
        self.outcome.duplicate_checks += 1
        if dups:
            self.outcome.duplicates_seen = dups
            raise AssertionError(f"seed {self.p.seed}: click ids in two joined/ files: {dups[:5]}")

    def run(self) -> Outcome:
        t_wall = time.monotonic()
        self._setup_registry()
        try:
            self._live()
            self._finish()
        finally:
            for proc in [*self.joiners.values(), self.verifier]:
                self._kill(proc)
            self.registry.stop()
        self.outcome.wall_s = round(time.monotonic() - t_wall, 1)
        return self.outcome

    def _live(self) -> None:
        faults = list(self.p.faults)
        generator = self._generator()
        t0 = time.monotonic()
        next_check = 0.0
        self.outcome.faults["outage"] += 1
        while generator.poll() is None:
            now = time.monotonic() - t0
            for dc in DCS:
                proc = self.joiners[dc]
                if dc in self.lost:
                    self._last_lease(dc, proc)
                    continue
                if proc is not None and proc.poll() is not None:
                    self.outcome.joiner_exits[f"{dc}:{proc.returncode}"] += 1
                    self._skewed_exit(dc, proc.returncode)
                if proc is None or proc.poll() is not None:
                    # Airflow starts the next lease (or retries a dead one)
                    self._start_lease(dc, self.next_clock.pop(dc, 0.0))
                    continue
                first = self.first_batch_at[dc]
                if first is None and b" batch " in self.lease_log[dc].read_bytes():
                    self.first_batch_at[dc] = first = now
                if first is not None and dc in self.kill_pending and now - first >= self.kill_pending[dc]:
                    del self.kill_pending[dc]
                    self._kill(proc)
                    self.outcome.faults["kill"] += 1
            while faults and faults[0].at_s <= now:
                self._apply(faults.pop(0), now)
            if self.pg_up_at is not None and now >= self.pg_up_at:
                self.registry.restart()
                self.pg_up_at = None
            self._reap_verifier(now)
            if now >= next_check:
                self._check()
                next_check = now + 3.0
            time.sleep(0.2)
        if generator.returncode != 0:
            raise RuntimeError(f"the generator failed ({generator.returncode}); see {self.proc_logs}")
        if self.pg_up_at is not None:
            self.registry.restart()
            self.pg_up_at = None
        for dc in DCS:  # the input stopped: the last leases die where they stand
            self._kill(self.joiners[dc])
        if self.verifier is not None:
            self.verifier.wait()
            self._reap_verifier(time.monotonic() - t0)

    def _drain(self) -> None:
        from photon.joiner.common import JoinSettings
        from photon.joiner.lease import Joiner

        settings = JoinSettings(max_join_delay_s=MAX_JOIN_DELAY_S, trigger_interval_s=0.5)
        for dc in DCS:
            if dc in self.lost:
                continue
            if self.spark is not None:
                servers = {"main": self.dsn["photon_joiner"]}
                Joiner(dc, self.logs, self.out, servers, self.spark, settings).run(until_caught_up=True, drain=True)
            else:
                args = ["join", "--dc", dc, "--logs", str(self.logs), "--out", str(self.out), "--until-caught-up"]
                args += ["--drain", "--max-join-delay", str(MAX_JOIN_DELAY_S), "--master", "local[2]"]
                if self._spawn(f"drain-{dc}", args, "photon_joiner").wait() != 0:
                    raise RuntimeError(f"draining {dc} failed; see {self.proc_logs}")
            self._check()

    def _final_verify(self) -> dict[str, Any]:
        from photon.recovery.verify import verify_and_recover

        servers = {"main": self.dsn["photon_verifier"]}
        return verify_and_recover(servers, self.out, self.logs, grace_s=self.p.grace_s).to_dict()

    def _finish(self) -> None:
        time.sleep(self.p.grace_s + 1)  # every killed lease is now gone: the verifier fences and recovers
        reports = []
        for _ in range(3):
            reports.append(self._final_verify())
            self._drain()
        reports.append(self._final_verify())
        for r in reports:
            self.outcome.verify["final_fenced"] += len(r["fenced"])
            self.outcome.verify["final_recovered"] += r["recovered"]
            self.outcome.verify["final_rolled_forward"] += len(r["rolled_forward"])
            self.outcome.verify["final_checked"] += r["checked"]
        # Passes killed mid-way report nothing: count what reached the logs instead (one replica's copy).
        survivor = sorted(set(DCS) - self.lost)[0]
        self.outcome.verify["recovered_lines_in_logs"] = sum(
            len(p.read_bytes().splitlines()) for p in (self.logs / survivor / "clicks").rglob("recovered-*.jsonl")
        )
        last = reports[-1]
        verdict = checker.final(
            self.logs, self.out, lost=sorted(self.lost), max_join_delay_s=MAX_JOIN_DELAY_S, margin_s=MARGIN_S
        )
        self.outcome.verdict = verdict.summary()
        self.outcome.verdict["last_verify_lost"] = last["lost"]
        self.outcome.verdict["last_verify_in_flight"] = last["in_flight"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--rate", type=float, default=300.0, help="events per second per replica")
    ap.add_argument("--work", type=Path, default=None, help="keep the run's folder here (default: a temp folder)")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix=f"photon-nemesis-{args.seed}-"))
    p = plan(args.seed, args.seconds, args.rate)
    print(f"nemesis seed {p.seed}: {p.seconds:.0f}s, lost {p.lost}, outage {p.outage}, in {work}", flush=True)
    for f in p.faults:
        print(f"  {f.at_s:7.1f}s {f.kind} {f.target} {f.arg:.1f}", flush=True)
    outcome = Nemesis(p, work).run()
    print(json.dumps({**outcome.to_dict(), "work": str(work)}))
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())

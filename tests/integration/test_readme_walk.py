"""A newcomer's walk through the README (issue 33): the first run's block under "The joiner" (history for both data
centers, the registry, dc-a's and dc-b's joiners until caught up, the audit), each line pasted into bash in README
order, in a folder laid out as a clone (its own `.venv` link and `.photon`: the developer's `.photon` is never
touched) on a fresh registry database, and each line's promised result checked: the logs and manifest written, the
registry initialised, each data center's batches committed, the audit PASS with 0 duplicates and 0 lost.

The walk goes on in the Airflow section: its backfill and data-quality blocks come after the audit, in that order,
and run against a real `photon airflow` in tests/integration/test_airflow_local.py; this test checks that that test
runs exactly those blocks, so the two together walk the newcomer's path. (`make demo`, `make test` and `make airflow`
of "The two commands (and Airflow)" are whole programs that other tests run.)"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from photon.pg import autocommit
from tests.readme_blocks import Command, block_after, expand_dates

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

FIRST_RUN = "A first run"  # the line above the first run's block
# The blocks after the audit, as test_airflow_local.py finds them (run_readme_block's markers), in README order.
AIRFLOW_BLOCKS = ("**Backfill history**", "To check one hour now")

# What this test changes in the README's commands, and nothing else: per command, an option's text and what it
# becomes (options `photon generate --help` documents). The first run's two hours at 100 events/s (66,000 clicks,
# 261 MB per data center, a minute of joins) become the same two hours at 1 event/s, a file a minute per server.
SCALED_DOWN = {"photon generate": ("--rate 100", "--rate 1 --rotate 60")}

# The first run's block, command by command: (the words after `.venv/bin/photon`, the registry login it runs as).
# The migrations run as the database's owner (the admin that created it, as every test's init); each joiner as a login
# holding only photon_joiner; generate and audit only write and read files.
WALK = (
    ("generate", None),
    ("registry init", "owner"),
    ("join --dc dc-a", "photon_joiner"),
    ("join --dc dc-b", "photon_joiner"),
    ("audit", None),
)


def _scaled(command: Command) -> str:
    text = command.text
    for prefix, (option, replacement) in SCALED_DOWN.items():
        if f"bin/{prefix} " in text:
            assert option in text, (option, text)
            text = text.replace(option, replacement)
    return text


def _paste(line: str, clone: Path, dsn: str | None) -> subprocess.CompletedProcess[str]:
    """One line in a fresh bash in the clone, as pasted: no venv on PATH, `.venv/bin/photon` importing this checkout
    (PYTHONPATH, as test_airflow_local.py has it), PHOTON_REGISTRY_DSN the test's database or unset."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/")}
    # The test's server is a lone PostgreSQL, as a newcomer's embedded one is (which says "single" itself).
    env |= {"PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}", "PHOTON_REGISTRY_REPLICATION": "single"}
    if "PHOTON_SPARK_DRIVER_JAVA_OPTIONS" in os.environ:  # the suite's cheaper JIT for short Spark drivers
        env["PHOTON_SPARK_DRIVER_JAVA_OPTIONS"] = os.environ["PHOTON_SPARK_DRIVER_JAVA_OPTIONS"]
    if dsn:
        env["PHOTON_REGISTRY_DSN"] = dsn
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", line], cwd=clone, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"{line}\nexit {r.returncode}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    return r


def _runs_readme_blocks(test_file: Path) -> list[str]:
    """The markers of the README blocks a test file runs: the first argument of each run_readme_block call."""
    calls = [n for n in ast.walk(ast.parse(test_file.read_text())) if isinstance(n, ast.Call)]
    named = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "run_readme_block"]
    return [str(c.args[0].value) for c in named if isinstance(c.args[0], ast.Constant)]


def test_the_walk_goes_on_into_the_airflow_blocks_test_airflow_local_runs() -> None:
    """After the first run's audit, in README order, the backfill and then the data-quality block; and
    test_airflow_local.py pastes exactly those two (a block renamed, moved or left out there fails here)."""
    audit_line = block_after(FIRST_RUN)[-1].line
    lines = [block_after(marker)[0].line for marker in AIRFLOW_BLOCKS]
    assert audit_line < lines[0] < lines[1], (audit_line, lines)
    assert "backfill create" in block_after(AIRFLOW_BLOCKS[0])[0].text
    assert any("trigger photon_data_quality" in c.text for c in block_after(AIRFLOW_BLOCKS[1]))
    assert _runs_readme_blocks(ROOT / "tests/integration/test_airflow_local.py") == list(AIRFLOW_BLOCKS)


# Two Spark starts (each joiner is its own process, as pasted) and a small history: 24 s here, alone.
@pytest.mark.timeout(600)
def test_a_newcomer_pastes_the_first_run(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    t0 = time.monotonic()
    block = block_after(FIRST_RUN)
    shape = [" ".join(c.words[1 : 1 + len(words.split())]) for c, (words, _) in zip(block, WALK, strict=False)]
    assert [c.program for c in block] == ["photon"] * len(WALK) and shape == [w for w, _ in WALK], block

    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / ".venv").symlink_to(Path(sys.executable).parent.parent)  # `make setup`'s link to the venv
    owner = make_db()
    logins = {"owner": owner, "photon_joiner": None}
    timings: dict[str, float] = {}
    pasted_at: dict[str, tuple[datetime, datetime]] = {}
    results: dict[str, subprocess.CompletedProcess[str]] = {}
    for command, (words, role) in zip(block, WALK, strict=True):
        if role == "photon_joiner":  # after init: the migrations create the role
            logins[role] = logins[role] or login_as(owner, role)
        before, started = datetime.now(UTC), time.monotonic()
        results[words] = _paste(_scaled(command), clone, logins[role] if role else None)
        timings[words], pasted_at[words] = time.monotonic() - started, (before, datetime.now(UTC))

    photon = clone / ".photon"
    # generate: both data centers' replicas (hard links to one set of files) and the manifest, two hours from the
    # half hour four hours ago.
    assert (photon / "logs/_manifest/manifest.json").is_file()
    clicks = pq.read_table(photon / "logs/_manifest/clicks.parquet").column("click_ts_us").to_numpy()
    first, last = (datetime.fromtimestamp(us / 1e6, UTC) for us in (clicks.min(), clicks.max()))
    generate = block[0].words
    # The start as bash computed it when pasted (the hour may have turned while it ran), within the clocks' skew.
    starts = {
        datetime.fromisoformat(expand_dates(generate[generate.index("--start") + 1], t)) for t in pasted_at["generate"]
    }
    assert any(abs((first - s).total_seconds()) < 60 and (last - s).total_seconds() < 7200 + 60 for s in starts), (
        starts,
        first,
        last,
    )
    for dc in ("dc-a", "dc-b"):
        assert any((photon / "logs" / dc / "clicks").rglob("*.jsonl")), dc
    assert any(p.stat().st_nlink == 2 for p in (photon / "logs/dc-a/clicks").rglob("*.jsonl"))
    assert "expected outcomes" in results["generate"].stdout
    # registry init: the migrations and the first shard configuration.
    assert "created shard configuration v1: 4 shards" in results["registry init"].stdout
    # Each joiner committed the batches it says (its pipeline's last batch in the registry) and wrote its output folder.
    with autocommit(owner) as conn, conn.cursor() as cur:
        cur.execute("SELECT pipeline, last_batch FROM photon.pipelines ORDER BY pipeline")
        committed = dict(cur.fetchall())
    for dc in ("dc-a", "dc-b"):
        said = re.search(rf"^{dc}: (\d+) batch\(es\) committed", results[f"join --dc {dc}"].stdout, re.M)
        assert said and int(said.group(1)) >= 1 and committed[dc] == int(said.group(1)), (said, committed)
        assert (photon / "out" / dc / "joined").is_dir()
    assert DeltaTable(str(photon / "out/dc-a/joined")).to_pyarrow_table(columns=["click_id"]).num_rows > 0
    # The audit, with both data centers joined: PASS, every input click once.
    report = results["audit"].stdout
    assert "PASS" in report and "duplicates 0; lost 0" in report, report
    assert f"input clicks {len(clicks):,};" in report, (len(clicks), report)
    # Every registry command reached the test's database: no embedded server started in the clone.
    assert not (photon / "postgres").exists()
    print(
        "walked the first run in "
        + ", ".join(f"{w} {s:.1f}s" for w, s in timings.items())
        + f"; {len(clicks):,} clicks; whole test {time.monotonic() - t0:.0f}s"
    )

"""What a ``photon generate`` run writes is known before it writes: the estimate is close to what runs write, and a
run over ``LARGE_RUN_BYTES`` says so in one line on stderr before its first file (the README's old example wrote
26 GB per data center without a word)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from photon.tools import generator
from photon.tools.generator import GeneratorSettings, estimate_size, generate

START = 1_763_700_000_000_000
# The README's scaled example: an hour at 20,000 events/s.
README_EXAMPLE = ("--start", "2026-11-20T00:00:00Z", "--duration", "3600", "--rate", "20000")
US = 1_000_000
ROOT = Path(__file__).resolve().parents[2]
# The estimate counts the 2 MB malformed lines at their expected number (about one line in 110,000 by default); a run of
# 60,000 lines has none or a few, 2 MB each way. (The generator is deterministic: each case below gives one answer.)
NO_HUGE = {"malformed_weights": dict.fromkeys(generator.MALFORMED_KINDS, 1.0) | {"huge": 0.0}}


@pytest.mark.parametrize(
    ("settings", "seconds", "live"),
    [
        (GeneratorSettings(events_per_s=2_000), 60, False),
        (
            GeneratorSettings(events_per_s=2_000, rotate_s=1.0, chunk_s=5.0, dcs=("dc-a", "dc-b", "dc-c"), **NO_HUGE),
            30,
            True,
        ),
        (GeneratorSettings(events_per_s=1_500, query_vocabulary="non_ascii", query_words_max=60), 60, False),
        (GeneratorSettings(events_per_s=3_000, malformed_fraction=0.01, duplicate_fraction=0.05), 60, False),
    ],
    ids=["defaults", "live-three-replicas", "long-non-ascii-queries", "more-bad-lines"],
)
def test_estimate_is_within_a_few_percent_of_the_run(
    settings: GeneratorSettings, seconds: int, live: bool, tmp_path: Path
) -> None:
    estimate = estimate_size(settings, seconds, live=live)
    # Live mode writes each file at its arrival time; its bytes are the same as historical mode's, only slower.
    report = generate(settings, tmp_path, start_us=START, end_us=START + seconds * US)
    on_disk = sum(p.stat().st_size for p in (tmp_path / settings.dcs[0]).rglob("*.jsonl"))
    assert report.bytes == on_disk  # what the report counts is what a replica holds
    assert estimate.events == pytest.approx(report.queries + report.clicks, rel=0.04)
    assert estimate.lines == pytest.approx(report.lines, rel=0.04)
    assert estimate.bytes_per_dc == pytest.approx(report.bytes, rel=0.06)
    assert estimate.bytes_on_disk == estimate.bytes_per_dc * (len(settings.dcs) if live else 1)


def test_a_large_run_warns_in_one_line_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = GeneratorSettings(events_per_s=1_000)
    generate(settings, tmp_path / "small", start_us=START, end_us=START + 20 * US)
    assert capsys.readouterr().err == ""  # 7 MB: nothing to say

    monkeypatch.setattr(generator, "LARGE_RUN_BYTES", 1_000_000)  # 1 MB, so a 7 MB run is large
    monkeypatch.setattr(generator, "write_file", lambda *_: pytest.fail("wrote a file before the warning"))
    with pytest.raises(BaseException, match="wrote a file before the warning"):
        generate(settings, tmp_path / "large", start_us=START, end_us=START + 20 * US)
    err = capsys.readouterr().err
    estimate = estimate_size(settings, 20)
    assert err.count("\n") == 1 and err.startswith("photon generate: this run writes about "), err
    assert f"about {estimate.events:,} events, {estimate.bytes_per_dc / 1e9:,.1f} GB per data center" in err, err


def test_the_cli_warns_at_once_on_the_readme_s_scaled_example(tmp_path: Path) -> None:
    """``--rate 20000`` for an hour: 71 M events, 26.5 GB per data center. The line comes first, within seconds, while
    next to nothing is written; the run is stopped there."""
    logs = tmp_path / "logs"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "plugins"), str(ROOT)])}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "photon", "generate", "--logs", str(logs), "--mode", "historical", *README_EXAMPLE],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(60, proc.kill)  # without a warning, stop it before it has written gigabytes
    watchdog.start()
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        took = time.monotonic() - t0
        proc.kill()
        proc.wait(timeout=30)
        written = sum(p.stat().st_size for p in logs.rglob("*") if p.is_file())
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
    assert line.startswith("photon generate: this run writes about 71,"), line
    assert "26.5 GB per data center (2 data centers, 26.5 GB on disk, the replicas hard-linked)" in line, line
    assert written < 200_000_000, written  # the first chunks at most, not gigabytes
    print(f"warned after {took:.1f}s, {written:,} bytes written by then")

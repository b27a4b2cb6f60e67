"""Data-quality checkpoint (Great Expectations 1.x) over a generated, correct output, and with planted faults."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from photon.generator import GeneratorSettings, generate
from photon.quality import QualitySettings, check_quality
from tests.integration.audit_fixtures import perfect_output, rewrite

START = 1_763_700_000_000_000
US = 1_000_000
LENIENT = QualitySettings(max_unjoinable_rate=0.2)


@pytest.fixture(scope="module")
def perfect(tmp_path_factory: pytest.TempPathFactory) -> Path:
    logs = tmp_path_factory.mktemp("logs")
    generate(GeneratorSettings(events_per_s=2_000), logs, start_us=START, end_us=START + 20 * US)
    out = tmp_path_factory.mktemp("perfect")
    perfect_output(logs, out)
    return out


@pytest.fixture
def out(perfect: Path, tmp_path: Path) -> Path:
    shutil.copytree(perfect, tmp_path / "out")
    return tmp_path / "out"


def test_correct_output_passes_and_writes_data_docs(out: Path) -> None:
    r = check_quality(out, START - 3600 * US, START + 3600 * US, LENIENT)
    assert r.success, r.failed
    assert r.joined > 1_000 and r.unjoinable > 0
    assert r.statistics["joined"]["evaluated_expectations"] == 10
    index = Path(r.docs_index)
    assert index.is_file() and "photon_joined" in index.read_text()
    # A second interval adds to the same site; an interval with no clicks passes.
    assert check_quality(out, START + 3600 * US, START + 7200 * US, LENIENT).success


def test_planted_duplicate_fails(out: Path) -> None:
    row = pq.read_table(out / "dc-a" / "joined" / "part-0.parquet").slice(0, 1)
    rewrite(out / "dc-b" / "joined" / "part-0.parquet", lambda t: pa.concat_tables([t, row]))
    r = check_quality(out, START - 3600 * US, START + 3600 * US, LENIENT)
    assert not r.success
    assert r.failed == ["joined: expect_column_values_to_be_unique(click_id)"]


def test_missing_field_slow_clicks_and_rates_fail(out: Path) -> None:
    def damage(t: pa.Table) -> pa.Table:
        i = t.schema.get_field_index("query_id")
        t = t.set_column(i, "query_id", pa.array([None, *t.column("query_id").to_pylist()[1:]], pa.string()))
        late = pc.add(t.column("click_ts_us"), 3_600 * US)  # an hour to join: far past the SLO
        return t.set_column(t.schema.get_field_index("joined_at_us"), "joined_at_us", late)

    rewrite(out / "dc-a" / "joined" / "part-0.parquet", damage)
    r = check_quality(out, START - 3600 * US, START + 3600 * US, QualitySettings(max_unjoinable_rate=0.001))
    assert sorted(r.failed) == [
        "joined: expect_column_values_to_be_between(latency_s)",
        "joined: expect_column_values_to_not_be_null(query_id)",
        "rates: expect_column_values_to_be_between(unjoinable_rate)",
    ]

"""The names a person and a reader use for an hour: ``photon final --hour`` and the marker's file name."""

from __future__ import annotations

from pathlib import Path

import pytest

from photon.tools.completeness import HOUR_US, decide_final, hour_interval, marker_path, summary

US = 1_000_000
H13 = 1_795_525_200 * US  # 2026-11-24T13:00:00Z


@pytest.mark.parametrize("text", ["2026-11-24T13", "2026-11-24T13:00", "2026-11-24T13:00:00Z", "2026-11-24T15+02:00"])
def test_an_hour_is_named_in_utc_or_with_its_offset(text: str) -> None:
    assert hour_interval(text) == (H13, H13 + HOUR_US)


@pytest.mark.parametrize("text", ["2026-11-24T13:30", "13:00", "yesterday"])
def test_anything_but_the_start_of_an_hour_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="hour"):
        hour_interval(text)


def test_the_marker_of_an_hour_is_named_by_the_hour_and_other_intervals_by_both_ends() -> None:
    out = Path("/out")
    assert marker_path(out, H13, H13 + HOUR_US) == str(out / "_final" / "2026112413.json")
    assert marker_path(out, H13, H13 + HOUR_US // 2) == str(out / "_final" / "202611241300-202611241330.json")


def test_a_missing_logs_folder_is_an_error_not_an_hour_without_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        decide_final({"main": "host=/nonexistent"}, tmp_path / "logs", tmp_path / "out", H13, H13 + HOUR_US)


def test_the_one_line_answer_groups_thousands_as_the_other_commands_do() -> None:
    """It said '2872 click files, 16667 clicks' beside `photon status`'s '16,559 joined'."""
    final = {"start": "2026-11-25T01:00:00Z", "end": "2026-11-25T02:00:00Z", "final": True}
    final |= {"decided_at": "2026-11-25T04:42:12Z", "click_files": 2872, "input_clicks": 16667, "lost_data_centers": []}
    assert summary(final) == (
        "[2026-11-25T01:00:00Z, 2026-11-25T02:00:00Z) is final (decided at 2026-11-25T04:42:12Z): 2,872 click files,"
        " 16,667 clicks"
    )


def test_the_backfill_dag_passes_its_allow_empty_param_to_each_join() -> None:
    """photon_backfill's ``allow_empty`` param reaches every data center's `photon join` as ``--allow-empty``, else
    ``--no-allow-empty`` (rendered by Jinja as Airflow does): a window without logs or past the horizon fails unless
    the run asks to accept it."""
    import jinja2

    from photon.airflow.dags import ALLOW_EMPTY, backfill_dag

    dag = backfill_dag()
    assert dag.params["allow_empty"] is False and dag.params.get_param("allow_empty").schema["type"] == "boolean"
    assert dag.tasks and all(ALLOW_EMPTY in t.application_args for t in dag.tasks)
    render = jinja2.Template(ALLOW_EMPTY).render
    assert render(params={"allow_empty": True}) == "--allow-empty"
    assert render(params={"allow_empty": False}) == "--no-allow-empty"

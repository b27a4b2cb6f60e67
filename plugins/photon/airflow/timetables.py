"""``BackfillOnlyTimetable``: hourly data intervals that only ``airflow backfill create`` (or a manual trigger)
walks; the scheduler never creates a run of its own.

Airflow 3.3 starts a backfill's runs only while their DAG is unpaused (the scheduler's queued-to-running query skips
paused DAGs), and an unpaused DAG on an hourly schedule also runs every hour. ``photon_backfill`` needs the first
without the second, so its timetable answers the scheduler's question ("what is the next run after the last one?",
asked with no end to the range and without catch-up) with nothing, and a backfill's (every interval between its
``--from-date`` and ``--to-date``, with catch-up) as an hourly cron data-interval timetable does. The DAG is created
unpaused, so ``airflow backfill create`` works as written.

Registered with Airflow by ``plugins/photon_plugin.py`` (the DAG processor, scheduler and API server serialise and read
timetables by their registered import path).
"""

from __future__ import annotations

from typing import Any

from airflow.timetables.base import DagRunInfo, DataInterval, TimeRestriction
from airflow.timetables.interval import CronDataIntervalTimetable


class BackfillOnlyTimetable(CronDataIntervalTimetable):
    """A cron data-interval timetable (hourly by default, UTC) that schedules nothing by itself."""

    can_be_scheduled = False  # no automated runs; ``periodic`` stays True, which is what a backfill requires

    def __init__(self, cron: str = "0 * * * *", timezone: Any = "UTC") -> None:
        super().__init__(cron, timezone)
        self.description = f"{self.description}, by backfill only" if self.description else "by backfill only"

    @property
    def summary(self) -> str:
        return f"{self._expression} (backfill only)"

    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
    ) -> DagRunInfo | None:
        # A backfill iterates over a closed range with catch-up; the scheduler asks with the DAG's own restriction
        # (no end date, no catch-up) and gets no run.
        if restriction.latest is None or not restriction.catchup:
            return None
        return super().next_dagrun_info(
            last_automated_data_interval=last_automated_data_interval, restriction=restriction
        )

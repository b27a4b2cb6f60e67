"""DAG builders: the files in ``dags/`` call these and nothing else.

Parse time reads only the environment (``PHOTON_DCS``, ``PHOTON_HOME``, ``PHOTON_TASK_RETRIES``,
``PHOTON_JOIN_LEASE_S``, ``PHOTON_MAX_CLOCK_SKEW_S``); paths come from the Variables
``photon_logs`` and ``photon_out``, a new live pipeline's start from ``photon_join_start`` (templated, so read when a
task runs), endpoints from the connections
``photon_registry_<component>`` (each falling back to ``photon_registry``) and ``spark_default``, tunables from each
DAG's params (the form the UI shows on "Trigger DAG w/ config").

Each DAG reaches the registry as its own component's login: the joiner and backfill DAGs as ``joiner``,
photon_verify_recover and photon_finality (which only reads) as ``verifier``, photon_registry_gc as ``gc``,
photon_reshard as ``reshard``; photon_data_quality reads only the output files, and photon_table_maintenance touches
only the output tables.

photon_finality declares each hour final (``photon.tools.completeness``): it writes the marker
``<out>/_final/<YYYYmmddHH>.json`` and emits an event of the asset ``photon://final/hourly`` (extra: the hour's
``start`` and ``end``), on which photon_data_quality and any downstream DAG schedule.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any

from airflow.sdk import (
    DAG,
    Asset,
    BaseSensorOperator,
    CronDataIntervalTimetable,
    Param,
    PokeReturnValue,
    TriggerRule,
    task,
)

from photon.airflow.operators import SPARK_DIR, PhotonSparkSubmitOperator

START = datetime(2025, 1, 1, tzinfo=UTC)


def data_centers() -> tuple[str, ...]:
    """The data centers to build DAGs for (``PHOTON_DCS``, comma-separated; read when the DAG files are parsed)."""
    return tuple(d.strip() for d in os.environ.get("PHOTON_DCS", "dc-a,dc-b").split(",") if d.strip())


_HOME = os.environ.get("PHOTON_HOME", ".photon")
LOGS = "{{ var.value.get('photon_logs', '" + os.path.join(_HOME, "logs") + "') }}"
OUT = "{{ var.value.get('photon_out', '" + os.path.join(_HOME, "out") + "') }}"
# Where a new live pipeline starts reading: the run's param, else the Variable, else every file in the logs.
START_AT = "{{ params.start or var.value.get('photon_join_start', 'beginning') }}"


def retries() -> dict[str, Any]:
    """Retries with exponential backoff; ``PHOTON_TASK_RETRIES`` (default 5) sets how many (tests use 0)."""
    return {
        "retries": int(os.environ.get("PHOTON_TASK_RETRIES", "5")),
        "retry_delay": timedelta(seconds=15),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(minutes=10),
    }


def lease_s() -> int:
    """The join DAGs' default lease length in seconds: ``PHOTON_JOIN_LEASE_S`` (read when the DAG files are parsed;
    default 300), e.g. shorter to watch several hand-overs in a few minutes. A run's own ``lease_s`` param wins."""
    value = int(os.environ.get("PHOTON_JOIN_LEASE_S", "300"))
    if not 10 <= value <= 3600:
        raise ValueError(f"PHOTON_JOIN_LEASE_S={value}: a lease lasts 10 to 3600 seconds")
    return value


def clock_skew_s() -> float:
    """The GC and data-quality DAGs' default ``max_clock_skew_s``: ``PHOTON_MAX_CLOCK_SKEW_S`` as the joiners read it
    (default 10), so that a raised bound moves their thresholds and settle times with the joiners' seal."""
    value = float(os.environ.get("PHOTON_MAX_CLOCK_SKEW_S", "10"))
    if not 0 <= value <= 3600:
        raise ValueError(f"PHOTON_MAX_CLOCK_SKEW_S={value}: 0 to 3600 seconds")
    return value


JOIN_APP = str(SPARK_DIR / "photon_join.py")
# One event per hour declared final (extra: start, end, ...). The URI is photon.tools.completeness.FINAL_ASSET_URI
# (a test holds them equal): that module loads Arrow, which parsing a DAG file must not.
FINAL_HOURLY = Asset("photon://final/hourly")
US = 1_000_000
# Runs that cover an hour (data_interval_start .. data_interval_end), not points in time.
HOURLY = CronDataIntervalTimetable("0 * * * *", timezone="UTC")


def _dag(**kwargs: Any) -> DAG:
    """A DAG with the project's common settings: no catch-up of missed intervals (backfills are explicit)."""
    return DAG(start_date=START, catchup=False, **kwargs)


def dag_id_for(dc: str, standby: bool = False) -> str:
    return f"photon_join_{dc.replace('-', '_')}" + ("_standby" if standby else "")


def join_dag(dc: str, standby: bool = False) -> DAG:
    """One joiner lease per run (``photon join --standby``: it takes over when the lease before releases the
    pipeline after its last batch, or once that lease's heartbeat is stale). Each data center has two such DAGs,
    ``photon_join_<dc>`` and ``photon_join_<dc>_standby`` (a continuous DAG runs one run at a time): with both
    unpaused, one run holds the lease while the other's starts its Spark session and waits, so a lease hands over
    without a gap; a lease whose term ends while that standby is still starting joins on (up to
    ``hand_over_wait_s``) until it is ready. A failed run is retried with backoff and resumes from the committed
    position."""
    with _dag(
        dag_id=dag_id_for(dc, standby),
        description=f"Photon joiner for {dc}: one lease of micro-batches per run"
        + (" (the second lease slot: warm while the other DAG's lease runs)" if standby else ""),
        schedule="@continuous",
        max_active_runs=1,
        tags=["photon", "joiner", dc],
        default_args=retries(),
        params={
            "lease_s": Param(lease_s(), type="integer", minimum=10, maximum=3600, description="Seconds per lease."),
            "trigger_interval_s": Param(1.0, type="number", minimum=0.1, maximum=60, description="Between batches."),
            "max_join_delay_s": Param(120.0, type="number", minimum=1, description="Give up on a query after this."),
            "hand_over_wait_s": Param(
                120,
                type="integer",
                minimum=0,
                maximum=300,
                description="At the lease's end, join on up to this long while the next lease is still starting.",
            ),
            "start": Param(
                None,
                type=["null", "string"],
                description="Where a NEW pipeline starts reading: 'beginning' (every file in the logs), 'now' or an "
                "ISO time (UTC); click files before it are history, for photon_backfill. Empty: the Variable "
                "photon_join_start, else 'beginning'. Recorded when the pipeline is created; ignored after.",
            ),
        },
        doc_md=__doc__,
    ) as dag:
        _joiner_task(
            "joiner_lease",
            f"photon-join-{dc}",
            dc,
            [
                *("--run-for", "{{ params.lease_s }}", "--trigger-interval", "{{ params.trigger_interval_s }}"),
                *("--hand-over-wait", "{{ params.hand_over_wait_s }}", "--standby"),
                *("--start", START_AT),
            ],
            timedelta(hours=3),  # a standby waits up to one lease before its own
        )
    return dag


def _joiner_task(
    task_id: str, name: str, dc: str, args: list[str], timeout: timedelta, *, spark_connect: bool = False
) -> PhotonSparkSubmitOperator:
    """A joiner run through spark-submit (``spark/photon_join.py``) on ``spark_default``, as the joiner's login; with
    ``spark_connect``, on the warm Spark Connect server when one is up."""
    return PhotonSparkSubmitOperator(
        task_id=task_id,
        application=JOIN_APP,
        conn_id="spark_default",
        registry_component="joiner",
        spark_connect=spark_connect,
        name=name,
        application_args=[
            *("--dc", dc, "--logs", LOGS, "--out", OUT, "--max-join-delay", "{{ params.max_join_delay_s }}"),
            *args,
        ],
        execution_timeout=timeout,
    )


# photon_backfill's allow_empty param as `photon join`'s flag (an argument always there: never an empty one).
ALLOW_EMPTY = "{{ '--allow-empty' if params.allow_empty else '--no-allow-empty' }}"


def backfill_dag() -> DAG:
    """Joins the logs of each data interval until caught up, one pipeline per data center and interval
    (``backfill-<dc>-<interval start as YYYYmmddHHMM>``), for ``airflow backfill create``. Safe to rerun and to run
    beside the live joiners: the registry lets each click into the output once, whichever pipeline registers it
    first. Hourly intervals that only a backfill walks (``BackfillOnlyTimetable``): the scheduler never runs it by
    itself, so the DAG is created unpaused and a backfill's runs start at once."""
    from photon.airflow.timetables import BackfillOnlyTimetable

    with _dag(
        dag_id="photon_backfill",
        description="Photon backfill: join one interval of historical logs",
        schedule=BackfillOnlyTimetable(),
        is_paused_upon_creation=False,
        max_active_runs=1,
        tags=["photon", "backfill"],
        default_args=retries(),
        params={
            "max_join_delay_s": Param(120.0, type="number", minimum=1, description="As for the joiners."),
            "allow_empty": Param(
                False,
                type="boolean",
                description="Run an interval whose replica holds no click file, or that ends before the registry's"
                " horizon (refused otherwise: such a run joins nothing).",
            ),
        },
    ) as dag:
        # The data centers' tasks run one after the other, not side by side: the second one's registry pre-filter
        # drops what the first joined, so each click is joined once instead of by both and then thrown away by one
        # (half the work). The second runs whatever became of the first (all_done): it joins whatever the first
        # could not, from its own replica, and is the fallback when the first fails.
        previous: PhotonSparkSubmitOperator | None = None
        for dc in data_centers():
            task = _joiner_task(
                f"backfill_{dc.replace('-', '_')}",
                f"photon-backfill-{dc}",
                dc,
                [
                    *("--pipeline", f"backfill-{dc}-" + "{{ data_interval_start.strftime('%Y%m%d%H%M') }}"),
                    *("--until-caught-up", "--drain"),
                    *("--window-start", "{{ data_interval_start.isoformat() }}"),
                    *("--window-end", "{{ data_interval_end.isoformat() }}"),
                    ALLOW_EMPTY,
                ],
                timedelta(hours=6),
                # A backfill task is short: on the warm server it skips a Spark start longer than its hour's join.
                spark_connect=True,
            )
            if previous is not None:
                task.trigger_rule = TriggerRule.ALL_DONE
                previous >> task
            previous = task
    return dag


def data_quality_dag() -> DAG:
    """A Great Expectations checkpoint over every pipeline's output for the clicks of one hour, run when photon_finality
    declares the hour final (an event of ``photon://final/hourly``; one checkpoint task per hour the run's events
    name), or by hand for the hour the ``hour`` param names (default: the hour before the run's logical date). The
    task fails when the checkpoint fails; its summary goes to XCom (``return_value`` when it passes, ``summary``
    either way); Data Docs in ``<out>/_quality/data_docs`` (a folder, or objects in the bucket). Completeness: every
    well-formed click of the hour's click files has exactly one outcome. A manual run of an hour that has not
    settled by this host's clock (``settle_margin_s`` past the joiners' deadlines) is retried, neither passed nor
    failed; a final hour has settled by definition. Latency is judged for clicks joined live only; quarantined lines
    count for the interval of their log file (read from the logs), so a backfilled hour is judged like a live one;
    an hour without input fails unless ``allow_empty``; rates over fewer than ``min_rate_denominator`` are reported,
    not judged (see ``photon.tools.quality``)."""
    with _dag(
        dag_id="photon_data_quality",
        description="Photon data quality: a GX checkpoint per final hour, with Data Docs",
        schedule=[FINAL_HOURLY],
        max_active_runs=2,
        tags=["photon", "data-quality"],
        default_args={"retries": min(1, retries()["retries"]), "retry_delay": timedelta(minutes=1)},
        params={
            "hour": Param(
                None,
                type=["null", "string"],
                description="A manual run's UTC hour, e.g. 2026-11-24T13 (empty: the hour before the logical date).",
            ),
            "max_clock_skew_s": Param(clock_skew_s(), type="number", minimum=0),
            "latency_slo_s": Param(
                60.0, type="number", minimum=0, description="End-to-end, for most clicks of live pipelines."
            ),
            "latency_mostly": Param(0.99, type="number", minimum=0, maximum=1),
            "max_unjoinable_rate": Param(0.05, type="number", minimum=0, maximum=1),
            "max_quarantine_rate": Param(0.05, type="number", minimum=0),
            "min_rate_denominator": Param(
                100,
                type="integer",
                minimum=1,
                description="Judge the unjoinable rate from this many decided clicks on, the quarantine rate from this"
                " many lines; below, report them only.",
            ),
            "min_click_files": Param(
                1, type="integer", minimum=0, description="Fewer click files in the hour (all replicas) fails it."
            ),
            "allow_empty": Param(
                False, type="boolean", description="Accept an hour without input (no click file): on purpose only."
            ),
            "max_join_delay_s": Param(120.0, type="number", minimum=0, description="The joiners' maximum join delay."),
            "settle_margin_s": Param(
                120.0,
                type="number",
                minimum=0,
                description="A manual run judges completeness this long after the last deadline.",
            ),
        },
    ) as dag:

        @task(task_id="intervals")
        def intervals(**context: Any) -> list[dict[str, Any]]:
            """The hours to check: those the finality events that triggered the run name (a run consumes every event
            since the last one), else the manual run's."""
            events = context["triggering_asset_events"].get(FINAL_HOURLY, [])
            found = sorted({_event_interval(e.extra) for e in events})
            # An hour declared final without input (photon_finality's allow_empty) is checked as accepted empty.
            empty = {_event_interval(e.extra) for e in events if e.extra.get("empty_accepted")}
            if found:
                return [
                    {"start_us": a, "end_us": b, "declared_final": True, "empty_accepted": (a, b) in empty}
                    for a, b in found
                ]
            from photon.tools.completeness import HOUR_US, hour_interval

            hour = context["params"].get("hour")
            if hour:
                a, b = hour_interval(str(hour))
            else:
                when = context.get("logical_date") or context["dag_run"].run_after
                b = int(when.timestamp()) * US // HOUR_US * HOUR_US
                a = b - HOUR_US
            return [{"start_us": a, "end_us": b, "declared_final": False}]

        @task(task_id="checkpoint")
        def checkpoint(interval: dict[str, Any], logs: str, out: str, **context: Any) -> dict[str, Any]:
            import time

            from airflow.sdk.exceptions import AirflowException, AirflowFailException

            from photon.airflow.hooks import ObjectStoreHook
            from photon.tools.quality import NotSettled, QualitySettings, check_quality

            p = context["params"]
            settings = QualitySettings(
                max_clock_skew_s=float(p["max_clock_skew_s"]),
                latency_slo_s=float(p["latency_slo_s"]),
                latency_mostly=float(p["latency_mostly"]),
                max_unjoinable_rate=float(p["max_unjoinable_rate"]),
                max_quarantine_rate=float(p["max_quarantine_rate"]),
                min_rate_denominator=int(p["min_rate_denominator"]),
                min_click_files=int(p["min_click_files"]),
                allow_empty=bool(p["allow_empty"]) or bool(interval.get("empty_accepted")),
                max_join_delay_s=float(p["max_join_delay_s"]),
                settle_margin_s=float(p["settle_margin_s"]),
            )
            start, end = int(interval["start_us"]), int(interval["end_us"])
            now = int(time.time() * US)
            # A declared hour is judged now: finality (read from the registry) is what the settle time guesses at.
            now = max(now, settings.settled_at_us(end)) if interval["declared_final"] else now
            try:
                store = ObjectStoreHook()  # folders, or s3:// URLs reached with the photon_storage connection
                result = check_quality(store.open(out), store.open(logs), start, end, settings, now_us=now)
            except NotSettled as exc:  # neither pass nor fail: the retry asks again
                raise AirflowException(f"data-quality checkpoint not run: {exc}") from exc
            summary = result.summary()
            context["ti"].xcom_push(key="summary", value=summary)
            if not result.success:
                raise AirflowFailException(f"data-quality checkpoint failed: {'; '.join(result.details)}")
            return summary

        checkpoint.partial(logs=LOGS, out=OUT).expand(interval=intervals())
    return dag


def _event_interval(extra: dict[str, Any]) -> tuple[int, int]:
    """[start_us, end_us) of a finality event: photon_finality's extra, or an event made by hand (the UI's "Create
    Asset Event") naming ``start`` and ``end`` as ISO times."""
    if "start_us" in extra and "end_us" in extra:
        return int(extra["start_us"]), int(extra["end_us"])
    try:
        a, b = (datetime.fromisoformat(str(extra[k]).replace("Z", "+00:00")) for k in ("start", "end"))
    except (KeyError, ValueError):
        raise ValueError(
            f"a photon://final/hourly event names no interval (start_us and end_us, or start and end): {extra}"
        ) from None
    a, b = (t if t.tzinfo else t.replace(tzinfo=UTC) for t in (a, b))
    return int(a.timestamp() * US), int(b.timestamp() * US)


class FinalSensor(BaseSensorOperator):
    """Waits until the run's data interval is final (``photon.tools.completeness.decide_final``, read as the
    verifier's login) and pushes the decision; each poke that finds it not final logs why."""

    template_fields = ("logs", "out")

    def __init__(self, *, logs: str, out: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.logs, self.out = logs, out

    def poke(self, context: Any) -> PokeReturnValue:
        from photon.airflow.hooks import IdRegistryHook, ObjectStoreHook
        from photon.tools.completeness import FinalitySettings, decide_final, summary

        p = context["params"]
        store = ObjectStoreHook()
        decision = decide_final(
            IdRegistryHook(component="verifier").servers(),
            store.open(self.logs),  # a folder or an s3:// URL
            store.open(self.out),
            int(context["data_interval_start"].timestamp() * US),
            int(context["data_interval_end"].timestamp() * US),
            FinalitySettings(
                float(p["max_join_delay_s"]),
                float(p["max_clock_skew_s"]),
                float(p["lost_after_s"]),
                int(p["min_click_files"]),
                bool(p["allow_empty"]),
            ),
        )
        self.log.info("%s", summary(decision))
        for reason in decision.reasons[1:]:
            self.log.info("  and: %s", reason)
        return PokeReturnValue(decision.final, decision.to_dict() if decision.final else None)


def finality_dag() -> DAG:
    """Hourly: wait until the hour is final (every click file of it consumed by a pipeline that decides it, no click
    of it waiting in a live pipeline's retry set or registered by an unpublished batch, by the registry server's
    clock past its seal and join deadline; ``photon.tools.completeness``), then declare it: the marker
    ``<out>/_final/<YYYYmmddHH>.json`` and an event of ``photon://final/hourly`` with the hour's ``start``, ``end``
    and counts. The sensor reschedules itself every minute (no worker slot held while it waits) for up to a day."""
    with _dag(
        dag_id="photon_finality",
        description="Photon completeness: declare each hour final (marker and asset event)",
        schedule=HOURLY,
        max_active_runs=6,  # an hour held back (a data center's replica lagging) does not hold back the next ones
        tags=["photon", "finality"],
        default_args=retries(),
        params={
            "max_join_delay_s": Param(120.0, type="number", minimum=0, description="The joiners' maximum join delay."),
            "max_clock_skew_s": Param(clock_skew_s(), type="number", minimum=0),
            "lost_after_s": Param(
                600.0,
                type="number",
                minimum=0,
                description="A data center none of whose pipelines heartbeated for this long is lost: not waited for.",
            ),
            "min_click_files": Param(
                1, type="integer", minimum=0, description="Fewer click files in the hour (all replicas): not final."
            ),
            "allow_empty": Param(
                False, type="boolean", description="Declare an hour without input final (the marker records it)."
            ),
        },
    ) as dag:
        wait = FinalSensor(
            task_id="wait_final",
            logs=LOGS,
            out=OUT,
            mode="reschedule",
            poke_interval=60,
            timeout=timedelta(days=1),
        )

        @task(task_id="declare_final", outlets=[FINAL_HOURLY])
        def declare(decision: dict[str, Any], out: str, **context: Any) -> dict[str, Any]:
            from photon.airflow.hooks import ObjectStoreHook
            from photon.tools.completeness import Finality, write_marker

            path, marker = write_marker(ObjectStoreHook().open(out), Finality.from_dict(decision))
            extra = {k: marker[k] for k in ("start", "end", "start_us", "end_us", "click_files", "input_clicks")}
            extra["empty_accepted"] = bool(marker.get("empty_accepted"))
            context["outlet_events"][FINAL_HOURLY].extra = extra | {"marker": str(path)}
            return extra | {"marker": str(path)}

        declare(wait.output, OUT)  # type: ignore[arg-type]  # an XComArg, resolved to the decision at run time
    return dag


def registry_gc_dag() -> DAG:
    """Hourly registry garbage collection: advance every shard's GC threshold to now - retention - max clock skew
    (never back), drop the partitions wholly below it, delete the rows left below it. The report (rows and bytes
    freed per shard) is the task's XCom. With ``dry_run`` it only reports."""
    with _dag(
        dag_id="photon_registry_gc",
        description="Photon registry GC: advance thresholds, drop expired partitions",
        schedule=HOURLY,
        max_active_runs=1,
        tags=["photon", "registry", "gc"],
        default_args=retries(),
        params={
            "retention_s": Param(3 * 86_400, type="integer", minimum=60, description="How long ids are remembered."),
            "max_clock_skew_s": Param(clock_skew_s(), type="number", minimum=0),
            "dry_run": Param(False, type="boolean", description="Report what would be freed; change nothing."),
        },
    ) as dag:

        @task(task_id="collect_garbage")
        def gc(**context: Any) -> dict[str, Any]:
            from photon.airflow.hooks import IdRegistryHook
            from photon.registry.gc import collect_garbage

            p = context["params"]
            report = collect_garbage(
                IdRegistryHook(component="gc").servers(),
                retention_s=float(p["retention_s"]),
                max_clock_skew_s=float(p["max_clock_skew_s"]),
                dry_run=bool(p["dry_run"]),
            )
            return report.to_dict()

        gc()
    return dag


def table_maintenance_dag() -> DAG:
    """Hourly output table maintenance (``photon table maintain``, ``photon.tools.maintenance``): per pipeline and
    table, compact each hour's small files, checkpoint, drop expired log files, vacuum the data files no commit names
    once older than the retention. Safe beside the joiners and backfills appending; the report is the task's XCom."""
    with _dag(
        dag_id="photon_table_maintenance",
        description="Photon output tables: compaction, checkpoint, vacuum",
        schedule=HOURLY,
        max_active_runs=1,
        tags=["photon", "tables", "maintenance"],
        default_args=retries(),
        params={
            "retention_hours": Param(
                168,
                type="integer",
                minimum=24,  # photon.tools.maintenance.MIN_RETENTION_HOURS (a test holds them equal)
                description="Vacuum unreferenced data files, and files a compaction replaced, this many hours old.",
            ),
            "pipelines": Param(
                [], type="array", items={"type": "string"}, description="Only these pipelines; empty: all."
            ),
            "dry_run": Param(False, type="boolean", description="Report what would be done; change nothing."),
        },
    ) as dag:

        @task(task_id="maintain_tables")
        def run(out: str, **context: Any) -> dict[str, Any]:
            from photon.airflow.hooks import ObjectStoreHook
            from photon.tools.maintenance import maintain

            p = context["params"]
            report = maintain(
                ObjectStoreHook().open(out),  # a folder or an s3:// URL
                list(p["pipelines"]) or None,
                retention_hours=int(p["retention_hours"]),
                dry_run=bool(p["dry_run"]),
            )
            return report.to_dict() | {"totals": report.totals()}

        run(OUT)
    return dag


def verify_recover_dag() -> DAG:
    """Every few minutes: find registered clicks whose output never landed and whose batch is over, recover them,
    and clear the tokens of committed output. The report is the task's XCom."""
    with _dag(
        dag_id="photon_verify_recover",
        description="Photon verification and recovery of lost joins",
        schedule=timedelta(minutes=5),
        max_active_runs=1,
        tags=["photon", "registry", "verify"],
        default_args=retries(),
        params={
            "grace_s": Param(600, type="integer", minimum=0, description="Idle seconds before a pipeline is gone."),
            "dry_run": Param(False, type="boolean", description="Report only; change nothing."),
        },
    ) as dag:

        @task(task_id="verify_and_recover")
        def verify(logs: str, out: str, **context: Any) -> dict[str, Any]:
            from photon.airflow.hooks import IdRegistryHook, ObjectStoreHook
            from photon.recovery.verify import verify_and_recover

            p = context["params"]
            store = ObjectStoreHook()
            report = verify_and_recover(
                IdRegistryHook(component="verifier").servers(),
                store.open(out),  # a folder or an s3:// URL (credentials from photon_storage, else the
                store.open(logs),  # worker's environment)
                grace_s=float(p["grace_s"]),
                dry_run=bool(p["dry_run"]),
            )
            return report.to_dict()

        verify(LOGS, OUT)
    return dag


def reshard_dag() -> DAG:
    """Manual: plan a new shard configuration effective ``lead_s`` from now, wait for every live joiner to
    acknowledge it, then activate it; the task fails (and the plan is aborted) if they do not in time."""
    with _dag(
        dag_id="photon_reshard",
        description="Photon resharding: a new shard configuration, acknowledged by the joiners",
        schedule=None,
        max_active_runs=1,
        tags=["photon", "registry", "reshard"],
        default_args={"retries": 0},
        params={
            "num_shards": Param(8, type="integer", minimum=1, maximum=4096, description="Shards of the new config."),
            "placement": Param(
                ["main"], type="array", items={"type": "string"}, description="Servers, shards round-robin."
            ),
            "lead_s": Param(120, type="integer", minimum=1, description="Seconds until the new config takes effect."),
            "max_clock_skew_s": Param(clock_skew_s(), type="number", minimum=0),
            "grace_s": Param(
                60, type="integer", minimum=1, description="A joiner that committed this recently is live."
            ),
        },
    ) as dag:

        @task(task_id="reshard")
        def run(**context: Any) -> dict[str, Any]:
            from airflow.sdk.exceptions import AirflowFailException

            from photon.airflow.hooks import IdRegistryHook
            from photon.registry.reshard import reshard

            p = context["params"]
            report = reshard(
                IdRegistryHook(component="reshard").servers(),
                num_shards=int(p["num_shards"]),
                placement=list(p["placement"]),
                lead_s=float(p["lead_s"]),
                max_clock_skew_s=float(p["max_clock_skew_s"]),
                grace_s=float(p["grace_s"]),
            )
            context["ti"].xcom_push(key="report", value=report.to_dict())
            if report.state != "active":
                raise AirflowFailException(f"reshard to v{report.version} aborted: {report.reason}")
            return report.to_dict()

        run()
    return dag

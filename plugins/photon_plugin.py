"""The project's Airflow plugin: registers ``BackfillOnlyTimetable`` so that the DAGs using it can be serialised and
read back. Airflow's plugin manager imports the files of its plugins folder (``AIRFLOW__CORE__PLUGINS_FOLDER``, this
repository's ``plugins/``; ``.airflowignore`` keeps it out of ``photon/``, which is imported as a package). The
timetable comes from its package, so its registered import path is the one the DAGs use,
``photon.airflow.timetables.BackfillOnlyTimetable``."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from photon.airflow.timetables import BackfillOnlyTimetable


class PhotonPlugin(AirflowPlugin):
    name = "photon"
    timetables = [BackfillOnlyTimetable]  # noqa: RUF012  # Airflow's plugin API is a class attribute list

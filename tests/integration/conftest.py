"""Fixtures shared by the integration tests (a test module may define its own ``servers`` to reach the registry as
another role)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from photon.registry.admin import init_registry


@pytest.fixture
def servers(make_db: Callable[[], str], login_as: Callable[[str, str], str]) -> dict[str, str]:
    """A fresh registry, reached as the joiner runs in production: a login holding only photon_joiner."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=4)
    return {"main": login_as(dsn, "photon_joiner")}

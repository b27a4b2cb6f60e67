"""Owners and tokens: who registered an id, so the verifier can later tell whether that owner is gone.

An owner record (a joiner process or lease of one pipeline) lives on the registry's main server. A token is
``owner_id << 32 | batch_seq``: one bigint per registry row that names both the owner and its batch.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Any

from photon.pg import across_failover, autocommit

MAX_OWNER_ID = 2**31 - 1
MAX_BATCH_SEQ = 2**32 - 1


@dataclass(frozen=True)
class Token:
    owner_id: int
    batch_seq: int

    def __post_init__(self) -> None:
        if not 0 < self.owner_id <= MAX_OWNER_ID:
            raise ValueError(f"owner_id must be in 1..{MAX_OWNER_ID}, got {self.owner_id}")
        if not 0 <= self.batch_seq <= MAX_BATCH_SEQ:
            raise ValueError(f"batch_seq must be in 0..{MAX_BATCH_SEQ}, got {self.batch_seq}")

    @property
    def value(self) -> int:
        return (self.owner_id << 32) | self.batch_seq

    @classmethod
    def from_value(cls, value: int) -> Token:
        return cls(value >> 32, value & 0xFFFFFFFF)

    def __str__(self) -> str:
        return f"{self.owner_id}:{self.batch_seq}"


@dataclass(frozen=True)
class Owner:
    owner_id: int
    pipeline: str

    def token(self, batch_seq: int) -> Token:
        return Token(self.owner_id, batch_seq)


def create_owner(main_dsn: str, pipeline: str, info: dict[str, Any] | None = None) -> Owner:
    if not pipeline or len(pipeline) > 64:
        raise ValueError("pipeline name must be 1..64 characters")

    def insert() -> Owner:
        with autocommit(main_dsn, application_name=f"photon-{pipeline}") as conn, conn.cursor() as cur:
            cur.execute(
                "INSERT INTO photon.owners (pipeline, host, pid, info) VALUES (%s, %s, %s, %s) RETURNING owner_id",
                (pipeline, socket.gethostname(), os.getpid(), json.dumps(info or {})),
            )
            return Owner(int(cur.fetchone()[0]), pipeline)

    # Again after a failover: an insert whose answer was lost leaves an owner nobody was told of, so no token names
    # it and the verifier never has anything of it to judge.
    return across_failover(insert)


def end_owner(main_dsn: str, owner_id: int) -> None:
    def update() -> None:
        with autocommit(main_dsn) as conn, conn.cursor() as cur:
            cur.execute(
                "UPDATE photon.owners SET ended_at = now() WHERE owner_id = %s AND ended_at IS NULL", (owner_id,)
            )

    across_failover(update)  # again after a failover: it sets ended_at only where none is set yet

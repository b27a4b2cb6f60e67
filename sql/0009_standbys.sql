-- Standby joiners announce themselves while they start and while they wait for their turn, so the lease before them
-- hands over only to one that is ready: a lease whose term is over keeps joining, for a bounded time, while a
-- standby is still starting its Spark session (photon/pipeline_state.py). One row per standby process, refreshed
-- every second; a row not refreshed for a few seconds is a standby that died, and counts for nothing.
CREATE TABLE photon.standbys (
    pipeline text NOT NULL CHECK (pipeline ~ '^[a-z][a-z0-9_-]{0,30}$'),  -- no reference: a standby may come first
    holder   text NOT NULL,                                               -- host:pid, as lease_owner names a lease
    phase    text NOT NULL CHECK (phase IN ('starting', 'ready')),
    seen_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, holder)
);

GRANT SELECT, INSERT, UPDATE (phase, seen_at), DELETE ON photon.standbys TO photon_joiner;
GRANT SELECT ON photon.standbys TO photon_verifier, photon_gc;

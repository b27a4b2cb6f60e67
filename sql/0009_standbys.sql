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

-- Written only through these two functions: the time is the server's (a row cannot be dated ahead to outlive its
-- process), and the joiner holds no table privilege that could lock the table (UPDATE or DELETE would let any
-- joiner session take an ACCESS EXCLUSIVE lock and stall every pipeline's hand-over).
CREATE FUNCTION photon.announce_standby(p_pipeline text, p_holder text, p_phase text) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, photon AS $$
    INSERT INTO photon.standbys (pipeline, holder, phase, seen_at) VALUES (p_pipeline, p_holder, p_phase, now())
    ON CONFLICT (pipeline, holder) DO UPDATE SET phase = excluded.phase, seen_at = now();
$$;

-- A standby that took over or gave up; rows of standbys gone for an hour go too.
CREATE FUNCTION photon.withdraw_standby(p_pipeline text, p_holder text) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, photon AS $$
    DELETE FROM photon.standbys
     WHERE pipeline = p_pipeline AND (holder = p_holder OR seen_at < now() - interval '1 hour');
$$;

REVOKE ALL ON FUNCTION photon.announce_standby(text, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION photon.withdraw_standby(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION photon.announce_standby(text, text, text) TO photon_joiner;
GRANT EXECUTE ON FUNCTION photon.withdraw_standby(text, text) TO photon_joiner;
GRANT SELECT ON photon.standbys TO photon_joiner;

-- photon.standbys is written only through these two functions (0009 granted the joiner table-wide INSERT, UPDATE and
-- DELETE): the time is the server's (a row cannot be dated ahead to outlive its process), and the joiner keeps only
-- SELECT, which cannot lock the table in a mode that blocks writes (UPDATE or DELETE would let any joiner session
-- take an ACCESS EXCLUSIVE lock and stall every pipeline's hand-over). The verifier and GC never read it.
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

DELETE FROM photon.standbys WHERE seen_at > now();  -- rows dated ahead under 0009's grants
ALTER TABLE photon.standbys ADD CHECK (length(holder) <= 255);

REVOKE INSERT, UPDATE, DELETE ON photon.standbys FROM photon_joiner;
REVOKE UPDATE (phase, seen_at) ON photon.standbys FROM photon_joiner;
REVOKE SELECT ON photon.standbys FROM photon_verifier, photon_gc;
REVOKE ALL ON FUNCTION photon.announce_standby(text, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION photon.withdraw_standby(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION photon.announce_standby(text, text, text) TO photon_joiner;
GRANT EXECUTE ON FUNCTION photon.withdraw_standby(text, text) TO photon_joiner;

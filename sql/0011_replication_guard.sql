-- The replication guard (photon/pg.py, check_replication) must see which standbys stream in sync or quorum state
-- before a component writes. pg_stat_replication shows sync_state only to superusers and holders of
-- pg_read_all_stats; the components' roles hold neither and should not (pg_read_all_stats reads every session's
-- queries). This function, owned by the admin who runs `photon registry init`, shows the three columns the guard
-- needs and nothing else. If that admin is not a superuser it must hold pg_monitor (or pg_read_all_stats) itself,
-- or every row reads NULL and the guard refuses.
CREATE FUNCTION photon.replication_standbys()
RETURNS TABLE (application_name text, state text, sync_state text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog AS $$
    SELECT application_name::text, state::text, sync_state::text FROM pg_catalog.pg_stat_replication;
$$;

REVOKE ALL ON FUNCTION photon.replication_standbys() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION photon.replication_standbys() TO photon_joiner, photon_gc, photon_verifier, photon_reshard;

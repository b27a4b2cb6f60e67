-- Resharding as a least-privilege role (photon_reshard), and the server-side rules that keep a reshard exactly once
-- on bad days: a configuration version is taken once, on main; one plan at a time; each server enforces a new layout
-- only before the plan's deadline by its own clock; a plan's tables are dropped only while it is planned on that
-- server and they are empty, never an active configuration's. The role changes configurations only through these
-- SECURITY DEFINER functions: it owns no table and may not write shard_config, shard_map or layout_enforced.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'photon_reshard') THEN
        BEGIN
            CREATE ROLE photon_reshard NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;  -- another database of this cluster created it at the same moment
        END;
    END IF;
END $$;

-- The activation deadline of a plan (valid_from - max clock skew), checked by each server against its own clock.
ALTER TABLE photon.shard_config ADD COLUMN activate_by_us bigint;

-- This server's clock in epoch microseconds: deadlines and GC thresholds are measured by the registry's clocks, not
-- by the clock of whichever host runs the job.
CREATE FUNCTION photon.clock_us() RETURNS bigint
LANGUAGE sql VOLATILE AS $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint $$;

-- Main only: take the next configuration version for a plan. The table lock serialises planners (a second one
-- waits, then sees the first plan and is refused), and the INSERT has no ON CONFLICT: a version is taken once.
CREATE FUNCTION photon.take_config_version(p_valid_from bigint, p_num_shards integer, p_activate_by bigint)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, photon AS $$
DECLARE
    v     integer;
    other integer;
BEGIN
    LOCK TABLE photon.shard_config IN SHARE ROW EXCLUSIVE MODE;
    SELECT version INTO other FROM photon.shard_config WHERE state = 'planned' ORDER BY version LIMIT 1;
    IF other IS NOT NULL THEN
        RAISE EXCEPTION 'shard configuration v% is already planned: one reshard at a time', other
            USING ERRCODE = 'PH002';
    END IF;
    IF p_activate_by >= p_valid_from OR p_activate_by <= photon.clock_us() THEN
        RAISE EXCEPTION 'activation deadline % must lie after this server''s clock and before valid_from %',
            p_activate_by, p_valid_from USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT 1 FROM photon.shard_config WHERE state = 'active' AND valid_from_us >= p_valid_from) THEN
        RAISE EXCEPTION 'valid_from % is not after every active configuration''s', p_valid_from
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT coalesce(max(version), 0) + 1 INTO v FROM photon.shard_config;
    INSERT INTO photon.shard_config (version, valid_from_us, num_shards, state, activate_by_us)
    VALUES (v, p_valid_from, p_num_shards, 'planned', p_activate_by);
    RETURN v;
END $$;

-- Every other server: record the plan main numbered, and its shard map. Idempotent; refuses a different row.
CREATE FUNCTION photon.copy_plan(p_version integer, p_valid_from bigint, p_num_shards integer, p_activate_by bigint,
                                 p_servers text[])
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, photon AS $$
DECLARE
    i integer;
BEGIN
    INSERT INTO photon.shard_config (version, valid_from_us, num_shards, state, activate_by_us)
    VALUES (p_version, p_valid_from, p_num_shards, 'planned', p_activate_by) ON CONFLICT (version) DO NOTHING;
    IF NOT EXISTS (SELECT 1 FROM photon.shard_config WHERE version = p_version AND valid_from_us = p_valid_from
                      AND num_shards = p_num_shards AND state = 'planned' AND activate_by_us = p_activate_by) THEN
        RAISE EXCEPTION 'this server holds a different or no longer planned shard configuration v%', p_version
            USING ERRCODE = 'PH003';
    END IF;
    IF coalesce(array_length(p_servers, 1), 0) <> p_num_shards THEN
        RAISE EXCEPTION 'a plan of % shards needs % servers in its map', p_num_shards, p_num_shards
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR i IN 0 .. p_num_shards - 1 LOOP
        INSERT INTO photon.shard_map (config_version, shard_no, server) VALUES (p_version, i, p_servers[i + 1])
        ON CONFLICT DO NOTHING;
    END LOOP;
    IF (SELECT count(*) FROM photon.shard_map m WHERE m.config_version = p_version
          AND m.server = p_servers[m.shard_no + 1]) <> p_num_shards THEN
        RAISE EXCEPTION 'this server holds a different shard map for v%', p_version USING ERRCODE = 'PH003';
    END IF;
END $$;

-- Enforce layout p_version on this server, before the plan's deadline by this server's clock. The table lock waits
-- (lock_timeout) for the register transactions in flight, which hold the row FOR SHARE, and queues new ones behind
-- it: a waiting row lock can be overtaken by new FOR SHARE lockers for ever, a table lock is granted in order.
-- With p_activate the configuration is also marked active here, in the same transaction (on main: activation).
-- A server that already enforces p_version did so in time (this function is the only writer): then only the mark.
-- Returns this server's clock at the check.
CREATE FUNCTION photon.enforce_layout(p_version integer, p_activate boolean) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, photon AS $$
DECLARE
    st  text;
    dl  bigint;
    cur integer;
    t   bigint;
BEGIN
    SELECT state, activate_by_us INTO st, dl FROM photon.shard_config WHERE version = p_version FOR UPDATE;
    IF st IS NULL OR st = 'aborted' THEN
        RAISE EXCEPTION 'shard configuration v% is % on this server', p_version, coalesce(st, 'missing')
            USING ERRCODE = 'PH003';
    END IF;
    LOCK TABLE photon.layout_enforced IN EXCLUSIVE MODE;
    SELECT version INTO cur FROM photon.layout_enforced;
    t := photon.clock_us();
    IF cur < p_version THEN
        IF dl IS NULL OR t >= dl THEN
            RAISE EXCEPTION 'too late to enforce v%: this server''s clock (% us) is past the deadline (% us)',
                p_version, t, dl USING ERRCODE = 'PH001';
        END IF;
        UPDATE photon.layout_enforced SET version = p_version;
    END IF;
    IF p_activate AND st = 'planned' THEN
        UPDATE photon.shard_config SET state = 'active' WHERE version = p_version;
    END IF;
    RETURN t;
END $$;

-- Remove plan p_version from this server: only while it is planned here (row locked), never an active
-- configuration. Withdraws this server's enforcement of it, back to the newest version active before it (p_back_to,
-- as main names it, never lower than this server's own record), and drops the plan's shard tables, each only if
-- empty: routing never used a plan. The row stays, aborted, so a version is never reused. Returns tables dropped.
CREATE FUNCTION photon.abort_plan(p_version integer, p_back_to integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, photon AS $$
DECLARE
    st      text;
    cur     integer;
    back_to integer;
    r       record;
    n       integer;
    dropped integer := 0;
BEGIN
    SELECT state INTO st FROM photon.shard_config WHERE version = p_version FOR UPDATE;
    IF st IS NULL THEN
        RETURN 0;  -- the plan never reached this server
    END IF;
    IF st = 'active' THEN
        RAISE EXCEPTION 'shard configuration v% is active: it is never aborted and its tables stay', p_version
            USING ERRCODE = 'PH003';
    END IF;
    SELECT greatest(coalesce(max(version), 0), least(p_back_to, p_version - 1)) INTO back_to
      FROM photon.shard_config WHERE state = 'active' AND version < p_version;
    -- Only enforce_layout raises the version, and it holds this row lock too: no lock on the layout table is
    -- needed unless there is something to withdraw (writers in flight are not waited for otherwise).
    SELECT version INTO cur FROM photon.layout_enforced;
    IF cur > p_version THEN
        RAISE EXCEPTION 'this server enforces v%, newer than plan v%', cur, p_version USING ERRCODE = 'PH003';
    END IF;
    IF cur = p_version THEN
        LOCK TABLE photon.layout_enforced IN EXCLUSIVE MODE;
        UPDATE photon.layout_enforced SET version = back_to;
    END IF;
    UPDATE photon.shard_config SET state = 'aborted' WHERE version = p_version;
    FOR r IN SELECT shard_no, table_name FROM photon.shard_state WHERE config_version = p_version LOOP
        IF to_regclass(format('photon.%I', r.table_name)) IS NOT NULL THEN
            EXECUTE format('LOCK TABLE photon.%I IN ACCESS EXCLUSIVE MODE', r.table_name);
            EXECUTE format('SELECT count(*) FROM (SELECT 1 FROM photon.%I LIMIT 1) x', r.table_name) INTO n;
            IF n > 0 THEN
                RAISE EXCEPTION 'plan v% shard % holds rows: a plan is never routed to, so nothing is dropped',
                    p_version, r.shard_no USING ERRCODE = 'PH003';
            END IF;
            EXECUTE format('DROP TABLE photon.%I', r.table_name);
        END IF;
        DELETE FROM photon.shard_state WHERE config_version = p_version AND shard_no = r.shard_no;
        dropped := dropped + 1;
    END LOOP;
    DELETE FROM photon.shard_map WHERE config_version = p_version;
    RETURN dropped;
END $$;

REVOKE ALL ON FUNCTION photon.take_config_version(bigint, integer, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION photon.copy_plan(integer, bigint, integer, bigint, text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION photon.enforce_layout(integer, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION photon.abort_plan(integer, integer) FROM PUBLIC;

GRANT USAGE ON SCHEMA photon TO photon_reshard;
GRANT SELECT ON photon.registry_meta, photon.shard_config, photon.shard_map, photon.shard_state,
    photon.layout_enforced TO photon_reshard;
-- Acknowledgements: which pipelines are live and which configuration each reports.
GRANT SELECT (pipeline, heartbeat_at, config_version) ON photon.pipelines TO photon_reshard;
GRANT EXECUTE ON FUNCTION photon.take_config_version(bigint, integer, bigint), photon.create_shard(integer, integer),
    photon.copy_plan(integer, bigint, integer, bigint, text[]), photon.enforce_layout(integer, boolean),
    photon.abort_plan(integer, integer) TO photon_reshard;

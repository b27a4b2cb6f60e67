-- The IdRegistry: shard configuration, shard map, per-shard state, owners, and the functions that create shards
-- and partitions. Applied to every registry server by `photon registry init`; the shard configuration and map are
-- written to every server (so each can check writes against them), shard tables only to the server hosting them.

DO $$
DECLARE r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['photon_joiner', 'photon_gc', 'photon_verifier'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- another database of this cluster created it at the same moment
            END;
        END IF;
    END LOOP;
END $$;

CREATE TABLE photon.registry_meta (
    key   text PRIMARY KEY,
    value text NOT NULL
);
-- Width of the time partitions of every shard table; GC drops whole partitions.
INSERT INTO photon.registry_meta VALUES ('partition_width_us', '3600000000');

CREATE TABLE photon.shard_config (
    version       integer PRIMARY KEY CHECK (version > 0),
    valid_from_us bigint  NOT NULL CHECK (valid_from_us >= 0),
    num_shards    integer NOT NULL CHECK (num_shards BETWEEN 1 AND 4096),
    state         text    NOT NULL DEFAULT 'active' CHECK (state IN ('planned', 'active', 'aborted')),
    created_at    timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX shard_config_active_from ON photon.shard_config (valid_from_us) WHERE state = 'active';

CREATE TABLE photon.shard_map (
    config_version integer NOT NULL REFERENCES photon.shard_config (version),
    shard_no       integer NOT NULL CHECK (shard_no >= 0),
    server         text    NOT NULL CHECK (server ~ '^[a-z][a-z0-9_]{0,30}$'),
    PRIMARY KEY (config_version, shard_no)
);

-- Shards hosted on this server. The GC threshold lives beside the rows it guards, so that a register transaction
-- can read it (FOR SHARE) in the same transaction that inserts.
CREATE TABLE photon.shard_state (
    config_version  integer NOT NULL,
    shard_no        integer NOT NULL,
    table_name      text    NOT NULL UNIQUE CHECK (table_name ~ '^ids_c[1-9][0-9]{0,8}_s(0|[1-9][0-9]{0,4})$'),
    gc_threshold_us bigint  NOT NULL DEFAULT 0,
    gc_updated_at   timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (config_version, shard_no),
    FOREIGN KEY (config_version, shard_no) REFERENCES photon.shard_map (config_version, shard_no)
);

-- A GC threshold never goes back, whoever writes it.
CREATE FUNCTION photon.shard_state_monotonic() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.gc_threshold_us < OLD.gc_threshold_us THEN
        RAISE EXCEPTION 'GC threshold of %/% cannot go back from % to %',
            OLD.config_version, OLD.shard_no, OLD.gc_threshold_us, NEW.gc_threshold_us
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER shard_state_monotonic BEFORE UPDATE ON photon.shard_state
    FOR EACH ROW EXECUTE FUNCTION photon.shard_state_monotonic();

-- Owner records: a token names (owner, batch) so the verifier can later decide whether the owner is gone.
CREATE TABLE photon.owners (
    owner_id     bigserial PRIMARY KEY CHECK (owner_id < 2147483648),
    pipeline     text NOT NULL,
    host         text NOT NULL,
    pid          integer NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    ended_at     timestamptz,
    info         jsonb NOT NULL DEFAULT '{}'
);

CREATE FUNCTION photon.create_shard(p_version integer, p_shard integer) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, photon AS $$
DECLARE
    t text := format('ids_c%s_s%s', p_version, p_shard);
BEGIN
    -- ts_us first: keys arrive roughly in time order, so inserts append to the right edge of the index.
    EXECUTE format('CREATE TABLE IF NOT EXISTS photon.%I ('
                   'ts_us bigint NOT NULL, src bigint NOT NULL, token bigint, '
                   'PRIMARY KEY (ts_us, src)) PARTITION BY RANGE (ts_us)', t);
    INSERT INTO photon.shard_state (config_version, shard_no, table_name)
    VALUES (p_version, p_shard, t) ON CONFLICT DO NOTHING;
    EXECUTE format('GRANT SELECT, INSERT ON photon.%I TO photon_joiner', t);
    EXECUTE format('GRANT SELECT, DELETE ON photon.%I TO photon_gc', t);
    EXECUTE format('GRANT SELECT, DELETE, UPDATE (token) ON photon.%I TO photon_verifier', t);
    RETURN t;
END $$;

-- Creates the missing partitions [start, start + width) of one shard for the given aligned starts, skipping those
-- wholly below the shard's GC threshold (nothing may be written there any more). Returns how many it created.
CREATE FUNCTION photon.ensure_partitions(p_version integer, p_shard integer, p_starts bigint[]) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, photon AS $$
DECLARE
    t     text;
    thr   bigint;
    w     bigint;
    s     bigint;
    part  text;
    made  integer := 0;
BEGIN
    SELECT table_name, gc_threshold_us INTO t, thr
      FROM photon.shard_state WHERE config_version = p_version AND shard_no = p_shard;
    IF t IS NULL THEN
        RAISE EXCEPTION 'shard %/% is not hosted on this server', p_version, p_shard
            USING ERRCODE = 'undefined_table';
    END IF;
    SELECT value::bigint INTO w FROM photon.registry_meta WHERE key = 'partition_width_us';
    PERFORM pg_advisory_xact_lock(hashtext('photon.partitions.' || t));
    FOREACH s IN ARRAY p_starts LOOP
        IF s % w <> 0 OR s < 0 THEN
            RAISE EXCEPTION 'partition start % is not aligned to %', s, w USING ERRCODE = 'invalid_parameter_value';
        END IF;
        CONTINUE WHEN s + w <= thr;
        part := format('%s_p%s', t, s / 1000000);
        IF to_regclass(format('photon.%I', part)) IS NULL THEN
            EXECUTE format('CREATE TABLE photon.%I PARTITION OF photon.%I FOR VALUES FROM (%s) TO (%s)',
                           part, t, s, s + w);
            made := made + 1;
        END IF;
    END LOOP;
    RETURN made;
END $$;

REVOKE ALL ON FUNCTION photon.create_shard(integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION photon.ensure_partitions(integer, integer, bigint[]) FROM PUBLIC;

GRANT USAGE ON SCHEMA photon TO photon_joiner, photon_gc, photon_verifier;
GRANT SELECT ON photon.registry_meta, photon.shard_config, photon.shard_map, photon.shard_state
    TO photon_joiner, photon_gc, photon_verifier;
GRANT EXECUTE ON FUNCTION photon.ensure_partitions(integer, integer, bigint[]) TO photon_joiner;
-- Joiners lock the state row FOR SHARE while they insert, which needs UPDATE privilege on some column.
GRANT UPDATE (gc_updated_at) ON photon.shard_state TO photon_joiner;
GRANT UPDATE (gc_threshold_us, gc_updated_at) ON photon.shard_state TO photon_gc;
GRANT SELECT, INSERT ON photon.owners TO photon_joiner;
GRANT UPDATE (heartbeat_at, ended_at, info) ON photon.owners TO photon_joiner;
GRANT USAGE ON SEQUENCE photon.owners_owner_id_seq TO photon_joiner;
GRANT SELECT ON photon.owners TO photon_gc, photon_verifier;

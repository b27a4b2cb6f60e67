-- Garbage collection: the time partitions of a shard that lie wholly below its GC threshold, and dropping them.
-- SECURITY DEFINER, like ensure_partitions: the GC role deletes rows but owns no tables.

-- Partitions of one shard whose whole range ends at or before p_below, with their bytes (read-only: a dry run
-- passes the threshold it would set).
CREATE FUNCTION photon.expired_partitions(p_version integer, p_shard integer, p_below bigint)
RETURNS TABLE (partition_name text, range_start_us bigint, range_end_us bigint, bytes bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, photon AS $$
DECLARE
    t text;
    w bigint;
BEGIN
    SELECT table_name INTO t FROM photon.shard_state WHERE config_version = p_version AND shard_no = p_shard;
    IF t IS NULL THEN
        RAISE EXCEPTION 'shard %/% is not hosted on this server', p_version, p_shard USING ERRCODE = 'undefined_table';
    END IF;
    SELECT value::bigint INTO w FROM photon.registry_meta WHERE key = 'partition_width_us';
    RETURN QUERY
        SELECT c.relname::text, s.start_us, s.start_us + w, pg_total_relation_size(c.oid)
          FROM pg_inherits i
          JOIN pg_class c ON c.oid = i.inhrelid
          CROSS JOIN LATERAL (SELECT (substring(c.relname FROM '_p([0-9]+)$'))::bigint * 1000000 AS start_us) s
         WHERE i.inhparent = to_regclass(format('photon.%I', t)) AND s.start_us + w <= p_below
         ORDER BY s.start_us;
END $$;

-- Drops one partition of a shard if it lies wholly below the shard's threshold now in force (re-checked under the
-- threshold row's lock, so a concurrent register transaction, which holds it FOR SHARE, finishes first). Returns
-- the rows it held, or -1 if it was not dropped (not below the threshold, or already gone).
CREATE FUNCTION photon.drop_expired_partition(p_version integer, p_shard integer, p_partition text)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, photon AS $$
DECLARE
    t    text;
    thr  bigint;
    w    bigint;
    s    bigint;
    n    bigint;
BEGIN
    SELECT table_name, gc_threshold_us INTO t, thr
      FROM photon.shard_state WHERE config_version = p_version AND shard_no = p_shard FOR UPDATE;
    IF t IS NULL THEN
        RAISE EXCEPTION 'shard %/% is not hosted on this server', p_version, p_shard USING ERRCODE = 'undefined_table';
    END IF;
    IF p_partition !~ ('^' || t || '_p[0-9]+$') THEN
        RAISE EXCEPTION '% is not a partition of %', p_partition, t USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT value::bigint INTO w FROM photon.registry_meta WHERE key = 'partition_width_us';
    s := (substring(p_partition FROM '_p([0-9]+)$'))::bigint * 1000000;
    IF s + w > thr OR to_regclass(format('photon.%I', p_partition)) IS NULL THEN
        RETURN -1;
    END IF;
    EXECUTE format('SELECT count(*) FROM photon.%I', p_partition) INTO n;
    EXECUTE format('DROP TABLE photon.%I', p_partition);
    RETURN n;
END $$;

REVOKE ALL ON FUNCTION photon.expired_partitions(integer, integer, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION photon.drop_expired_partition(integer, integer, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION photon.expired_partitions(integer, integer, bigint) TO photon_gc;
GRANT EXECUTE ON FUNCTION photon.drop_expired_partition(integer, integer, text) TO photon_gc;

-- Shard sizes over time (main server): recorded by every GC run and on demand, drawn by `photon report`.
CREATE TABLE photon.shard_history (
    at_us           bigint  NOT NULL,
    config_version  integer NOT NULL,
    shard_no        integer NOT NULL,
    server          text    NOT NULL,
    rows            bigint  NOT NULL,
    bytes           bigint  NOT NULL,
    gc_threshold_us bigint  NOT NULL,
    event           text    NOT NULL,   -- 'gc', 'sample', ...
    PRIMARY KEY (at_us, config_version, shard_no)
);
GRANT SELECT, INSERT ON photon.shard_history TO photon_gc;
GRANT SELECT ON photon.shard_history TO photon_verifier;

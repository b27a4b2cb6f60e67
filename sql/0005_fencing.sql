-- Verification that is safe by construction (see photon/verify.py): an owner record retires when the verifier
-- fences its pipeline, each committed batch names the owner that committed it, and a pipeline only ever moves
-- forward, whoever writes it.

-- A retired owner can never commit again: its tokens on batches it did not commit are dead for good.
ALTER TABLE photon.owners ADD COLUMN retired_at timestamptz;
ALTER TABLE photon.owners ADD COLUMN final_batch bigint;  -- the pipeline's last committed batch when it retired

ALTER TABLE photon.batches ADD COLUMN owner_id bigint REFERENCES photon.owners (owner_id);
UPDATE photon.batches b SET owner_id = p.owner_id FROM photon.pipelines p WHERE p.pipeline = b.pipeline;
ALTER TABLE photon.batches ALTER COLUMN owner_id SET NOT NULL;

-- Forward only: an epoch never goes back, a batch commits one step at a time, the owner changes only with a new
-- epoch (a fence), a published batch stays published. Enforced for every role, the owner's included.
CREATE FUNCTION photon.pipelines_forward_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.pipeline <> OLD.pipeline THEN
        RAISE EXCEPTION 'pipeline % cannot be renamed', OLD.pipeline USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.epoch < OLD.epoch THEN
        RAISE EXCEPTION 'pipeline %: epoch cannot go back from % to %', OLD.pipeline, OLD.epoch, NEW.epoch
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.last_batch <> OLD.last_batch AND (NEW.last_batch <> OLD.last_batch + 1 OR NEW.epoch <> OLD.epoch) THEN
        RAISE EXCEPTION 'pipeline %: last batch can only move from % to % under the same epoch',
            OLD.pipeline, OLD.last_batch, OLD.last_batch + 1 USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.owner_id <> OLD.owner_id AND NEW.epoch = OLD.epoch THEN
        RAISE EXCEPTION 'pipeline %: the owner changes only with a new epoch', OLD.pipeline
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.config_version < OLD.config_version THEN
        RAISE EXCEPTION 'pipeline %: acknowledged configuration cannot go back', OLD.pipeline
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER pipelines_forward_only BEFORE UPDATE ON photon.pipelines
    FOR EACH ROW EXECUTE FUNCTION photon.pipelines_forward_only();

CREATE FUNCTION photon.batches_forward_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF (NEW.pipeline, NEW.batch_seq, NEW.epoch, NEW.owner_id, NEW.committed_at)
       IS DISTINCT FROM (OLD.pipeline, OLD.batch_seq, OLD.epoch, OLD.owner_id, OLD.committed_at)
       OR (OLD.published AND NOT NEW.published) THEN
        RAISE EXCEPTION 'batch %/% is committed: only its publication can be recorded', OLD.pipeline, OLD.batch_seq
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER batches_forward_only BEFORE UPDATE ON photon.batches
    FOR EACH ROW EXECUTE FUNCTION photon.batches_forward_only();

-- Fence a pipeline that has shown no sign of life (commit or heartbeat) for p_grace_s, by the server's clock, and
-- only if it still holds the epoch and last batch the verifier saw: bump the epoch (a zombie's commit is refused
-- from then on), give the pipeline a new owner (a later lease registers under new tokens), and retire the old
-- owner at its last committed batch. Returns one row (new epoch, old owner, new owner), or none if nothing was
-- fenced (the pipeline moved, or is alive).
CREATE FUNCTION photon.fence_pipeline(p_pipeline text, p_epoch bigint, p_last_batch bigint,
                                      p_grace_s double precision)
RETURNS TABLE (new_epoch bigint, old_owner bigint, new_owner bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, photon AS $$
DECLARE
    o bigint;
    n bigint;
    e bigint;
BEGIN
    SELECT p.owner_id INTO o FROM photon.pipelines p
     WHERE p.pipeline = p_pipeline AND p.epoch = p_epoch AND p.last_batch = p_last_batch
       AND coalesce(p.heartbeat_at, p.updated_at) < now() - make_interval(secs => p_grace_s)
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO photon.owners (pipeline, host, pid, info)
    VALUES (p_pipeline, 'fenced', 0, jsonb_build_object('kind', 'pipeline', 'after_fence_of', o))
    RETURNING owner_id INTO n;
    UPDATE photon.pipelines SET epoch = epoch + 1, owner_id = n, lease_owner = NULL, updated_at = now()
     WHERE pipeline = p_pipeline RETURNING epoch INTO e;
    UPDATE photon.owners SET retired_at = now(), final_batch = p_last_batch, ended_at = coalesce(ended_at, now())
     WHERE owner_id = o;
    RETURN QUERY SELECT e, o, n;
END $$;
REVOKE ALL ON FUNCTION photon.fence_pipeline(text, bigint, bigint, double precision) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION photon.fence_pipeline(text, bigint, bigint, double precision) TO photon_verifier;

-- Joiners move their pipeline forward through these columns only (the triggers above check the direction);
-- committed batches, consumed files and metrics are written once.
REVOKE UPDATE ON photon.pipelines, photon.batches, photon.consumed_files, photon.batch_metrics FROM photon_joiner;
GRANT UPDATE (epoch, lease_owner, lease_started_at, heartbeat_at, last_batch, updated_at, config_version)
    ON photon.pipelines TO photon_joiner;
GRANT UPDATE (published) ON photon.batches TO photon_joiner, photon_verifier;

-- Rows a joiner inserts must follow from a commit of its pipeline (the forward-only triggers of 0005 guard UPDATEs
-- only). A batch row is the commit that just moved its pipeline to that batch, under that epoch and owner, and is not
-- published yet; its metrics and consumed files belong to such a batch; a new pipeline starts at zero with a fresh
-- owner of its own name. Without these, one INSERT could make a live lease's batch look published without its rows
-- (the verifier would recover them while the lease still runs), or let two pipelines share an owner's tokens.

CREATE FUNCTION photon.batches_insert_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.published THEN
        RAISE EXCEPTION 'batch %/% is committed unpublished; publication is recorded afterwards',
            NEW.pipeline, NEW.batch_seq USING ERRCODE = 'check_violation';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM photon.pipelines p
                    WHERE p.pipeline = NEW.pipeline AND p.last_batch = NEW.batch_seq AND p.epoch = NEW.epoch
                      AND p.owner_id = NEW.owner_id) THEN
        RAISE EXCEPTION 'batch %/% does not follow its pipeline''s commit (last batch, epoch and owner)',
            NEW.pipeline, NEW.batch_seq USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER batches_insert_check BEFORE INSERT ON photon.batches
    FOR EACH ROW EXECUTE FUNCTION photon.batches_insert_check();

-- Metrics and consumed files are written by the commit that inserts the batch row, before it is published.
CREATE FUNCTION photon.batch_rows_insert_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM photon.batches b
                    WHERE b.pipeline = NEW.pipeline AND b.batch_seq = NEW.batch_seq AND NOT b.published) THEN
        RAISE EXCEPTION '%: batch %/% is not a batch being committed', TG_TABLE_NAME, NEW.pipeline, NEW.batch_seq
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER batch_metrics_insert_check BEFORE INSERT ON photon.batch_metrics
    FOR EACH ROW EXECUTE FUNCTION photon.batch_rows_insert_check();
CREATE TRIGGER consumed_files_insert_check BEFORE INSERT ON photon.consumed_files
    FOR EACH ROW EXECUTE FUNCTION photon.batch_rows_insert_check();

CREATE FUNCTION photon.pipelines_insert_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.epoch <> 0 OR NEW.last_batch <> 0 THEN
        RAISE EXCEPTION 'pipeline % starts at epoch 0, batch 0', NEW.pipeline USING ERRCODE = 'check_violation';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM photon.owners o
                    WHERE o.owner_id = NEW.owner_id AND o.pipeline = NEW.pipeline AND o.retired_at IS NULL)
       OR EXISTS (SELECT 1 FROM photon.pipelines p WHERE p.owner_id = NEW.owner_id) THEN
        RAISE EXCEPTION 'pipeline % needs a fresh owner record of its own name', NEW.pipeline
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER pipelines_insert_check BEFORE INSERT ON photon.pipelines
    FOR EACH ROW EXECUTE FUNCTION photon.pipelines_insert_check();

-- Where a live pipeline starts reading (README, "Where a live pipeline starts"): the start it was created with,
-- recorded once, in the transaction that creates the pipeline's row. Every later lease reads it, so a pipeline that
-- crashes before its first commit resumes from the same start, never from a later "now", and `photon status` can say
-- which history before it is left to backfills. NULL: the beginning of the logs (every file), as before this column.
ALTER TABLE photon.pipelines ADD COLUMN start_us bigint;

-- Set once: no role, the owner's included, moves a pipeline's start (a later start would leave the files between the
-- two starts to no one; an earlier one would take files a backfill may already own).
CREATE FUNCTION photon.pipelines_start_fixed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.start_us IS DISTINCT FROM OLD.start_us THEN
        RAISE EXCEPTION 'pipeline %: its start is recorded when it is created and never changes', OLD.pipeline
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER pipelines_start_fixed BEFORE UPDATE OF start_us ON photon.pipelines
    FOR EACH ROW EXECUTE FUNCTION photon.pipelines_start_fixed();
-- The joiner inserts the row (INSERT is table-wide since 0002) and may update only the columns 0005 granted: not this
-- one. Readers (GC, the verifier, `photon status`) have SELECT on the table already.

-- Log files are partitioned by arrival minute (docs/EVENTS.md). A consumed file records its partition, and each
-- batch records, per kind, the oldest partition its pipeline must still list: a lease lists and loads only from
-- there, so its cost does not grow with the files consumed before.
ALTER TABLE photon.consumed_files ADD COLUMN part text;  -- 'YYYYmmdd/HHMM'; NULL for a file directly in <kind>/
CREATE INDEX consumed_files_part ON photon.consumed_files (pipeline, kind, part);
ALTER TABLE photon.batches ADD COLUMN queries_from text;  -- NULL: list everything (a batch before partitions)
ALTER TABLE photon.batches ADD COLUMN clicks_from text;

-- Records of files in partitions no pipeline lists any more can go: GC drops those older than its horizon.
GRANT DELETE ON photon.consumed_files TO photon_gc;

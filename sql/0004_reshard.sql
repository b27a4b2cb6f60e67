-- Resharding: the layout version each server enforces, and the configuration version each pipeline runs with.

-- The newest shard configuration activated on this server (one row). A register transaction reads it FOR SHARE and
-- is refused when its client routes with an older layout, so a joiner still on an old configuration never writes
-- an id to the wrong shard; activation (an UPDATE) waits for the register transactions in flight. Locking a row
-- FOR SHARE needs an UPDATE privilege: joiners get it on touched_at only, a column nothing writes.
CREATE TABLE photon.layout_enforced (
    id         smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    version    integer  NOT NULL DEFAULT 0,
    touched_at timestamptz
);
INSERT INTO photon.layout_enforced DEFAULT VALUES;
GRANT SELECT, UPDATE (touched_at) ON photon.layout_enforced TO photon_joiner;
GRANT SELECT ON photon.layout_enforced TO photon_gc, photon_verifier;

-- Joiners report the newest configuration they know (Turbine's running state); a reshard waits for every live one.
ALTER TABLE photon.pipelines ADD COLUMN config_version integer NOT NULL DEFAULT 0;

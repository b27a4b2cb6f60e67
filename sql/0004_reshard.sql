-- Resharding: the layout version each server enforces, and the configuration version each pipeline runs with.

-- The newest shard configuration activated on this server. A register transaction reads it FOR SHARE and is refused
-- when its client routes with an older layout, so a joiner still on an old configuration never writes an id to the
-- wrong shard; activation (an UPDATE) waits for the register transactions in flight.
INSERT INTO photon.registry_meta (key, value) VALUES ('layout_version', '0') ON CONFLICT DO NOTHING;
GRANT UPDATE ON photon.registry_meta TO photon_gc;

-- Joiners report the newest configuration they know (Turbine's running state); a reshard waits for every live one.
ALTER TABLE photon.pipelines ADD COLUMN config_version integer NOT NULL DEFAULT 0;

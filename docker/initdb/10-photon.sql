-- The IdRegistry's database and owner on the registry's Patroni cluster (run once, as the superuser, by Patroni's
-- post_bootstrap on the first primary: patroni/post-bootstrap.sh). The owner `photon` runs only the migrations
-- (airflow-init); every component runs as its own login.
CREATE ROLE photon LOGIN PASSWORD 'photon';
CREATE DATABASE photon OWNER photon;
-- The replication guard's function (sql/0011) runs as the owner who creates it, and only pg_monitor's holders see
-- which standbys are in sync: without it the guard would refuse every component.
GRANT pg_monitor TO photon;

-- The components' NOLOGIN roles that the migrations grant to (sql/0001_registry.sql, sql/0006_reshard_role.sql).
-- The migrations create them only where missing, and the owner may not create roles: the superuser does it here.
CREATE ROLE photon_joiner NOLOGIN;    -- joiner leases and backfills: register ids, commit batches
CREATE ROLE photon_verifier NOLOGIN;  -- verify and recover: fence gone pipelines, delete or clear registry rows
CREATE ROLE photon_gc NOLOGIN;        -- registry GC: advance thresholds, drop expired partitions
CREATE ROLE photon_reshard NOLOGIN;   -- plan, activate and abort shard configurations

-- One login per component, holding only its role; Airflow's connections photon_registry_<component> use them
-- (compose.yaml). Demo passwords: change them (ALTER ROLE ... PASSWORD) together with the connections.
CREATE ROLE photon_joiner_login LOGIN PASSWORD 'photon-joiner' IN ROLE photon_joiner;
CREATE ROLE photon_verifier_login LOGIN PASSWORD 'photon-verifier' IN ROLE photon_verifier;
CREATE ROLE photon_gc_login LOGIN PASSWORD 'photon-gc' IN ROLE photon_gc;
CREATE ROLE photon_reshard_login LOGIN PASSWORD 'photon-reshard' IN ROLE photon_reshard;

-- Only the registry's roles reach the registry's database (Airflow's metadata is on a server of its own).
REVOKE CONNECT ON DATABASE photon FROM PUBLIC;
GRANT CONNECT ON DATABASE photon TO photon_joiner, photon_verifier, photon_gc, photon_reshard;

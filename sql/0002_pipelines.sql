-- Joiner pipelines: leases with fencing epochs, batch commits keyed by (pipeline, batch), consumed input files,
-- and per-batch metrics. Lives on the registry's main server.

CREATE TABLE photon.pipelines (
    pipeline     text PRIMARY KEY CHECK (pipeline ~ '^[a-z][a-z0-9_-]{0,30}$'),
    -- the owner record every token of this pipeline names: token = owner_id << 32 | batch_seq
    owner_id     bigint NOT NULL REFERENCES photon.owners (owner_id),
    epoch        bigint NOT NULL DEFAULT 0,   -- bumped by every lease; commits must carry the current one
    lease_owner  text,                        -- host:pid of the lease holding the epoch
    lease_started_at timestamptz,
    heartbeat_at timestamptz,
    last_batch   bigint NOT NULL DEFAULT 0,   -- last committed batch (0: none)
    updated_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE photon.batches (
    pipeline     text   NOT NULL REFERENCES photon.pipelines (pipeline),
    batch_seq    bigint NOT NULL CHECK (batch_seq > 0),
    epoch        bigint NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT now(),
    published    boolean NOT NULL DEFAULT false,  -- staged output moved into place
    PRIMARY KEY (pipeline, batch_seq)
);

CREATE TABLE photon.consumed_files (
    pipeline  text   NOT NULL REFERENCES photon.pipelines (pipeline),
    kind      text   NOT NULL CHECK (kind IN ('queries', 'clicks')),
    name      text   NOT NULL,
    batch_seq bigint NOT NULL,
    PRIMARY KEY (pipeline, kind, name)
);

CREATE TABLE photon.batch_metrics (
    pipeline            text   NOT NULL,
    batch_seq           bigint NOT NULL,
    epoch               bigint NOT NULL,
    started_at_us       bigint NOT NULL,
    duration_s          double precision NOT NULL,
    query_files         integer NOT NULL,
    click_files         integer NOT NULL,
    queries             bigint NOT NULL,
    clicks              bigint NOT NULL,
    retries_in          bigint NOT NULL,
    prefiltered         bigint NOT NULL,   -- dropped by the registry lookup before joining
    joined              bigint NOT NULL,   -- written to joined/
    won_again           bigint NOT NULL,
    wasted              bigint NOT NULL,   -- joined but lost to another pipeline at registration
    retried             bigint NOT NULL,   -- sent back to wait for their query
    unjoinable          bigint NOT NULL,
    quarantined         bigint NOT NULL,
    cache_hits          bigint NOT NULL,
    cache_lookups       bigint NOT NULL,
    registry_txns       bigint NOT NULL,
    registry_rows       bigint NOT NULL,
    registry_retries    bigint NOT NULL,
    latency_p50_s       double precision,
    latency_p90_s       double precision,
    latency_p99_s       double precision,
    PRIMARY KEY (pipeline, batch_seq)
);

GRANT SELECT, INSERT, UPDATE ON photon.pipelines, photon.batches, photon.consumed_files, photon.batch_metrics
    TO photon_joiner;
GRANT SELECT ON photon.pipelines, photon.batches, photon.consumed_files, photon.batch_metrics
    TO photon_gc, photon_verifier;

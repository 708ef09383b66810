-- Foundation schema: idempotency (inbox), reliable publishing (outbox), jobs and their
-- append-only history, placement's capacity book and reservations, and the metrics ledger.

CREATE TABLE inbox (
    consumer     text        NOT NULL,
    msg_id       text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, msg_id)
);

-- Messages a transaction decided to publish; written in the same transaction as the state change
-- and published afterwards (again after a crash), each with its deterministic id.
CREATE TABLE outbox (
    id           bigserial   PRIMARY KEY,
    producer     text        NOT NULL,
    msg_id       text        NOT NULL UNIQUE,
    subject      text        NOT NULL,
    payload      bytea       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz
);
CREATE INDEX outbox_pending ON outbox (producer, id) WHERE published_at IS NULL;

CREATE TABLE jobs (
    job_id       text        PRIMARY KEY,
    tenant       text        NOT NULL,
    state        text        NOT NULL CHECK (state IN
                   ('queued', 'placed', 'running', 'completed', 'failed', 'rejected', 'cancelled')),
    spec         jsonb       NOT NULL,
    cluster      text,
    attempt      integer     NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    reason       text,
    progress     real        NOT NULL DEFAULT 0 CHECK (progress >= 0 AND progress <= 1),
    submitted_at timestamptz NOT NULL,
    placed_at    timestamptz,
    finished_at  timestamptz,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    -- W3C trace context of the submission, so work done later (a queued job placed minutes
    -- after it arrived) continues the job's one trace.
    trace_context jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX jobs_by_tenant ON jobs (tenant, submitted_at);
CREATE INDEX jobs_by_state ON jobs (state);

CREATE TABLE job_events (
    id      bigserial   PRIMARY KEY,
    job_id  text        NOT NULL,
    kind    text        NOT NULL,
    msg_id  text        NOT NULL UNIQUE,
    event   jsonb       NOT NULL,
    at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX job_events_by_job ON job_events (job_id, id);

CREATE FUNCTION job_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'job_events is append-only';
END $$;
CREATE TRIGGER job_events_no_update BEFORE UPDATE OR DELETE ON job_events
    FOR EACH ROW EXECUTE FUNCTION job_events_append_only();

-- Placement's book of what each node has and how much of it is promised. Totals follow the
-- metrics view; gpus_reserved only moves through reservations, by conditional updates, so it is
-- never negative and never exceeds the total at the moment of reserving.
CREATE TABLE node_allocations (
    node          text    PRIMARY KEY,
    cluster       text    NOT NULL,
    region        text    NOT NULL,
    zone          text    NOT NULL,
    gpu_model     text,
    gpus_total    integer NOT NULL CHECK (gpus_total >= 0),
    gpus_reserved integer NOT NULL DEFAULT 0 CHECK (gpus_reserved >= 0),
    schedulable   boolean NOT NULL DEFAULT true,
    view_version  bigint  NOT NULL DEFAULT 0
);
CREATE INDEX node_allocations_by_cluster ON node_allocations (cluster);

CREATE TABLE reservations (
    job_id      text        NOT NULL,
    attempt     integer     NOT NULL CHECK (attempt >= 1),
    node        text        NOT NULL REFERENCES node_allocations (node),
    cluster     text        NOT NULL,
    gpus        integer     NOT NULL CHECK (gpus > 0),
    state       text        NOT NULL CHECK (state IN ('reserved', 'confirmed', 'released')),
    created_at  timestamptz NOT NULL DEFAULT now(),
    released_at timestamptz,
    PRIMARY KEY (job_id, attempt, node)
);
CREATE INDEX reservations_active ON reservations (job_id) WHERE state <> 'released';

-- The metrics ledger: region -> zone -> cluster -> node, each time-stamped.
CREATE TABLE ledger_clusters (
    cluster           text        PRIMARY KEY,
    region            text        NOT NULL,
    agent_epoch       bigint      NOT NULL DEFAULT 0,
    last_seq          bigint      NOT NULL DEFAULT 0,
    version           bigint      NOT NULL DEFAULT 0,
    interval_s        real        NOT NULL DEFAULT 5,
    last_heartbeat_at timestamptz,
    stale             boolean     NOT NULL DEFAULT false
);

CREATE TABLE ledger_nodes (
    node        text        PRIMARY KEY,
    cluster     text        NOT NULL REFERENCES ledger_clusters (cluster),
    region      text        NOT NULL,
    zone        text        NOT NULL,
    gpu_model   text,
    gpus_total  integer     NOT NULL CHECK (gpus_total >= 0),
    gpus_used   integer     NOT NULL CHECK (gpus_used >= 0),
    cpu_milli   integer     NOT NULL DEFAULT 0,
    memory_mib  bigint      NOT NULL DEFAULT 0,
    healthy     boolean     NOT NULL DEFAULT true,
    updated_at  timestamptz NOT NULL
);
CREATE INDEX ledger_nodes_by_cluster ON ledger_nodes (cluster);

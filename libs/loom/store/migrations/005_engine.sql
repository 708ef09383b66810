-- The placement engine (issue 5): DAG stages wait for their dependencies ('waiting'), a job remembers
-- its parent DAG job, the clusters its next attempt avoids and how many workers it got (elastic);
-- every decision's audit record (each candidate's per-plugin scores) is kept for `loom explain`.
ALTER TABLE jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE jobs ADD CONSTRAINT jobs_state_check CHECK (state IN
    ('waiting', 'queued', 'placed', 'running', 'completed', 'failed', 'rejected', 'cancelled'));
ALTER TABLE jobs
    ADD COLUMN parent         text,
    ADD COLUMN avoid_clusters text[]  NOT NULL DEFAULT '{}',
    ADD COLUMN workers        integer,
    ADD COLUMN priority       integer NOT NULL DEFAULT 100,
    ADD COLUMN resizes        integer NOT NULL DEFAULT 0;
CREATE INDEX jobs_by_parent ON jobs (parent) WHERE parent IS NOT NULL;

CREATE TABLE decisions (
    job_id  text        NOT NULL,
    attempt integer     NOT NULL,
    at      timestamptz NOT NULL DEFAULT now(),
    outcome text        NOT NULL CHECK (outcome IN ('placed', 'rejected', 'waiting')),
    -- JSON text, not jsonb: written with every decision and read only by `loom explain`.
    record  text        NOT NULL,
    PRIMARY KEY (job_id, attempt)
);

-- Reservations not confirmed by the agent in time expire (the job is placed again elsewhere).
CREATE INDEX reservations_unconfirmed ON reservations (created_at) WHERE state = 'reserved';
ALTER TABLE reservations ADD COLUMN confirm_by timestamptz;
ALTER TABLE node_allocations
    ADD COLUMN cpu_milli  integer NOT NULL DEFAULT 0,
    ADD COLUMN memory_mib bigint  NOT NULL DEFAULT 0;

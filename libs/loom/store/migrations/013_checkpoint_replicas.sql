-- Checkpoint replicas (issue 15 item 1): the migration service copies each running job's latest
-- checkpoint to another cluster in the background; a resume whose original cannot be read (its
-- cluster failed, its checksum fails) reads the replica (loom.migrate.replicas, .checkpoints).
-- ``transfer_bytes`` is what the copy sent (the full checkpoint the first time, the delta after);
-- ``stored_bytes`` what the replica occupies in its cluster's byte budget.
CREATE TABLE checkpoint_replicas (
    job_id          text        NOT NULL,
    tenant          text        NOT NULL,
    attempt         integer     NOT NULL CHECK (attempt >= 1),
    step            integer     NOT NULL CHECK (step >= 0),
    source_cluster  text        NOT NULL,
    source_uri      text        NOT NULL,
    cluster         text        NOT NULL,
    uri             text        NOT NULL,
    checksum        text        NOT NULL DEFAULT '',
    full_copy       boolean     NOT NULL,
    base_step       integer,
    transfer_bytes  bigint      NOT NULL CHECK (transfer_bytes >= 0),
    stored_bytes    bigint      NOT NULL CHECK (stored_bytes >= 0),
    transfer_s      double precision NOT NULL DEFAULT 0,
    state           text        NOT NULL CHECK (state IN ('copying', 'ready', 'superseded', 'evicted', 'failed')),
    corrupt         boolean     NOT NULL DEFAULT false,
    why             text        NOT NULL DEFAULT '',
    requested_at    timestamptz NOT NULL DEFAULT now(),
    ready_at        timestamptz,
    PRIMARY KEY (job_id, attempt, step, cluster)
);
CREATE INDEX checkpoint_replicas_held ON checkpoint_replicas (cluster) WHERE state IN ('copying', 'ready');
CREATE INDEX checkpoint_replicas_by_job ON checkpoint_replicas (job_id, step DESC);

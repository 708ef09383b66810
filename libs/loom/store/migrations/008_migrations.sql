-- Migration and drains (issue 15): checkpoints as records, drained clusters, and every migration
-- with its steps, so a restarted migration service resumes from its records.

-- Every checkpoint an agent reported, keyed by the run and step it was written at. A resume
-- verifies ``checksum`` and falls back to the previous one (loom.migrate.checkpoints).
CREATE TABLE checkpoints (
    job_id     text        NOT NULL,
    attempt    integer     NOT NULL CHECK (attempt >= 1),
    step       integer     NOT NULL CHECK (step >= 0),
    cluster    text        NOT NULL,
    uri        text        NOT NULL,
    bytes      bigint      NOT NULL DEFAULT 0 CHECK (bytes >= 0),
    checksum   text        NOT NULL DEFAULT '',
    corrupt    boolean     NOT NULL DEFAULT false,
    at         timestamptz NOT NULL,
    PRIMARY KEY (job_id, attempt, step)
);
CREATE INDEX checkpoints_latest ON checkpoints (job_id, step DESC);

-- Clusters closed to new placements (``loom drain``); placement loads them and honours them.
CREATE TABLE cluster_drains (
    cluster      text        PRIMARY KEY,
    concurrency  integer     NOT NULL CHECK (concurrency >= 1),
    deadline_s   real        NOT NULL DEFAULT 0 CHECK (deadline_s >= 0),
    forced       boolean     NOT NULL DEFAULT false,
    state        text        NOT NULL CHECK (state IN ('draining', 'drained')),
    started_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);

-- One row per run given up to move its job (a drain's move or a failover), from planned on.
CREATE TABLE migrations (
    migration_id   text        PRIMARY KEY,
    job_id         text        NOT NULL,
    tenant         text        NOT NULL,
    cause          text        NOT NULL CHECK (cause IN ('drain', 'failover')),
    state          text        NOT NULL CHECK (state IN ('planned', 'started', 'completed', 'failed')),
    from_cluster   text        NOT NULL,
    to_cluster     text,
    from_attempt   integer     NOT NULL CHECK (from_attempt >= 1),
    resume_step    integer     NOT NULL DEFAULT 0 CHECK (resume_step >= 0),
    steps          integer     NOT NULL DEFAULT 0,
    lost_steps     integer     NOT NULL DEFAULT 0,
    why            text        NOT NULL DEFAULT '',
    trace_context  jsonb       NOT NULL DEFAULT '{}'::jsonb,
    planned_at     timestamptz NOT NULL DEFAULT now(),
    started_at     timestamptz,
    finished_at    timestamptz
);
CREATE INDEX migrations_by_job ON migrations (job_id, planned_at);
CREATE INDEX migrations_open ON migrations (state) WHERE state IN ('planned', 'started');

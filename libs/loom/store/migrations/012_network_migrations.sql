-- Network-driven migrations (issue 15 item 3) and backflow: two more causes, and the verdict of
-- every job looked at (moved or not), with its numbers, for `loom migrations --verdicts`.
ALTER TABLE migrations DROP CONSTRAINT IF EXISTS migrations_cause_check;
ALTER TABLE migrations ADD CONSTRAINT migrations_cause_check
    CHECK (cause IN ('drain', 'failover', 'network', 'backflow'));

CREATE TABLE migration_verdicts (
    id            bigserial   PRIMARY KEY,
    job_id        text        NOT NULL,
    attempt       integer     NOT NULL,
    trigger       text        NOT NULL,
    decision      text        NOT NULL CHECK (decision IN ('move', 'stay', 'deferred')),
    source        text        NOT NULL,
    target        text,
    reason        text        NOT NULL DEFAULT '',
    gain_s        double precision,
    cost_s        double precision,
    threshold_s   double precision,
    margin_s      double precision,
    link          text        NOT NULL DEFAULT '',
    at            timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX migration_verdicts_by_job ON migration_verdicts (job_id, at);

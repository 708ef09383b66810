-- Incidents of the alert correlator (issue 16): one row per incident, its latest state. `record`
-- is the IncidentChange as last published or persisted (jobs, candidates, timeline); the columns
-- beside it are what `loom incidents` filters and sorts on.
CREATE TABLE incidents (
    incident_id text        PRIMARY KEY,
    state       text        NOT NULL CHECK (state IN ('open', 'acknowledged', 'resolved')),
    root_kind   text        NOT NULL,
    root        text        NOT NULL,
    severity    text        NOT NULL,
    summary     text        NOT NULL DEFAULT '',
    jobs_total  integer     NOT NULL DEFAULT 0 CHECK (jobs_total >= 0),
    alerts      bigint      NOT NULL DEFAULT 0 CHECK (alerts >= 0),
    opened_at   timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL,
    resolved_at timestamptz,
    record      jsonb       NOT NULL
);
CREATE INDEX incidents_open ON incidents (opened_at) WHERE state <> 'resolved';
CREATE INDEX incidents_by_opened ON incidents (opened_at DESC);

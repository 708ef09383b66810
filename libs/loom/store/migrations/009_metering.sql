-- Metering (libs/loom/metering, written by the metrics service): each job attempt's run record,
-- folded from its lifecycle events, and the usage rows it was metered into (one per part, GPU
-- count and UTC hour). Times are whole milliseconds since the epoch, so GPU-ms are exact integers.

CREATE TABLE usage_runs (
    job_id     text        NOT NULL,
    attempt    integer     NOT NULL CHECK (attempt >= 1),
    record     jsonb       NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, attempt)
);

CREATE TABLE usage_rows (
    job_id             text             NOT NULL,
    attempt            integer          NOT NULL,
    seq                integer          NOT NULL,
    tenant             text             NOT NULL,
    labels             jsonb            NOT NULL DEFAULT '{}'::jsonb,
    cluster            text             NOT NULL,
    region             text             NOT NULL,
    gpu_model          text             NOT NULL,
    start_ms           bigint           NOT NULL,
    end_ms             bigint           NOT NULL,
    gpus               integer          NOT NULL CHECK (gpus > 0),
    gpu_ms             bigint           GENERATED ALWAYS AS (gpus::bigint * (end_ms - start_ms)) STORED,
    scu_per_gpu        double precision NOT NULL CHECK (scu_per_gpu >= 0),
    price_per_scu_hour double precision NOT NULL CHECK (price_per_scu_hour >= 0),
    outcome            text             NOT NULL CHECK (outcome IN
                         ('completed', 'failed', 'preempted', 'requeued', 'cancelled')),
    PRIMARY KEY (job_id, attempt, seq),
    CHECK (end_ms > start_ms)
);
CREATE INDEX usage_rows_by_tenant ON usage_rows (tenant, start_ms);
CREATE INDEX usage_rows_by_time ON usage_rows (start_ms);

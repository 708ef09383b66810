-- The resource view (issue 3): how volatile each cluster has been (its TTL depends on it), how far
-- its claimed compute is trusted (progressive onboarding), and the learned SCU decay factors.
ALTER TABLE ledger_clusters
    ADD COLUMN volatility          real    NOT NULL DEFAULT 1.0,
    ADD COLUMN trust               real    NOT NULL DEFAULT 0.3,
    ADD COLUMN trust_confirmations integer NOT NULL DEFAULT 0,
    ADD COLUMN trust_mismatches    integer NOT NULL DEFAULT 0;

CREATE TABLE scu_decay (
    gpu_model    text    NOT NULL,
    task_type    text    NOT NULL,
    factor       real    NOT NULL CHECK (factor > 0),
    observations integer NOT NULL DEFAULT 0,
    PRIMARY KEY (gpu_model, task_type)
);

-- What each cluster's agent says its accelerators deliver (library numbers or calibrated).
CREATE TABLE cluster_profiles (
    cluster     text        NOT NULL,
    gpu_model   text        NOT NULL,
    source      text        NOT NULL,
    profile     jsonb       NOT NULL,
    measured_at timestamptz NOT NULL,
    PRIMARY KEY (cluster, gpu_model)
);

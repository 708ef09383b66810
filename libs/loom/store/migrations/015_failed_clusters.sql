-- Clusters placement's leader classified failed (heartbeats or agent connection lost, and probes
-- cannot reach them; loom.migrate.health), until they return. A new leader (a takeover, a
-- restart) loads them, so it does not place work on a failed cluster while it has not yet seen
-- the failure itself (its liveness pings and the view take seconds to say so).
CREATE TABLE failed_clusters (
    cluster    text             PRIMARY KEY,
    reason     text             NOT NULL DEFAULT '',
    failed_at  double precision NOT NULL
);

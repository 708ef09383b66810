-- Node scope and backflow (issue 15): a run moved off a slow node is a migration of its own cause
-- (`slow_node`); node failures are recorded as failovers, cluster joins and undrains as backflow.
ALTER TABLE migrations DROP CONSTRAINT IF EXISTS migrations_cause_check;
ALTER TABLE migrations ADD CONSTRAINT migrations_cause_check
    CHECK (cause IN ('drain', 'failover', 'network', 'backflow', 'slow_node'));

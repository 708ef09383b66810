-- The resource view (issue 3): how volatile each cluster has been (its TTL depends on it).
ALTER TABLE ledger_clusters ADD COLUMN volatility real NOT NULL DEFAULT 1.0;

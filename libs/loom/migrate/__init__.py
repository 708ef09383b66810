"""Migration and failover: pure decisions (cluster health, what to re-place)."""

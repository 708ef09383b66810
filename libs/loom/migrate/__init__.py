"""Migration and failover: pure decisions (cluster health, what to re-place, where a re-placed run
resumes, and whether a running job should move: ``benefit``)."""

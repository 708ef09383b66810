-- Failover (issue 15): a job re-queued because its cluster failed resumes from the step its lost
-- run had checkpointed (loom.migrate.resume). Kept on the row so a restarted placement starts the
-- next run the same way; 0 means from step 0.
ALTER TABLE jobs ADD COLUMN resume_step integer NOT NULL DEFAULT 0 CHECK (resume_step >= 0);

-- Failover (issue 15): a job re-queued because its cluster failed resumes from the progress its
-- lost run had reported (placement turns it into the last checkpoint at or before it). Kept on
-- the row so a restarted placement resumes it the same way; 0 means from step 0.
ALTER TABLE jobs ADD COLUMN resume_progress real NOT NULL DEFAULT 0
    CHECK (resume_progress >= 0 AND resume_progress <= 1);

-- A new placement leader reads the latest jobs submitted (rare_fit's memory of the worker shapes
-- seen lately, loom.store.jobs.recent_jobs): an index so that takeover does not sort the whole
-- jobs table.
CREATE INDEX jobs_by_submission ON jobs (submitted_at DESC, job_id DESC);

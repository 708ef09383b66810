-- Learned speeds (issue 12): every observation of a job family's speed on a GPU model that
-- placement's speed learner took, in the order it took them. The learner's state is these rows
-- replayed in ``seq`` order (loom.store.speeds.load_learner), so it survives a restart and every
-- replica answers the same. ``event_id`` is the completion event's message id: a redelivered
-- event adds nothing.
CREATE TABLE speed_observations (
    seq            bigserial        PRIMARY KEY,
    event_id       text             NOT NULL UNIQUE,
    job_id         text             NOT NULL,
    family         text             NOT NULL,
    gpu_model      text             NOT NULL,
    prior_speed    double precision NOT NULL CHECK (prior_speed > 0),
    observed_speed double precision NOT NULL CHECK (observed_speed > 0),
    weight         double precision NOT NULL DEFAULT 1 CHECK (weight > 0),
    at             timestamptz      NOT NULL DEFAULT now()
);

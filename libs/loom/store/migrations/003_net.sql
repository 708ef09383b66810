-- Network perception (issue: network services). network-perception is the sole writer of both tables.
-- What each directed link has learned slowly (baseline RTT, price, forecast profile, feedback), so
-- a restarted service resumes it instead of relearning from the topology's numbers.
CREATE TABLE net_link_records (
    src      text        NOT NULL,
    dst      text        NOT NULL,
    record   jsonb       NOT NULL,
    saved_at timestamptz NOT NULL,
    PRIMARY KEY (src, dst)
);

-- Every degraded / recovered event, as published: the history of the network's condition.
CREATE TABLE net_link_events (
    id              bigserial   PRIMARY KEY,
    src             text        NOT NULL,
    dst             text        NOT NULL,
    kind            text        NOT NULL CHECK (kind IN ('degraded', 'recovered')),
    at              timestamptz NOT NULL,
    reason          text        NOT NULL,
    rtt_ms          real,
    baseline_rtt_ms real        NOT NULL,
    loss_rate       real        NOT NULL
);
CREATE INDEX net_link_events_link_at ON net_link_events (src, dst, at);

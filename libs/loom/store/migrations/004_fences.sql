-- Leader fencing (issue: placement leader election). One row per shard: the fencing token (the
-- NATS KV lease revision) of the newest leader that claimed it. A leader's writes check it in their
-- own transaction, so a deposed leader's writes are refused (loom.store.fence).
CREATE TABLE fences (
    shard      text        PRIMARY KEY,
    token      bigint      NOT NULL CHECK (token > 0),
    holder     text        NOT NULL,
    claimed_at timestamptz NOT NULL DEFAULT now()
);

-- A row the bus refuses for good (too large for any stream, say) is set aside with why, rather
-- than retried for ever at the head of its producer's queue (a review showed a chunk of such rows
-- holding back every row behind them). published_at is set with it: the row is no longer pending.
ALTER TABLE outbox ADD COLUMN refused text;

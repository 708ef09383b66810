-- What each open incident holds beyond its record (loom.alerts.correlate.Held): the stateful
-- alerts still firing (fingerprint, whether it names the root) and when its last momentary alert
-- came. A restarted alert correlator holds them again, so a recovery (a link recovered, a cluster
-- fresh again) resolves the incident as it would have before the restart. NULL: written by a
-- version that kept nothing (such an incident resolves after its quiet period).
ALTER TABLE incidents ADD COLUMN held jsonb;

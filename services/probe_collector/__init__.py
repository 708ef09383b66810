"""The probe_collector service: one per region, measures the region's outgoing links."""

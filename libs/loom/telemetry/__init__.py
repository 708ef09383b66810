"""loom.telemetry."""

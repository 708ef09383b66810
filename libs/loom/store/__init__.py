"""loom.store."""

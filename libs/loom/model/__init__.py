"""loom.model."""

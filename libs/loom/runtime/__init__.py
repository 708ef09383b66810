"""loom.runtime."""

"""loom.bus."""

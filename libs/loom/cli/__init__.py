"""loom.cli."""

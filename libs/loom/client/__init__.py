"""loom.client."""

"""Loom's deployable services: thin shells around the pure core in ``loom``."""

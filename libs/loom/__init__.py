"""Loom's shared library: the pure decision core plus the thin I/O layers the services use."""

__version__ = "0.1.0"

"""Scheduling: pure decision code (no I/O) that placement, the simulator and benchmarks share."""

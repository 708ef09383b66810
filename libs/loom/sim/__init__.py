"""Discrete-event simulation of Loom and baseline policies on real measured data."""

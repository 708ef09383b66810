"""The scheduling plugins; :mod:`loom.sched.profile` registers them and builds the default framework."""

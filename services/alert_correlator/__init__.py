"""The alert correlator service (issue 16)."""

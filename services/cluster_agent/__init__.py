"""The cluster_agent service."""

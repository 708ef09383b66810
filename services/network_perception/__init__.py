"""The network_perception service: the sole writer of link state."""

"""loom.cli."""

CONNECT_WITHIN_S = 2.5
"""How long a command waits for the stack's NATS: one that finds no server by then says so (exit 1,
`loom up` as the fix) instead of waiting."""

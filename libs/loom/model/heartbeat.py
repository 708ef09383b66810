"""How often an agent heartbeats: fast while its cluster changes, slower while it is stable."""

MIN_INTERVAL_S = 0.5
MAX_INTERVAL_S = 10.0
GROWTH = 1.5


def next_interval_s(
    current_s: float,
    changed: bool,
    *,
    min_s: float = MIN_INTERVAL_S,
    max_s: float = MAX_INTERVAL_S,
    growth: float = GROWTH,
) -> float:
    """The interval until the next heartbeat.

    A heartbeat that carried a change drops the interval to ``min_s`` (more may follow soon);
    each quiet heartbeat stretches it by ``growth`` up to ``max_s``. The interval is declared in
    every heartbeat, and the ledger's staleness TTL is counted in declared intervals, so a
    stable cluster that heartbeats rarely is not mistaken for a silent one.
    """
    if min_s <= 0 or max_s < min_s or growth < 1:
        raise ValueError("need 0 < min_s <= max_s and growth >= 1")
    if changed:
        return min_s
    return min(max(current_s, min_s) * growth, max_s)

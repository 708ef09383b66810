"""The metrics service undoes a heartbeat whose persistence failed: the ledger is as before it,
whatever the heartbeat changed, added or removed, and whichever nodes it named."""

import copy

import pytest

from loom.model.ledger import Ledger
from loom_services.metrics.service import _restore, _snapshot
from tests.unit.test_ledger import NOW, hb, ns


def _state(ledger: Ledger) -> tuple[dict[str, object], dict[str, object]]:
    return (copy.deepcopy(ledger.clusters), copy.deepcopy(ledger.nodes))


@pytest.fixture
def ledger() -> Ledger:
    """c1 with n1..n3 (one used GPU on n3), and c2 with m1 (another cluster, never touched)."""
    led = Ledger()
    led.apply(hb(1, [ns("n1"), ns("n2"), ns("n3", used=1)], full=True), NOW)
    led.apply(hb(1, [ns("m1")], cluster="c2", full=True), NOW)
    return led


@pytest.mark.parametrize(
    "beat",
    [
        # a delta: one node changed, one new, one removed, one of another cluster (refused)
        hb(2, [ns("n1", used=4), ns("n9"), ns("m1", used=2)], removed=["n2"], sent_at=NOW + 1),
        # a full heartbeat: n1 and n3 changed, n2 removed by omission, n8 new
        hb(2, [ns("n1", used=8), ns("n3", healthy=False), ns("n8")], full=True, sent_at=NOW + 1),
        # a new cluster
        hb(1, [ns("k1"), ns("k2")], cluster="c3", full=True, sent_at=NOW + 1),
    ],
    ids=["delta", "full", "new-cluster"],
)
def test_a_heartbeat_undone_leaves_the_ledger_as_before(ledger: Ledger, beat: object) -> None:
    before = _state(ledger)
    snapshot = _snapshot(ledger, beat)  # type: ignore[arg-type]
    applied = ledger.apply(beat, NOW + 2)  # type: ignore[arg-type]
    assert applied.change is not None  # it did change something
    assert _state(ledger) != before
    _restore(ledger, beat.cluster, snapshot)  # type: ignore[attr-defined]
    assert _state(ledger) == before
    # The redelivery is applied afresh: the same change again.
    again = ledger.apply(beat, NOW + 2)  # type: ignore[arg-type]
    assert again.change == applied.change

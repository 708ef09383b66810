"""How placement's book follows view deltas (``view_changes``): in particular a cluster that
comes back from stale, which the ledger announces whole, offers the nodes staleness closed again by
their own health (seen under load with 4 shards, when the return listed only what its first
heartbeat changed: a cluster marked stale for a moment kept 235 of its 249 nodes closed, and 354
jobs allowed only in its region waited until the bench gave up)."""

import dataclasses

from loom.model.capacity import NodeCapacity
from loom_proto.view import NodeView, ViewDelta
from loom_services.placement.service import view_changes


def _node(name: str, *, schedulable: bool = True, reserved: int = 0) -> NodeCapacity:
    return NodeCapacity(
        node=name,
        cluster="c",
        region="r",
        zone="z",
        gpu_model="A100",
        gpus_total=8,
        gpus_reserved=reserved,
        schedulable=schedulable,
        cpu_milli=0,
        memory_mib=0,
    )


def _view(name: str, *, healthy: bool = True) -> NodeView:
    return NodeView(node=name, zone="z", gpu_model="A100", gpus_total=8, healthy=healthy, updated_at=1.0)


def _delta(version: int, nodes: list[NodeView] | None = None, **kw: object) -> ViewDelta:
    return ViewDelta(region="r", cluster="c", version=version, nodes=nodes or [], at=1.0, **kw)  # type: ignore[arg-type]


def _apply(book: dict[str, NodeCapacity], changed: list[NodeCapacity]) -> None:
    for cap in changed:
        old = book.get(cap.node)
        book[cap.node] = dataclasses.replace(cap, gpus_reserved=old.gpus_reserved if old else 0)


def _open(book: dict[str, NodeCapacity]) -> set[str]:
    return {n for n, cap in book.items() if cap.schedulable}


def test_a_cluster_back_from_stale_opens_its_healthy_nodes_and_nothing_else() -> None:
    book = {n: _node(n, reserved=2 if n == "a" else 0) for n in ("a", "b", "c", "d")}
    book["d"] = _node("d", schedulable=False)  # closed before: unhealthy
    _apply(book, view_changes(book, _delta(2, stale=True)))
    assert _open(book) == set()
    # back: the ledger republishes the cluster whole; b turned unhealthy meanwhile, d still is
    back = [_view("a"), _view("b", healthy=False), _view("c"), _view("d", healthy=False)]
    _apply(book, view_changes(book, _delta(3, back, full=True)))
    assert _open(book) == {"a", "c"}
    assert book["a"].gpus_reserved == 2  # reservations are placement's: kept


def test_without_staleness_unlisted_nodes_keep_their_state() -> None:
    book = {"a": _node("a"), "b": _node("b", schedulable=False)}
    _apply(book, view_changes(book, _delta(2, [_view("a")])))
    assert _open(book) == {"a"}  # b is not listed: a fresh delta does not open it
    # a full list closes what it leaves out; removed nodes close
    _apply(book, view_changes(book, _delta(3, [_view("b")], full=True)))
    assert _open(book) == {"b"}
    _apply(book, view_changes(book, _delta(4, removed=["b"])))
    assert _open(book) == set()


def test_a_node_removed_while_stale_does_not_come_back() -> None:
    book = {n: _node(n) for n in ("a", "b")}
    _apply(book, view_changes(book, _delta(2, stale=True)))
    _apply(book, view_changes(book, _delta(3, removed=["b"], stale=True)))
    _apply(book, view_changes(book, _delta(4, [_view("a")], full=True)))  # the ledger's whole list
    assert _open(book) == {"a"}

"""A service's collector pauses, per generation, as its health answer shows them."""

import gc

from loom.runtime.service import GcPauses


def test_each_collection_is_counted_under_its_generation_with_its_pause() -> None:
    pauses = GcPauses()
    pauses.install()
    try:
        pauses.install()  # once only
        assert gc.callbacks.count(pauses) == 1
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        pauses.uninstall()
    stats = pauses.stats()
    assert set(stats) == {"gen0", "gen1", "gen2"}
    assert stats["gen2"]["count"] == 2 and stats["gen0"]["count"] >= 1
    assert stats["gen2"]["max_ms"] > 0 and stats["gen2"]["total_ms"] >= stats["gen2"]["max_ms"]
    gc.collect(2)  # uninstalled: not counted
    assert pauses.stats()["gen2"]["count"] == 2
    assert pauses not in gc.callbacks


def test_a_stop_without_its_start_is_not_counted() -> None:
    pauses = GcPauses()
    pauses("stop", {"generation": 1})
    assert pauses.stats()["gen1"] == {"count": 0, "total_ms": 0.0, "max_ms": 0.0}
    pauses("start", {"generation": 1})
    pauses("stop", {"generation": 1})
    assert pauses.stats()["gen1"]["count"] == 1

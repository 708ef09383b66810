"""The attempt record's changes (loom.bus.attempts): pure, applied to the record as it is now."""

from loom.bus.attempts import Attempts, closed, opened


def test_an_attempt_opens_on_the_record_as_it_is_until_max_crashes_never_came_back() -> None:
    assert opened(Attempts(open=1, failures=2, error="e"), 3) == Attempts(open=2, failures=2, error="e")
    assert opened(Attempts(open=3), 3) is None, "a crash loop: not tried again"


def test_closing_an_attempt_keeps_what_another_attempt_wrote_meanwhile() -> None:
    before = Attempts(open=0, failures=1)
    # Another attempt opened after this one and counted a failure of its own meanwhile.
    now = Attempts(open=2, failures=2)
    assert closed(now, before, failures=2, error="mine") == Attempts(open=1, failures=3, error="mine")


def test_closing_an_attempt_alone_writes_what_it_counted() -> None:
    before = Attempts(open=0, failures=1)
    assert closed(Attempts(open=1, failures=1), before, failures=1, error="") == Attempts(open=0, failures=1)
    assert closed(Attempts(open=0), Attempts(), failures=0, error="") == Attempts(), "never below zero"

"""Tenant quotas: nominal shares, borrowing inside a cohort within limits, fair share, reclaim order."""

from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.errors import InvalidInputError
from loom.sched.quota import OPEN, QuotaBook, QuotaError, TenantConfig, TenantQuota, load_tenants


def config(*quotas: TenantQuota, open: bool = False) -> TenantConfig:
    return TenantConfig(tenants={q.name: q for q in quotas}, open=open)


RESEARCH = config(
    TenantQuota("acme", "research", 64, borrowing_limit=32, weight=2.0),
    TenantQuota("beta", "research", 16),
    TenantQuota("solo", None, 8),
)


# -- load_tenants ------------------------------------------------------------------------------------


def test_loads_a_yaml_shaped_mapping() -> None:
    loaded = load_tenants(
        {
            "tenants": {
                "acme": {"gpus": 64, "cohort": "research", "borrowing_limit": 32, "weight": 2},
                "solo": {"gpus": 8},
            },
            "open": False,
        }
    )
    assert loaded.open is False
    assert loaded.tenants["acme"] == TenantQuota("acme", "research", 64, borrowing_limit=32, weight=2.0)
    assert loaded.tenants["solo"] == TenantQuota("solo", None, 8)


def test_open_defaults_to_true_like_no_config() -> None:
    assert load_tenants({"tenants": {"a": {"gpus": 1}}}).open is True
    assert load_tenants({}) == TenantConfig(tenants={}, open=True)
    assert OPEN.open and not OPEN.tenants


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tenants": {"acme": {"gpus": -1}}}, r"tenant 'acme': Expected `int` >= 0 - at `\$.gpus`"),
        ({"tenants": {"acme": {"gpus": 4, "borrowing_limit": -2, "cohort": "c"}}}, r"borrowing_limit"),
        ({"tenants": {"acme": {"gpus": 4, "weight": 0}}}, r"weight"),
        ({"tenants": {"acme": {"gpus": 4, "gpu": 3}}}, r"unknown field `gpu`"),
        ({"tenant": {}}, r"unknown field `tenant`"),
        ({"tenants": {"acme": {"gpus": 4, "borrowing_limit": 2}}}, r"acme.*borrowing_limit but no cohort"),
        ({"tenants": {"ac.me": {"gpus": 4}}}, r"invalid tenant quotas"),
        ({"tenants": {"acme": {"gpus": True}}}, r"Expected `int`, got `bool`"),
    ],
)
def test_rejects_bad_input_saying_where(data: Mapping[str, object], message: str) -> None:
    with pytest.raises(QuotaError, match=message) as info:
        load_tenants(data)
    assert isinstance(info.value, InvalidInputError)


def test_quota_refuses_negative_numbers_when_built_directly() -> None:
    with pytest.raises(QuotaError, match="gpus must be 0 or more"):
        TenantQuota("a", None, -1)
    with pytest.raises(QuotaError, match="weight"):
        TenantQuota("a", None, 1, weight=float("nan"))


# -- check -------------------------------------------------------------------------------------------


def test_within_nominal_is_admitted_without_borrowing() -> None:
    verdict = QuotaBook(RESEARCH, {"acme": 10}).check("acme", 54)
    assert (verdict.ok, verdict.borrowed, verdict.never) == (True, 0, False)


def test_borrows_unused_nominal_of_the_cohort() -> None:
    verdict = QuotaBook(RESEARCH, {"acme": 60}).check("acme", 12)
    assert (verdict.ok, verdict.borrowed, verdict.never) == (True, 8, False)


def test_refuses_more_than_the_cohort_has_unused_and_says_so_plainly() -> None:
    verdict = QuotaBook(RESEARCH, {"acme": 60, "beta": 14}).check("acme", 8)
    assert (verdict.ok, verdict.never) == (False, False)
    expected = "tenant acme holds 60 of 64 GPUs and its cohort research has 6 unused; it asks for 8"
    assert verdict.reason == expected


def test_refuses_borrowing_past_the_limit() -> None:
    cfg = config(TenantQuota("a", "c", 4, borrowing_limit=2), TenantQuota("b", "c", 10))
    verdict = QuotaBook(cfg, {}).check("a", 7)
    assert (verdict.ok, verdict.never) == (False, True)
    verdict = QuotaBook(cfg, {"a": 5}).check("a", 2)
    assert (verdict.ok, verdict.never) == (False, False)
    assert "borrowing limit of 2" in verdict.reason


def test_a_tenant_without_cohort_never_borrows() -> None:
    book = QuotaBook(RESEARCH, {"solo": 6})
    assert not book.check("solo", 3).ok
    assert book.check("solo", 2).ok
    assert book.check("solo", 9).never


def test_never_when_more_than_the_whole_cohort() -> None:
    verdict = QuotaBook(RESEARCH, {}).check("beta", 81)
    assert verdict.never and not verdict.ok
    assert "more than the 80 it could ever hold" in verdict.reason
    assert not QuotaBook(RESEARCH, {}).check("beta", 80).never


def test_a_within_quota_request_blocked_by_borrowers_reports_what_can_be_reclaimed() -> None:
    verdict = QuotaBook(RESEARCH, {"acme": 76}).check("beta", 8)
    assert (verdict.ok, verdict.never, verdict.reclaimable) == (False, False, 12)
    assert "other members borrow 12 that could be reclaimed" in verdict.reason


def test_unknown_tenants_pass_an_open_config_and_never_pass_a_closed_one() -> None:
    assert QuotaBook(config(open=True), {}).check("anyone", 1000).ok
    verdict = QuotaBook(RESEARCH, {}).check("anyone", 1)
    assert (verdict.ok, verdict.never) == (False, True)
    # Said to the tenant who submitted: the other tenants are not named (a newcomer's walk).
    assert "ask its operator to add it" in verdict.reason
    assert not any(name in verdict.reason for name in ("acme", "beta", "solo"))


# -- take, give, fair share, borrowers ---------------------------------------------------------------


def test_take_and_give_track_usage_and_give_never_goes_below_zero() -> None:
    book = QuotaBook(RESEARCH, {})
    book.take("acme", 8)
    book.take("acme", 4)
    assert book.held("acme") == 12
    book.give("acme", 10)
    book.give("acme", 10)
    book.give("acme", 10)
    assert book.held("acme") == 0
    assert dict(book.usage) == {}


def test_negative_counts_are_refused() -> None:
    with pytest.raises(QuotaError):
        QuotaBook(RESEARCH, {}).take("acme", -1)


def test_fair_share_divides_usage_by_weighted_nominal() -> None:
    book = QuotaBook(RESEARCH, {"acme": 64, "beta": 8, "ghost": 3})
    assert book.fair_share("acme") == 0.5
    assert book.fair_share("beta") == 0.5
    assert book.fair_share("ghost") == 3.0
    assert QuotaBook(config(TenantQuota("z", None, 0)), {"z": 2}).fair_share("z") == 2.0


def test_borrowers_are_listed_highest_share_first() -> None:
    cfg = config(TenantQuota("a", "c", 10), TenantQuota("b", "c", 10), TenantQuota("d", "c", 20))
    book = QuotaBook(cfg, {"a": 12, "b": 15, "d": 1})
    assert book.borrowers_over_share() == [("b", 5), ("a", 2)]
    assert book.borrowers_over_share("other") == []


# -- properties --------------------------------------------------------------------------------------

TENANTS = ("t0", "t1", "t2", "t3", "t4")


@st.composite
def configs(draw: st.DrawFn) -> TenantConfig:
    quotas = []
    for name in draw(st.lists(st.sampled_from(TENANTS), min_size=1, max_size=5, unique=True)):
        quotas.append(
            TenantQuota(
                name,
                draw(st.sampled_from([None, "c1", "c2"])),
                draw(st.integers(0, 20)),
                borrowing_limit=draw(st.none() | st.integers(0, 20)),
                weight=draw(st.sampled_from([0.5, 1.0, 3.0])),
            )
        )
    return TenantConfig(tenants={q.name: q for q in quotas}, open=draw(st.booleans()))


def assert_invariants(book: QuotaBook) -> None:
    cohorts: dict[str, tuple[int, int]] = {}
    for quota in book.config.tenants.values():
        held = book.held(quota.name)
        if quota.cohort is None:
            assert held <= quota.gpus
        else:
            if quota.borrowing_limit is not None:
                assert held <= quota.gpus + quota.borrowing_limit
            used, nominal = cohorts.get(quota.cohort, (0, 0))
            cohorts[quota.cohort] = (used + held, nominal + quota.gpus)
    for used, nominal in cohorts.values():
        assert used <= nominal
    for tenant in book.usage:
        assert tenant in book.config.tenants or book.config.open


@settings(max_examples=150, deadline=None)
@given(
    configs(),
    st.lists(
        st.tuples(st.booleans(), st.sampled_from((*TENANTS, "stranger")), st.integers(0, 30)), max_size=40
    ),
)
def test_checked_takes_and_any_gives_never_break_the_invariants(
    cfg: TenantConfig, ops: list[tuple[bool, str, int]]
) -> None:
    book = QuotaBook(cfg, {})
    empty = QuotaBook(cfg, {})
    for is_take, tenant, gpus in ops:
        if is_take:
            verdict = book.check(tenant, gpus)
            from_empty = empty.check(tenant, gpus)
            assert verdict.never == from_empty.never
            assert verdict.never == (not from_empty.ok), "never must mean: not even an empty platform"
            assert not (verdict.ok and verdict.never)
            assert 0 <= verdict.borrowed <= gpus
            if verdict.ok:
                book.take(tenant, gpus)
        else:
            book.give(tenant, gpus)
        assert_invariants(book)

"""Message ids tagged with the publisher's own key (loom.security.message_ids)."""

from loom.security import Credential, new_seed
from loom.security.message_ids import id_key, keyed, logical, tags_ids


def _key(identity: str, seed: str | None = None) -> bytes | None:
    return id_key(Credential(identity, seed or new_seed()))


def test_a_tag_is_deterministic_for_one_seed_and_differs_between_seeds() -> None:
    seed = new_seed()
    placement, standby, agent = _key("placement", seed), _key("placement", seed), _key("agent-c2")
    assert keyed("j:placed:1", placement) == keyed("j:placed:1", standby)
    assert keyed("j:placed:1", placement) != keyed("j:placed:1", agent)
    assert keyed("j:placed:1", placement) != keyed("j:placed:2", placement)
    assert keyed("j:placed:1", placement).startswith("j:placed:1~")


def test_tenants_the_operator_and_unsecured_clients_send_plain_ids() -> None:
    assert [tags_ids(i) for i in ("placement", "agent-c1", "probe-collector-eu", "admin", "tenant-acme")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    assert _key("tenant-acme") is None and _key("admin") is None and id_key(None) is None
    assert keyed("j:cancelled:1:ab", None) == "j:cancelled:1:ab"


def test_a_consumer_reads_the_plain_id_and_only_a_well_formed_tag_is_cut() -> None:
    key = _key("agent-c1")
    assert logical(keyed("j:completed:1", key)) == "j:completed:1"
    for plain in ("j:completed:1", "a~b", "x~0123456789abcde", "x~0123456789ABCDEF", "~0123456789abcdef", ""):
        assert logical(plain) == plain
    # A tag cut from a tagged id: one tag only.
    assert logical("x~0123456789abcdef~0123456789abcdef") == "x~0123456789abcdef"

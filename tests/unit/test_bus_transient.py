"""Which JetStream answers the bus waits out on a cluster rather than failing on."""

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from loom.bus.consumer import _transient_api_error
from loom.bus.publisher import _in_process


def test_a_consumer_create_is_tried_again_on_no_answer_or_no_meta_leader_only() -> None:
    assert _transient_api_error(NatsTimeoutError())
    assert _transient_api_error(TimeoutError())
    assert _transient_api_error(NoRespondersError())
    assert _transient_api_error(
        ServiceUnavailableError(code=503, description="JetStream system temporarily unavailable")
    )
    # No such stream, or a config the server refuses: no retry heals those.
    assert not _transient_api_error(NotFoundError(code=404, err_code=10059, description="stream not found"))
    assert not _transient_api_error(APIError(code=400, err_code=10012, description="consumer config invalid"))
    assert not _transient_api_error(ValueError("bug"))


def test_a_publish_meeting_its_own_id_in_process_is_sent_again() -> None:
    in_process = APIError(code=409, err_code=10158, description="duplicate message id is in process")
    assert _in_process(in_process)
    assert not _in_process(APIError(code=409, err_code=10071, description="wrong last sequence"))
    assert not _in_process(NatsTimeoutError())
    assert not _in_process(None)


async def test_on_a_cluster_an_unanswered_send_is_repeated_with_short_ack_timeouts() -> None:
    from nats.aio.client import Client

    from loom.bus.publisher import Publisher

    publisher = Publisher(Client(), timeout_s=5.0, cluster_timeout_s=2.0, leaderless_timeout_s=0.5)
    assert publisher._attempt_timeout_s(clustered=False, awaiting_leader=False) == 5.0
    assert publisher._attempt_timeout_s(clustered=False, awaiting_leader=True) == 5.0
    assert publisher._attempt_timeout_s(clustered=True, awaiting_leader=False) == 2.0
    assert publisher._attempt_timeout_s(clustered=True, awaiting_leader=True) == 0.5
    # Never longer than the publisher's own timeout.
    short = Publisher(Client(), timeout_s=0.3)
    assert short._attempt_timeout_s(clustered=True, awaiting_leader=False) == 0.3


def test_a_stream_the_cluster_cannot_place_yet_is_not_taken_for_one_that_exists() -> None:
    # A CI run of the supervised 3-node stack failed at start: JetStream answered "no suitable peers
    # for placement" while a node had not joined, that was taken for "another service created it",
    # and the update that followed found no stream. Now it is retried as a cluster not ready yet.
    from nats.js.errors import BadRequestError

    from loom.bus.connection import _JETSTREAM_NOT_READY, PeersNotReadyError, placement_refused

    peers = BadRequestError(
        code=400, err_code=10005, description="no suitable peers for placement, peer offline"
    )
    exists = BadRequestError(code=400, err_code=10058, description="stream name already in use")
    assert placement_refused(peers)
    assert not placement_refused(exists)
    assert issubclass(PeersNotReadyError, _JETSTREAM_NOT_READY)

"""The client's queries to the services, on a real NATS."""

import asyncio

import pytest

from loom.client import LoomClient, QueryError


async def test_a_query_nobody_listens_to_says_so_at_once_not_after_its_timeout(nats_url: str) -> None:
    client = await LoomClient.connect(nats_url, name="nobody-listens")
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(QueryError) as refused:
            await client.job("some-job", timeout_s=30.0)
        took = asyncio.get_running_loop().time() - started
        assert "nothing listens on loom.jobs.query: is the service running?" in str(refused.value)
        assert "within" not in str(refused.value)
        assert took < 15.0, took  # a hang guard (the no-responders answer), not a performance figure
    finally:
        await client.close()

"""Fixtures of the broker tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from sluice.broker.plumbing.connection import connect
from sluice.broker.plumbing.readers import Readers
from sluice.broker.replies.router import ReplyRouter

READER = "sluice-test-replies"  # the client name of the reply routers' readers


@pytest.fixture
async def make_router(redis_url: str) -> AsyncIterator[Callable[..., ReplyRouter]]:
    """Reply routers as the api makes them (`**kw`: ReplyRouter's), closed at the end."""
    routers: list[ReplyRouter] = []
    shared = connect(redis_url, name="sluice-test-shared", max_connections=8)  # as the api's own client

    def make(**kw: object) -> ReplyRouter:
        router = ReplyRouter(shared, Readers(redis_url, shared, name=READER), **kw)
        router.start()
        routers.append(router)
        return router

    yield make
    for router in routers:
        await router.close()
    await shared.aclose()

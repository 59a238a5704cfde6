"""Fixtures the supervise tests share."""

import pytest

from megascale_jax.supervise.redis_server import EmbeddedRedis


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An embedded Redis (with its own password) for one test module."""
    s = EmbeddedRedis(str(tmp_path_factory.mktemp("redis")))
    yield s
    s.stop()

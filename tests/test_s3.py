"""Fsspec tier on s3:// against a real S3-compatible server (moto) on loopback."""

from __future__ import annotations

import uuid

import pytest
import s3fs
from aiobotocore.session import AioSession

from kvtier.store import TieredStore
from kvtier.testing.conformance import TierConformance, key_of, sample_block
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.fsspec import FsspecTier
from kvtier.tiers.fsspec_io import AsyncFsBackend
from kvtier.tiers.registry import tier_from_url
from tests.helpers.s3_server import S3Endpoint, s3_endpoint

__all__ = ["s3_endpoint"]  # the fixture, re-exported for pytest

_HEADER = 24 + 8 + 3 + 8


@pytest.fixture(scope="module")
def bucket(s3_endpoint: S3Endpoint) -> str:
    return s3_endpoint.new_bucket()


@pytest.fixture(scope="module")
def botocore_session() -> AioSession:
    """One botocore session for the module's conformance tiers: it caches the S3 service
    model, which a session of each tier's own loads again (about 0.1 s a tier idle, three
    times that at load). Each tier still makes its own client on its own loop."""
    return AioSession()


class TestS3Conformance(TierConformance):
    @pytest.fixture(autouse=True)
    def _s3(self, s3_endpoint: S3Endpoint, bucket: str, botocore_session: AioSession) -> None:
        self.endpoint = s3_endpoint.url
        self.bucket = bucket
        self.session = botocore_session

    async def make_tier(self, capacity: int | None) -> Tier:
        url = (f"s3://{self.bucket}/t-{uuid.uuid4().hex}?endpoint_url={self.endpoint}"
               "&anon=false")
        return tier_from_url(url, capacity=capacity, storage_options={"session": self.session})

    def capacity_for(self, n_blocks: int, block_nbytes: int = 1024) -> int:
        return n_blocks * (block_nbytes + _HEADER)


async def test_s3_is_native_async_and_session_closes(s3_endpoint: S3Endpoint,
                                                     bucket: str) -> None:
    tier = tier_from_url(f"s3://{bucket}/native?endpoint_url={s3_endpoint.url}")
    assert isinstance(tier, FsspecTier)
    await tier.put(key_of(1), sample_block(1, nbytes=256 << 10))
    backend = tier._backend
    assert isinstance(backend, AsyncFsBackend) and backend.fs.asynchronous
    assert tier.storage_options == {"endpoint_url": s3_endpoint.url}
    got = await tier.get(key_of(1))
    assert got is not None and got.tobytes() == sample_block(1, nbytes=256 << 10).tobytes()
    key_hex = key_of(1).hex()
    assert tier.path_of(key_of(1)) == f"{bucket}/native/{key_hex[:2]}/{key_hex[2:4]}/" \
        f"{key_hex}.kvb"
    await tier.aclose()


async def test_corrupt_object_is_miss_deleted_counted(s3_endpoint: S3Endpoint,
                                                      bucket: str) -> None:
    tier = tier_from_url(f"s3://{bucket}/corrupt?endpoint_url={s3_endpoint.url}")
    assert isinstance(tier, FsspecTier)
    await tier.put(key_of(1), sample_block(1))
    path = tier.path_of(key_of(1))
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint.url, skip_instance_cache=True,
                           asynchronous=True)
    await fs.set_session()
    data = bytearray(await fs._cat_file(path))
    data[-1] ^= 1
    await fs._pipe_file(path, bytes(data))
    async with TieredStore([DRAMTier(capacity=1 << 20), tier]) as store:
        assert await store.get(key_of(1)) is None
        assert tier.stats()["corrupt"] == 1
        assert not await fs._exists(path)
        await store.put(key_of(2), sample_block(2))
        assert await store.get(key_of(2)) is not None
    await fs._s3creator.__aexit__(None, None, None)


async def test_unreachable_endpoint_is_a_counted_miss() -> None:
    tier = FsspecTier("s3://nobucket/x", storage_options={
        "endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"retries": {"max_attempts": 1},
                                                                "connect_timeout": 1}},
        timeout=5)
    async with TieredStore([DRAMTier(capacity=1 << 20), tier]) as store:
        assert await store.get(key_of(1)) is None
        assert store.stats()["tiers"][1]["errors"] >= 1
        assert tier.stats()["io_errors"] >= 1

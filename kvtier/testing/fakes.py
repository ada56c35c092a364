"""Test fakes: a controllable clock, a tier that adds latency, a tier that fails on demand,
an array that only speaks DLPack.

They wrap real tiers (no mocks of kvtier's own code): ``LatencyTier`` and ``FailingTier``
forward to an inner tier and only add delay or errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Self

import numpy.typing as npt

from kvtier.errors import ConfigError, TierError
from kvtier.tiers.base import Block, Tier
from kvtier.tiers.dram import DRAMTier

__all__ = ["DLPackOnly", "FailingTier", "FakeClock", "LatencyTier"]


class FakeClock:
    """A clock that only moves when told to: ``clock()`` returns the current time."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward."""
        self.now += seconds


class DLPackOnly:
    """A foreign array over a numpy ``array`` that only speaks DLPack (``__dlpack__`` and
    ``__dlpack_device__``, CPU memory), like an engine's tensor type kvtier has no backend for.
    """

    def __init__(self, array: npt.NDArray[Any]) -> None:
        self.array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.array.__dlpack_device__()


class _Wrapper(Tier):
    def __init__(self, inner: Tier, *, name: str | None = None) -> None:
        super().__init__(name=name or f"{type(self).__name__.lower()}({inner.name})")
        self.inner = inner
        inner.on_evict = self._forward_evict

    async def _forward_evict(self, key: bytes, block: Block) -> None:
        await self._evict(key, block)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        raise ConfigError(f"{cls.__name__} wraps a tier object and has no URL form")

    @property
    def capacity(self) -> int | None:
        return self.inner.capacity

    @property
    def used(self) -> int:
        return self.inner.used

    async def _before(self, op: str) -> None:
        """Hook run before each forwarded operation."""

    async def _get(self, key: bytes) -> Block | None:
        await self._before("get")
        return await self.inner.get(key)

    async def _put(self, key: bytes, block: Block) -> None:
        await self._before("put")
        await self.inner.put(key, block)

    async def _delete(self, key: bytes) -> bool:
        await self._before("delete")
        return await self.inner.delete(key)

    async def _contains(self, key: bytes) -> bool:
        await self._before("contains")
        return await self.inner.contains(key)

    async def _touch_chain(self, keys: Sequence[bytes]) -> None:
        await self.inner.touch_chain(keys)

    async def _pin(self, keys: Sequence[bytes]) -> None:
        await self.inner.pin(keys)

    async def _unpin(self, keys: Sequence[bytes]) -> None:
        await self.inner.unpin(keys)

    async def _aclose(self) -> None:
        await self.inner.aclose()


class LatencyTier(_Wrapper):
    """Forwards to ``inner`` (a :class:`DRAMTier` by default) after ``delay`` seconds per op.

    ``calls`` counts operations by name, so tests can check single flight.
    """

    def __init__(self, inner: Tier | None = None, *, delay: float = 0.01,
                 name: str | None = None) -> None:
        super().__init__(inner if inner is not None else DRAMTier(), name=name)
        self.delay = delay
        self.calls: dict[str, int] = {}

    async def _before(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        await asyncio.sleep(self.delay)


class FailingTier(_Wrapper):
    """Forwards to ``inner`` but raises :class:`TierError` for the operations in ``fail``.

    Set ``fail`` (e.g. ``{"get", "put"}``) at any time to start or stop failing.
    """

    def __init__(self, inner: Tier | None = None, *, fail: set[str] | None = None,
                 name: str | None = None) -> None:
        super().__init__(inner if inner is not None else DRAMTier(), name=name)
        self.fail: set[str] = set(fail or ())
        self.failures = 0

    async def _before(self, op: str) -> None:
        if op in self.fail:
            self.failures += 1
            raise TierError(f"{self.name}: injected {op} failure")

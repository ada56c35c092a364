"""Test support shipped with kvtier: the tier conformance suite and test fakes.

Third-party tier authors subclass :class:`kvtier.testing.conformance.TierConformance` in
their own test suite (requires pytest and pytest-asyncio with ``asyncio_mode = "auto"``).
:mod:`kvtier.testing.slow` slows a tier's worker threads down for the suite's cases of calls
that were given up on.
"""

"""Shared test helpers (real servers, mounts and vLLM stand-ins); no tests live here."""

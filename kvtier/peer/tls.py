"""TLS and mutual-TLS contexts for peer servers and clients (plain ``ssl.SSLContext``)."""

from __future__ import annotations

import ssl

from kvtier.errors import ConfigError

__all__ = ["client_context", "server_context"]


def client_context(ca: str | None = None, cert: str | None = None,
                   key: str | None = None) -> ssl.SSLContext:
    """A client context trusting ``ca`` (system roots when ``None``), presenting ``cert``.

    Raises
    ------
    ConfigError
        If ``key`` is given without ``cert`` or a file cannot be loaded.
    """
    if key is not None and cert is None:
        raise ConfigError("tls_key: given without tls_cert")
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        if cert is not None:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_ca/tls_cert/tls_key: cannot load: {exc}") from exc
    return ctx


def server_context(cert: str, key: str | None = None,
                   client_ca: str | None = None) -> ssl.SSLContext:
    """A server context presenting ``cert``; with ``client_ca`` it requires client certificates
    signed by that CA (mutual TLS).

    Raises
    ------
    ConfigError
        If a file cannot be loaded.
    """
    try:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        if client_ca is not None:
            ctx.load_verify_locations(cafile=client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_cert/tls_key/tls_client_ca: cannot load: {exc}") from exc
    return ctx

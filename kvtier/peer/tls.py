"""TLS and mutual-TLS contexts for peer servers and clients (plain ``ssl.SSLContext``)."""

from __future__ import annotations

import ssl

from kvtier.errors import ConfigError

__all__ = ["client_context", "server_context"]


def _check_readable(**files: str | None) -> None:
    """Name the option and the file that cannot be read (``ssl``'s own errors name neither)."""
    for option, path in files.items():
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"{option}: cannot read {path!r}: {exc.strerror or exc}") from None


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
    _check_readable(tls_ca=ca, tls_cert=cert, tls_key=key)
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        if cert is not None:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_ca/tls_cert/tls_key: cannot load ca {ca!r}, cert {cert!r}, key "
                          f"{key!r}: {exc}") from exc
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
    _check_readable(tls_cert=cert, tls_key=key, tls_client_ca=client_ca)
    try:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        if client_ca is not None:
            ctx.load_verify_locations(cafile=client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_cert/tls_key/tls_client_ca: cannot load cert {cert!r}, key "
                          f"{key!r}, client ca {client_ca!r}: {exc}") from exc
    return ctx

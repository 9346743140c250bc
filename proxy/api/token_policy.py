"""Which bearer tokens the proxy will serve with: refused at start-up, before anything listens.

On any address, a token must be something a client can send exactly: printable ASCII without spaces (RFC
6750's token characters), so no header parser trims or mangles it. On an address other than loopback it must
also be a secret: at least ``MIN_TOKEN_CHARS`` long, not a placeholder from the shipped examples, and not one
character repeated. Without a token the proxy serves only on loopback with ``--insecure-loopback``.
"""

from __future__ import annotations

import ipaddress
import re

from proxy.api.guards import ProxyStartupError

MIN_TOKEN_CHARS = 32
"""``openssl rand -hex 32`` makes 64."""
TOKEN_PATTERN = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
PLACEHOLDER_TOKENS = frozenset({"change-me-to-a-long-random-string"})
"""The example values shipped in deploy/ (a test keeps this list in step with deploy/asyncgrpo.env.example)."""
MAKE_ONE = "make one with `openssl rand -hex 32` and give the same value to the proxy and every worker"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def token_problem(token: str, *, public: bool) -> str | None:
    """Why ``token`` must not be served with (``public``: on a non-loopback address), or None."""
    if not token.strip():
        return "ASYNCGRPO_TOKEN is blank"
    if not TOKEN_PATTERN.match(token):
        return (
            "ASYNCGRPO_TOKEN holds characters a client cannot send exactly in `Authorization: Bearer` "
            "(only letters, digits and -._~+/ with trailing =)"
        )
    if not public:
        return None
    if token in PLACEHOLDER_TOKENS or "change-me" in token.lower() or "changeme" in token.lower():
        return "ASYNCGRPO_TOKEN is still the example's placeholder"
    if len(token) < MIN_TOKEN_CHARS:
        return f"ASYNCGRPO_TOKEN is {len(token)} characters long; at least {MIN_TOKEN_CHARS} are needed"
    if len(set(token)) < 8:
        return "ASYNCGRPO_TOKEN repeats too few characters to be a secret"
    return None


def check_can_serve(host: str, token: str | None, insecure_loopback: bool) -> None:
    """Refuse to serve without a usable token, except on a loopback address with --insecure-loopback."""
    if token is not None:
        problem = token_problem(token, public=not is_loopback(host))
        if problem:
            raise ProxyStartupError(f"{problem}: {MAKE_ONE}")
        return
    if not insecure_loopback:
        raise ProxyStartupError(
            f"ASYNCGRPO_TOKEN is not set: {MAKE_ONE}, or pass --insecure-loopback with --host 127.0.0.1 for a "
            "local test"
        )
    if not is_loopback(host):
        raise ProxyStartupError(
            f"--insecure-loopback is only allowed with a loopback --host (127.0.0.1, ::1, localhost), not "
            f"{host!r}; set ASYNCGRPO_TOKEN to serve on other addresses"
        )

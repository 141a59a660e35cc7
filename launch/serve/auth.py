"""Who may call the service, and as whom. A client is a token: the token file names each one
(`name token` a line, `#` comments), a request carries `Authorization: Bearer <token>`, and the name is
the unit fair queueing serves in turn (queue.py). Without a token file the service accepts anyone as
the one client "local", and only on loopback: bound to anything else it refuses to start."""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path

ANONYMOUS = "local"


class AuthError(ValueError):
    """A token file or bind address the service cannot start with (one line, exit 2)."""


def load_tokens(path: str) -> dict[str, str]:
    """{token: client name} from the token file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise AuthError(f"cannot read serve.token_file {path}: {err.strerror}") from None
    tokens: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise AuthError(f"{path}:{n}: a line is 'name token', two fields")
        name, token = parts
        if len(token) < 16:
            raise AuthError(f"{path}:{n}: the token of {name!r} is shorter than 16 characters")
        if token in tokens:
            raise AuthError(f"{path}:{n}: the token of {name!r} is also {tokens[token]!r}'s")
        tokens[token] = name
    if not tokens:
        raise AuthError(f"serve.token_file {path} holds no token")
    return tokens


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Tokens:
    def __init__(self, host: str, token_file: str) -> None:
        if not token_file and not is_loopback(host):
            raise AuthError(
                f"serve.host {host} is not loopback: set serve.token_file (one 'name token' a line) so that "
                "only your clients can send code to run"
            )
        self.tokens = load_tokens(token_file) if token_file else None

    def client(self, header: str | None) -> str | None:
        """The client a request's Authorization header names; None if it names none we know."""
        if self.tokens is None:
            return ANONYMOUS
        if not header or not header.startswith("Bearer "):
            return None
        given = header[len("Bearer ") :].strip().encode()
        for token, name in self.tokens.items():  # constant time per token: no timing oracle on the prefix
            if hmac.compare_digest(given, token.encode()):
                return name
        return None

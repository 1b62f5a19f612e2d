"""Mosquitto password files in Mosquitto's own ``$7$`` format (PBKDF2-SHA512).

A line is ``username:$7$<iterations>$<base64 salt>$<base64 hash>``, exactly what
``mosquitto_passwd`` (2.0) writes, so the broker and ``mosquitto_passwd -U`` accept our files and an
operator can still edit them with the stock tool.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from ftpipe_iot.fleet.errors import FleetError

# mosquitto_passwd 2.0 defaults: 12-byte salt, 101 iterations, SHA-512 (64-byte digest). The low
# iteration count is Mosquitto's choice (it hashes on every CONNECT); we match it for compatibility.
SALT_BYTES = 12
DEFAULT_ITERATIONS = 101
_PREFIX = "$7$"


def generate_password(nbytes: int = 24) -> str:
    """A random password (URL-safe text, ``nbytes`` of entropy)."""
    return secrets.token_urlsafe(nbytes)


def hash_password(password: str, *, iterations: int = DEFAULT_ITERATIONS,
                  salt: bytes | None = None) -> str:
    """The ``$7$...`` hash of ``password`` as Mosquitto stores it."""
    if not password:
        raise FleetError("refusing to hash an empty password")
    if iterations < 1:
        raise FleetError(f"iterations must be >= 1, got {iterations}")
    salt = salt if salt is not None else os.urandom(SALT_BYTES)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return (f"{_PREFIX}{iterations}${base64.b64encode(salt).decode()}$"
            f"{base64.b64encode(digest).decode()}")


def verify_password(password: str, hashed: str) -> bool:
    """True when ``password`` matches a ``$7$`` hash (constant-time compare)."""
    try:
        _, kind, iterations, salt_b64, digest_b64 = hashed.split("$")
        if kind != "7":
            return False
        salt = base64.b64decode(salt_b64, validate=True)
        expected = base64.b64decode(digest_b64, validate=True)
        got = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, int(iterations))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, expected)


def read_password_file(path: Path) -> dict[str, str]:
    """``{username: hash}`` from a Mosquitto password file (missing file -> empty)."""
    entries: dict[str, str] = {}
    if not path.exists():
        return entries
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        user, sep, hashed = line.partition(":")
        if not sep or not user:
            raise FleetError(f"{path}:{lineno}: not a 'user:hash' line")
        entries[user] = hashed
    return entries


def write_password_file(path: Path, entries: dict[str, str]) -> None:
    """Write ``entries`` atomically, mode 0600 (the hashes are offline-attackable)."""
    for user in entries:
        if ":" in user or "\n" in user:
            raise FleetError(f"username {user!r} cannot be stored in a password file")
    text = "".join(f"{user}:{hashed}\n" for user, hashed in sorted(entries.items()))
    write_private(path, text)


def write_private(path: Path, text: str | bytes, mode: int = 0o600) -> None:
    """Write a file atomically with ``mode`` set before any secret byte lands on disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    data = text.encode() if isinstance(text, str) else text
    old = path.stat() if path.exists() else None
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # O_CREAT's mode is masked by umask; fchmod is not
        if old is not None and os.geteuid() == 0:
            # Keep the owner (e.g. the broker's user) so a SIGHUP reload can still read it.
            os.fchown(fd, old.st_uid, old.st_gid)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)

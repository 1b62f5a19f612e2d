"""Who sent a message, proven end to end on any broker (docs/security.md, docs/design.md §4).

Every identity (the controller, each device) holds its own Ed25519 private key. A frame is signed
over its header fields and a SHA-256 digest of its payload, so a chunked tensor is hashed once and
each chunk carries its own signature: a receiver verifies every frame before it reassembles or
reads anything. The public keys are a *roster* (identity name -> accepted keys, and which names
speak for the controller). A device starts with the roster of its bundle, which holds at least
the controller's key; the controller publishes the current roster (retained, signed by itself),
so devices added or re-keyed later are known without touching the other devices.

Replay: a frame binds job, sender, plan version, the sender's *session* (the millisecond its
process started) and a sequence number. ``ReplayGuard`` drops a live message from an older session
of its sender or one whose sequence number is not newer than the last one taken on that topic; a
retained copy (the broker's stored one, maybe from before a restart) is checked only against what
was already taken on its topic. A Last Will is the session's closing word, published by the broker
whenever the connection ends, so it is exempt from the per-topic order but not from the session.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from ftpipe_iot.errors import BadSignature, ConfigError

# Names the controller's key speaks for: the pipeline's controller and the coordinator of the
# collaborative modes (one job has one of them; a standby controller holds the same key).
CONTROLLER_NAMES = ("controller", "coordinator")
KEY_ID_BYTES = 8
SIGNATURE_BYTES = 64
_DOMAIN = b"ftpipe-iot frame v1"


def payload_digest(payload: bytes) -> bytes:
    """The digest a signature covers instead of the payload itself (hashed once). SHA-256:
    CPUs with SHA extensions (x86 SHA-NI, ARMv8 crypto, as on a Raspberry Pi 4/5 or a Jetson)
    hash it at 2-3x the speed of BLAKE2b, and activations are megabytes per message."""
    return hashlib.sha256(payload).digest()


def signed_content(header: list[object], payload: bytes) -> bytes:
    """The exact bytes an Ed25519 signature of a frame covers: a domain tag, the header fields
    in a fixed order and the payload's digest."""
    return msgpack.packb([_DOMAIN, *header, payload_digest(payload)], use_bin_type=True)


# -- keys ----------------------------------------------------------------------------------------
def generate_private_key() -> Ed25519PrivateKey:
    """A new Ed25519 private key."""
    return Ed25519PrivateKey.generate()


def public_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """A public key as the roster writes it: base64 of its 32 raw bytes."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def parse_public(text: str, where: str = "roster") -> Ed25519PublicKey:
    """Parse a public key written by ``public_text``."""
    try:
        raw = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {text!r:.20} is not a base64 Ed25519 public key") from exc


def key_id(key: Ed25519PrivateKey | Ed25519PublicKey | str) -> bytes:
    """The short id a frame names its signing key by (a sender may have two during rotation)."""
    text = key if isinstance(key, str) else public_text(key)
    return hashlib.sha256(text.encode()).digest()[:KEY_ID_BYTES]


def write_private_key(path: Path, key: Ed25519PrivateKey) -> None:
    """Write ``key`` as PKCS#8 PEM, mode 0600 before any byte lands (replacing atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, pem)
    finally:
        os.close(fd)
    os.replace(temporary, path)


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Load a signing key written by ``write_private_key`` (one-line error otherwise)."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as exc:
        raise ConfigError(f"cannot read signing key {path}: {exc.strerror or exc}") from exc
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"signing key {path} is not a PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"signing key {path} is not an Ed25519 key")
    return key


# -- the roster ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Roster:
    """Who may sign as whom: identity name -> accepted public keys (newest first; two during a
    rotation), and the names that speak for the controller (they alone may publish a roster).
    ``version`` grows with every change (milliseconds), so an old roster never replaces a newer
    one."""

    version: int
    identities: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    controllers: tuple[str, ...] = CONTROLLER_NAMES

    def keys_of(self, name: str) -> tuple[str, ...]:
        return tuple(self.identities.get(name, ()))

    def with_key(self, names: Iterable[str], key: str, keep_previous: bool = True) -> Roster:
        """This roster with ``key`` as the newest key of every name in ``names`` (the previous
        newest one kept while ``keep_previous``, so a running process switches without a gap)."""
        identities = dict(self.identities)
        for name in names:
            old = [k for k in identities.get(name, ()) if k != key]
            identities[name] = (key, *old[:1]) if keep_previous else (key,)
        return Roster(_next_version(self.version), identities, self.controllers)

    def without(self, name: str) -> Roster:
        identities = {n: keys for n, keys in self.identities.items() if n != name}
        return Roster(_next_version(self.version), identities, self.controllers)

    def to_dict(self) -> dict[str, object]:
        return {"version": self.version, "controllers": list(self.controllers),
                "identities": {name: list(keys) for name, keys in sorted(self.identities.items())}}

    @classmethod
    def from_dict(cls, raw: object, where: str = "roster") -> Roster:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} is not a JSON object")
        version, identities, controllers = raw.get("version"), raw.get("identities"), \
            raw.get("controllers", list(CONTROLLER_NAMES))
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(f"{where}: version must be an integer >= 0")
        if not isinstance(identities, Mapping) or not isinstance(controllers, list):
            raise ConfigError(f"{where}: needs 'identities' (name -> keys) and 'controllers'")
        parsed: dict[str, tuple[str, ...]] = {}
        for name, keys in identities.items():
            if not isinstance(name, str) or not isinstance(keys, list) or not keys:
                raise ConfigError(f"{where}: identity {name!r} needs a list of keys")
            for key in keys:
                parse_public(key, f"{where}, identity {name!r}")
            parsed[name] = tuple(keys)
        if not all(isinstance(c, str) for c in controllers):
            raise ConfigError(f"{where}: controllers must be names")
        return cls(version, parsed, tuple(controllers))

    @classmethod
    def load(cls, path: Path) -> Roster:
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read roster {path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"roster {path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw, f"roster {path}")

    def save(self, path: Path) -> None:
        """Write the roster (public keys only: no secret) atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(temporary, path)


def _next_version(previous: int) -> int:
    return max(previous + 1, int(time.time() * 1000))


# -- signing and verifying -----------------------------------------------------------------------
class Signer:
    """One identity's signing key and session. The key file is re-read when it changes
    (``fleet rotate-key``), so a running process switches keys without a restart."""

    def __init__(self, key: Ed25519PrivateKey, path: Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._key = key
        self._path = Path(path) if path is not None else None
        self._mtime = self._path.stat().st_mtime_ns if self._path is not None else 0
        self.key_id = key_id(key)
        self.public = public_text(key)
        self.busy_s = 0.0  # seconds spent hashing and signing (the cost of signatures)
        # Millisecond of the process start: a restarted sender's messages are newer than the
        # last incarnation's (device clocks must not go back: NTP before the agent starts).
        self.session = int(clock() * 1000)

    @classmethod
    def from_file(cls, path: Path) -> Signer:
        return cls(load_private_key(path), path)

    def sign(self, content: bytes) -> bytes:
        return self._key.sign(content)

    def sign_frame(self, header: list[object], payload: bytes) -> bytes:
        """The signature of one frame (``signed_content``), its time added to ``busy_s``."""
        started = time.perf_counter()
        signature = self._key.sign(signed_content(header, payload))
        self.busy_s += time.perf_counter() - started
        return signature

    def reload_if_changed(self, accepted: Callable[[str], bool] = lambda _public: True) -> bool:
        """Take a rotated key file once ``accepted`` says the others know its public key (the
        roster in force lists it), so no message is signed with a key nobody can check yet;
        True when the key changed."""
        if self._path is None:
            return False
        try:
            mtime = self._path.stat().st_mtime_ns
        except OSError:
            return False
        if mtime == self._mtime:
            return False
        key = load_private_key(self._path)
        if public_text(key) == self.public:
            self._mtime = mtime
            return False
        if not accepted(public_text(key)):
            return False  # looked at again at the next check
        self._mtime = mtime
        self._key, self.key_id, self.public = key, key_id(key), public_text(key)
        return True


class Verifier:
    """Checks frame signatures against the roster in force."""

    def __init__(self, roster: Roster) -> None:
        self.roster = roster
        self._keys: dict[tuple[str, bytes], Ed25519PublicKey] = {}
        self.take(roster)

    def take(self, roster: Roster) -> None:
        """Put ``roster`` in force (no questions asked: callers decide whether to)."""
        self.roster = roster
        self._keys = {(name, key_id(text)): parse_public(text)
                      for name, keys in roster.identities.items() for text in keys}

    def verify(self, sender: str, kid: bytes | None, content: bytes,
               signature: bytes | None) -> None:
        """Raise ``BadSignature`` unless ``signature`` is ``sender``'s over ``content``."""
        if signature is None or kid is None:
            raise BadSignature(f"unsigned message from {sender!r}")
        public = self._keys.get((sender, bytes(kid)))
        if public is None:
            known = "no key" if not self.roster.keys_of(sender) else "not this key"
            raise BadSignature(f"the roster has {known} for sender {sender!r}")
        try:
            public.verify(bytes(signature), content)
        except InvalidSignature as exc:
            raise BadSignature(f"signature of {sender!r} does not verify") from exc

    def is_controller(self, sender: str) -> bool:
        return sender in self.roster.controllers

    def offer(self, roster: Roster, sender: str) -> bool:
        """Take a roster published by ``sender`` (whose frame already verified) when it speaks
        for the controller and is newer than the one in force."""
        if not self.is_controller(sender) or roster.version <= self.roster.version:
            return False
        self.take(roster)
        return True


class ReplayGuard:
    """Drops replayed messages (see the module docstring for the rule)."""

    def __init__(self) -> None:
        self._sessions: dict[str, int] = {}
        self._last: dict[tuple[str, str], tuple[int, int]] = {}

    def check(self, sender: str, topic: str, session: int, seq: int, retained: bool,
              will: bool) -> str | None:
        """None when the message may be used (and remember it), else why it is a replay."""
        mark = (session, seq)
        key = (sender, topic)
        last = self._last.get(key)
        if not retained:
            newest = self._sessions.get(sender, 0)
            if session < newest:
                return f"from an earlier session of {sender!r} ({session} < {newest})"
            self._sessions[sender] = session
        if will:
            return None
        if last is not None and (mark < last or (mark == last and not retained)):
            return f"sequence {seq} of {sender!r} on {topic} is not newer than {last[1]}"
        self._last[key] = mark
        return None


@dataclass
class Credentials:
    """What a process signs with and verifies against. ``roster_file`` is set where the process
    publishes the roster (the controller) and re-reads it when it changes."""

    signer: Signer | None = None
    verifier: Verifier | None = None
    roster_file: Path | None = None
    _roster_mtime: int = 0

    @property
    def signing(self) -> bool:
        return self.signer is not None

    @classmethod
    def unsigned(cls) -> Credentials:
        """No signatures made or checked (``--insecure-unsigned``, unit tests)."""
        return cls()

    @classmethod
    def load(cls, key_file: Path, roster_file: Path, publishes_roster: bool = False
             ) -> Credentials:
        """An identity's key and the roster it trusts (one-line errors for bad files)."""
        signer = Signer.from_file(key_file)
        roster = Roster.load(roster_file)
        if not any(roster.keys_of(name) for name in roster.controllers):
            raise ConfigError(f"roster {roster_file} names no controller key")
        credentials = cls(signer, Verifier(roster),
                          Path(roster_file) if publishes_roster else None)
        credentials._roster_mtime = _mtime(credentials.roster_file)
        return credentials

    def roster_changed(self) -> Roster | None:
        """The roster file's new content when it changed since the last call (controller)."""
        if self.roster_file is None or self.verifier is None:
            return None
        mtime = _mtime(self.roster_file)
        if mtime == self._roster_mtime:
            return None
        self._roster_mtime = mtime
        roster = Roster.load(self.roster_file)
        if roster.version <= self.verifier.roster.version:
            return None
        self.verifier.take(roster)
        return roster


def _mtime(path: Path | None) -> int:
    if path is None:
        return 0
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0

"""Who sent a message, proven end to end on any broker (docs/security.md, docs/design.md §4).

Every identity (the controller, each device) holds its own Ed25519 private key. A frame is signed
over its header fields and a SHA-256 digest of its payload, so a chunked tensor is hashed once and
each chunk carries its own signature: a receiver verifies every frame before it reassembles or
reads anything. The public keys are a *roster* (identity name -> accepted keys, and which names
speak for the controller). A device starts with the roster of its bundle, which holds at least
the controller's key; the controller publishes the current roster (retained, signed by itself),
so devices added or re-keyed later are known without touching the other devices.

Messages to known receivers (a stage's inputs, gradients and group partials, results for the
controller: the hot path, dozens a step) may carry, instead of a signature, one AES-GMAC tag per
receiver, keyed by the X25519 agreement of sender and receiver (each identity's X25519 key is
derived from its Ed25519 key; the roster carries both public keys). Only the two of them know
that key, so a tag proves the sender to that receiver exactly as a signature would, and a
compromised device can still forge only itself; a tag costs microseconds where an Ed25519
verification costs a hundred. Broadcast and retained messages (plans, state, weights, statuses,
heartbeats, commands, the roster) keep their signatures: their readers are not known in advance.

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
import hmac
import itertools
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ftpipe_iot.errors import BadSignature, ConfigError

# Names the controller's key speaks for: the pipeline's controller and the coordinator of the
# collaborative modes (one job has one of them; a standby controller holds the same key).
CONTROLLER_NAMES = ("controller", "coordinator")
KEY_ID_BYTES = 8
_DOMAIN = b"ftpipe-iot frame v1"
_TAG_DOMAIN = b"ftpipe-iot tag v2"
NONCE_BYTES = 12
TAG_BYTES = 16


def payload_digest(payload: bytes) -> bytes:
    """The digest a signature covers instead of the payload itself (hashed once). SHA-256:
    CPUs with SHA extensions (x86 SHA-NI, ARMv8 crypto, as on a Raspberry Pi 4/5 or a Jetson)
    hash it at 2-3x the speed of BLAKE2b, and activations are megabytes per message."""
    return hashlib.sha256(payload).digest()


@dataclass(frozen=True)
class TagContent:
    """What a per-receiver tag covers: a domain tag and the header fields (``header``, packed)
    and the payload itself. They are kept apart: the tag is AES-GCM's over the payload as
    associated data and the header as the text, so no copy of a megabyte payload is made to
    put the two together, and a GMAC runs over the payload at memory speed (no digest first)."""

    header: bytes
    payload: bytes


class _HeaderPacker(threading.local):
    """One msgpack packer per thread for the few hundred bytes a frame's proof covers.
    ``msgpack.packb`` makes a packer with a 256 KiB buffer on every call: 20 us a header
    where a computation has just evicted the caches (a 32 MB array summed between calls),
    against 5 us for a packer kept, and a seal and a check each pack one. Per thread: a
    packer holds its buffer between calls, and the worker and the heartbeat thread seal at
    once."""

    def __init__(self) -> None:
        self.packer = msgpack.Packer(use_bin_type=True, autoreset=True)

    def pack(self, fields: list[object]) -> bytes:
        return self.packer.pack(fields)


_header_packer = _HeaderPacker()


def tag_content(header: list[object], payload: bytes) -> TagContent:
    """The content a per-receiver tag covers (``TagContent``)."""
    return TagContent(_header_packer.pack([_TAG_DOMAIN, *header]), payload)


def signed_content(header: list[object], payload: bytes) -> bytes:
    """The exact bytes an Ed25519 signature of a frame covers: a domain tag, the header fields
    in a fixed order and the payload's digest."""
    return _header_packer.pack([_DOMAIN, *header, payload_digest(payload)])


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


def agreement_key(key: Ed25519PrivateKey) -> X25519PrivateKey:
    """The identity's X25519 key, derived from its Ed25519 key (one key file per identity)."""
    seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())
    derived = HKDF(hashes.SHA256(), 32, salt=None, info=b"ftpipe-iot x25519 v1").derive(seed)
    return X25519PrivateKey.from_private_bytes(derived)


def _raw_text(public: X25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


@dataclass(frozen=True)
class IdentityKey:
    """The public half of one identity key: Ed25519 to verify signatures, X25519 to agree on
    the pairwise MAC keys."""

    sign: str
    agree: str

    @classmethod
    def of(cls, key: Ed25519PrivateKey) -> IdentityKey:
        return cls(public_text(key), _raw_text(agreement_key(key).public_key()))

    def to_dict(self) -> dict[str, str]:
        return {"sign": self.sign, "agree": self.agree}

    @classmethod
    def from_dict(cls, raw: object, where: str) -> IdentityKey:
        if not isinstance(raw, Mapping) or not isinstance(raw.get("sign"), str) or \
                not isinstance(raw.get("agree"), str):
            raise ConfigError(f"{where}: a key is {{\"sign\": ..., \"agree\": ...}}")
        parse_public(raw["sign"], where)
        _parse_agreement(raw["agree"], where)
        return cls(raw["sign"], raw["agree"])


def _parse_agreement(text: str, where: str) -> X25519PublicKey:
    try:
        return X25519PublicKey.from_public_bytes(base64.b64decode(text, validate=True))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {text!r:.20} is not a base64 X25519 public key") from exc


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
    identities: Mapping[str, tuple[IdentityKey, ...]] = field(default_factory=dict)
    controllers: tuple[str, ...] = CONTROLLER_NAMES

    def keys_of(self, name: str) -> tuple[IdentityKey, ...]:
        return tuple(self.identities.get(name, ()))

    def signs_with(self, name: str, public: str) -> bool:
        """Whether ``public`` (an Ed25519 public key) is one of ``name``'s keys."""
        return any(key.sign == public for key in self.keys_of(name))

    def with_key(self, names: Iterable[str], key: IdentityKey,
                 keep_previous: bool = True) -> Roster:
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
                "identities": {name: [key.to_dict() for key in keys]
                               for name, keys in sorted(self.identities.items())}}

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
        parsed: dict[str, tuple[IdentityKey, ...]] = {}
        for name, keys in identities.items():
            if not isinstance(name, str) or not isinstance(keys, list) or not keys:
                raise ConfigError(f"{where}: identity {name!r} needs a list of keys")
            parsed[name] = tuple(IdentityKey.from_dict(key, f"{where}, identity {name!r}")
                                 for key in keys)
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
#: One proof or check in this many is timed (``CpuSampler``).
CRYPTO_SAMPLE_EVERY = 8


class CpuSampler:
    """Times what signatures cost by sampling: one call in ``every``, picked at random, is
    timed with the thread's CPU clock (preemption by other processes does not count) and
    counts ``every`` times. The clock is a system call of about a microsecond, as long as a
    tag itself, and timing every frame made a quarter of what signing added to a message; a
    random pick, not every n-th frame, keeps each message kind's total unbiased where a
    step sends its messages in a fixed order."""

    def __init__(self, every: int = CRYPTO_SAMPLE_EVERY, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.thread_time) -> None:
        if every < 1:
            raise ConfigError(f"a crypto sample is one call in every n >= 1, got {every}")
        self.every = every
        self._chance = 1.0 / every
        self._rng = rng or random.Random()
        self._clock = clock

    def start(self) -> float | None:
        """The clock when this call is timed, else None."""
        if self.every == 1 or self._rng.random() < self._chance:
            return self._clock()
        return None

    def seconds(self, started: float | None) -> float:
        """The CPU seconds to count for a call begun with ``start``."""
        return 0.0 if started is None else (self._clock() - started) * self.every


class NonceSequence:
    """AES-GCM nonces for the frames one process tags: a 96-bit counter started at a random
    point, so no system call per frame. ``os.urandom`` per frame took as much of a tag's time
    in a running device as the MAC itself (a cold system call: median 3.5 us, a tenth of the
    calls over 14 us, a few over a millisecond while the network thread held the GIL). A nonce
    must never repeat under a key; a pairwise key is shared by two peers and outlives their
    processes, so every process of either peer draws its own start: two processes' runs of n
    nonces overlap with probability about 2n / 2**96, less than random nonces drawn per frame
    would give."""

    _SPACE = 1 << (8 * NONCE_BYTES)

    def __init__(self, start: bytes | None = None) -> None:
        first = start if start is not None else os.urandom(NONCE_BYTES)
        if len(first) != NONCE_BYTES:
            raise ConfigError(f"a nonce start is {NONCE_BYTES} bytes, got {len(first)}")
        # itertools.count is advanced atomically under the GIL: threads sealing at once (the
        # worker and the heartbeat) never take the same value
        self._counter = itertools.count(int.from_bytes(first, "big"))

    def next(self) -> bytes:
        """The next nonce (wrapping around the 96-bit space)."""
        return (next(self._counter) % self._SPACE).to_bytes(NONCE_BYTES, "big")


class Signer:
    """One identity's signing key and session. The key file is re-read when it changes
    (``fleet rotate-key``), so a running process switches keys without a restart."""

    def __init__(self, key: Ed25519PrivateKey, path: Path | None = None,
                 clock: Callable[[], float] = time.time,
                 sampler: CpuSampler | None = None) -> None:
        self._key = key
        self._path = Path(path) if path is not None else None
        self._mtime = self._path.stat().st_mtime_ns if self._path is not None else 0
        self.key_id = key_id(key)
        self.public = public_text(key)
        self.agreement = agreement_key(key)
        self.previous_agreement: X25519PrivateKey | None = None  # until peers know the new key
        # CPU seconds spent hashing, signing and tagging (what signatures cost), sampled; the
        # process's checks of others' frames are timed by the same sampler
        self.busy_s = 0.0
        self.sampler = sampler or CpuSampler()
        self.nonces = NonceSequence()
        # Millisecond of the process start: a restarted sender's messages are newer than the
        # last incarnation's (device clocks must not go back: NTP before the agent starts).
        self.session = int(clock() * 1000)

    @classmethod
    def from_file(cls, path: Path) -> Signer:
        return cls(load_private_key(path), path)

    def sign(self, content: bytes) -> bytes:
        return self._key.sign(content)

    def seal(self, header: list[object], payload: bytes) -> dict[str, object]:
        """The frame fields that prove one frame: the key id and the Ed25519 signature of
        ``signed_content``; the CPU time it took is added to ``busy_s``."""
        started = self.sampler.start()
        signature = self._key.sign(signed_content(header, payload))
        self.busy_s += self.sampler.seconds(started)
        return {"kid": self.key_id, "sg": signature}

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
        self.previous_agreement = self.agreement
        self._key, self.key_id, self.public = key, key_id(key), public_text(key)
        self.agreement = agreement_key(key)
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
        self._keys = {(name, key_id(key.sign)): parse_public(key.sign)
                      for name, keys in roster.identities.items() for key in keys}
        self._agree = {(name, key_id(key.sign)): _parse_agreement(key.agree, "roster")
                       for name, keys in roster.identities.items() for key in keys}
        self._newest_agree = {name: self._agree[(name, key_id(keys[0].sign))]
                              for name, keys in roster.identities.items() if keys}

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

    def agreement_of(self, name: str, kid: bytes | None = None) -> X25519PublicKey | None:
        """``name``'s X25519 key: the one paired with signing key ``kid``, else its newest."""
        if kid is None:
            return self._newest_agree.get(name)
        return self._agree.get((name, bytes(kid)))

    def is_controller(self, sender: str) -> bool:
        return sender in self.roster.controllers

    def offer(self, roster: Roster, sender: str) -> bool:
        """Take a roster published by ``sender`` (whose frame already verified) when it speaks
        for the controller and is newer than the one in force."""
        if not self.is_controller(sender) or roster.version <= self.roster.version:
            return False
        self.take(roster)
        return True


class Sealer(Protocol):
    """What proves a frame: ``seal`` returns the frame fields to add (key id and a signature,
    or key id and per-receiver tags)."""

    def seal(self, header: list[object], payload: bytes) -> dict[str, object]: ...


class PairwiseKeys:
    """The AES-GCM key an identity shares with each peer: HKDF of their X25519 agreement,
    bound to both names; computed once per pair of keys."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str, int, int], tuple[AESGCM, object, object]] = {}

    def key(self, own_name: str, own: X25519PrivateKey, peer_name: str,
            peer: X25519PublicKey) -> AESGCM:
        # Keyed by the key objects' identities (deriving public bytes to compare would cost a
        # scalar multiplication per message); the entry holds both objects, so no id is reused.
        pair = (own_name, peer_name, id(own), id(peer))
        cached = self._cache.get(pair)
        if cached is None:
            names = "|".join(sorted((own_name, peer_name))).encode()
            derived = HKDF(hashes.SHA256(), 32, salt=b"ftpipe-iot mac v1",
                           info=names).derive(own.exchange(peer))
            cached = self._cache[pair] = (AESGCM(derived), own, peer)
        return cached[0]


def mac_tag(key: AESGCM, nonce: bytes, content: TagContent) -> bytes:
    """AES-GCM's 16-byte tag over ``content``: the payload as associated data, the header as
    the text (its ciphertext is dropped; the tag covers both). With AES instructions several
    GB/s. ``nonce`` is never reused under a key (``NonceSequence``)."""
    return key.encrypt(nonce, content.header, content.payload)[-TAG_BYTES:]


class _PairwiseSeal:
    """Seals frames for known receivers with one tag each (and, with ``also_sign``, a signature
    for everyone else: a retained message read by known devices now and by anyone later)."""

    def __init__(self, name: str, signer: Signer, pairwise: PairwiseKeys,
                 peers: list[tuple[str, X25519PublicKey]], also_sign: bool = False) -> None:
        self.name = name
        self.signer = signer
        self.pairwise = pairwise
        self.peers = peers
        self.also_sign = also_sign

    def seal(self, header: list[object], payload: bytes) -> dict[str, object]:
        started = self.signer.sampler.start()
        content = tag_content(header, payload)
        nonce = self.signer.nonces.next()
        own = self.signer.agreement
        tags = {name: mac_tag(self.pairwise.key(self.name, own, name, peer), nonce, content)
                for name, peer in self.peers}
        fields: dict[str, object] = {"kid": self.signer.key_id, "mac": tags, "mn": nonce}
        if self.also_sign:
            fields["sg"] = self.signer.sign(signed_content(header, payload))
        self.signer.busy_s += self.signer.sampler.seconds(started)
        return fields


class ReplayGuard:
    """Drops replayed messages (see the module docstring for the rule)."""

    def __init__(self) -> None:
        self._sessions: dict[str, int] = {}
        self._last: dict[tuple[str, str], tuple[int, int]] = {}

    def current(self, sender: str, session: int) -> bool:
        """Whether ``session`` is not older than the newest taken from ``sender``."""
        return session >= self._sessions.get(sender, 0)

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

    pairwise: PairwiseKeys | None = None
    # The signing key each peer last proved a live frame with: tags for it are made with that
    # key's agreement half, the one it is known to hold. During a rotation the roster names the
    # new key before the peer has loaded it (it looks at its key file once a second), and a tag
    # for a key it does not hold yet would be dropped as forged.
    peer_keys: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.signer is not None and self.pairwise is None:
            self.pairwise = PairwiseKeys()

    def heard_key(self, peer: str, kid: bytes | None) -> None:
        """``peer`` proved a live frame with signing key ``kid``."""
        if kid is not None:
            self.peer_keys[peer] = bytes(kid)

    def sealer(self, name: str, receivers: Iterable[str] | None = None,
               also_sign: bool = False) -> Sealer | None:
        """How ``name`` proves a frame: tags for ``receivers`` when every one of them is in the
        roster (and its signature too with ``also_sign``), else (or without receivers) its
        signature; None when unsigned."""
        signer = self.signer
        if signer is None:
            return None
        if receivers is None or self.verifier is None or self.pairwise is None:
            return signer
        peers = []
        for receiver in receivers:
            # the key it last proved itself with, while the roster still lists it; else its
            # newest (a peer not heard from yet, or one whose old key has left the roster)
            public = self.verifier.agreement_of(receiver, self.peer_keys.get(receiver)) or \
                self.verifier.agreement_of(receiver)
            if public is None:
                return signer  # a receiver we cannot tag for still checks a signature
            peers.append((receiver, public))
        return _PairwiseSeal(name, signer, self.pairwise, peers, also_sign)

    def check_tag(self, sender: str, kid: bytes | None, receiver: str, content: TagContent,
                  tags: Mapping[str, bytes], nonce: bytes | None) -> None:
        """Raise ``BadSignature`` unless ``tags`` holds ``receiver``'s valid tag from
        ``sender`` over ``content`` (``tag_content``) with ``nonce``."""
        tag = tags.get(receiver)
        if tag is None:
            raise BadSignature(f"message of {sender!r} carries no tag for {receiver!r}")
        if nonce is None or len(nonce) != NONCE_BYTES:
            raise BadSignature(f"tagged message of {sender!r} without a valid nonce")
        peer = self.verifier.agreement_of(sender, kid) if self.verifier and kid else None
        if peer is None:
            raise BadSignature(f"the roster has no key {kid!r:.30} for sender {sender!r}")
        assert self.signer is not None and self.pairwise is not None
        for own in (self.signer.agreement, self.signer.previous_agreement):
            if own is None:
                continue
            expected = mac_tag(self.pairwise.key(receiver, own, sender, peer), nonce, content)
            if hmac.compare_digest(expected, bytes(tag)):
                return
        raise BadSignature(f"tag of {sender!r} for {receiver!r} does not verify")

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

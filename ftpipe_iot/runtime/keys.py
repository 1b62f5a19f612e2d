"""Signing keys for the processes this machine starts (the demo, tests, benchmarks): one private
key per identity and one roster in a directory of the run. A fleet gets its keys from
``ftpipe-iot fleet`` instead (``fleet.fleet``); the files have the same format."""

from __future__ import annotations

import threading
from pathlib import Path

from ftpipe_iot.protocol.signing import (
    CONTROLLER_NAMES,
    IdentityKey,
    Roster,
    generate_private_key,
    write_private_key,
)

CONTROLLER_KEY = "controller"


class LocalKeys:
    """``directory`` holds ``<identity>.key`` (0600) and ``roster.json``. A key is made the first
    time an identity asks for its arguments, and the roster grows with it (the controller
    re-reads the roster file and republishes it)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        self.roster_path = self.directory / "roster.json"
        self._lock = threading.Lock()
        if self.roster_path.exists():
            self.roster = Roster.load(self.roster_path)
        else:
            self.roster = Roster(0)
            self._add(CONTROLLER_KEY, CONTROLLER_NAMES)

    def _add(self, key_name: str, names: tuple[str, ...]) -> Path:
        path = self.directory / f"{key_name}.key"
        key = generate_private_key()
        write_private_key(path, key)
        self.roster = self.roster.with_key(names, IdentityKey.of(key), keep_previous=False)
        self.roster.save(self.roster_path)
        return path

    def key_path(self, name: str) -> Path:
        """The private key of identity ``name`` (made now if it has none)."""
        with self._lock:
            path = self.directory / f"{name}.key"
            if name in CONTROLLER_NAMES:
                return self.directory / f"{CONTROLLER_KEY}.key"
            if not path.exists() or not self.roster.keys_of(name):
                path = self._add(name, (name,))
            return path

    def args(self, name: str) -> list[str]:
        """``--signing-key`` and ``--roster`` for the process of identity ``name``."""
        return ["--signing-key", str(self.key_path(name)), "--roster", str(self.roster_path)]

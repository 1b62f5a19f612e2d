"""Exception types of the fleet package. Every message says what is wrong and what to do."""

from __future__ import annotations

from enum import Enum

from ftpipe_iot.errors import FtpipeError


class FleetError(FtpipeError):
    """A fleet operation failed; ``str(exc)`` is a complete, user-facing explanation."""


class UnknownIdentityError(FleetError, KeyError):
    """An identity (device, controller or operator) name is not in the fleet."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else "unknown identity"


class CheckFailure(str, Enum):
    """Why a connection check failed (the vocabulary of ``ConnectionCheckError.kind``)."""

    CONFIG = "config"                  # the bundle itself is unusable (missing file, bad key)
    WRONG_CA = "wrong-ca"              # broker cert not signed by the bundle's CA
    HOSTNAME = "hostname"              # broker cert does not name the host we dialled
    CERT_EXPIRED = "cert-expired"      # our client cert (or the broker's) is outside its validity
    CERT_MISMATCH = "cert-mismatch"    # client cert/key do not match, or cert not from this CA
    CERT_REJECTED = "cert-rejected"    # broker refused our client certificate during TLS
    BAD_CREDENTIALS = "bad-credentials"  # CONNACK: bad username/password or not authorised
    REFUSED = "refused"                # TCP refused / broker closed the connection
    TIMEOUT = "timeout"                # no answer in time
    TLS = "tls"                        # any other TLS failure


class ConnectionCheckError(FleetError):
    """``check_connection`` could not connect; ``kind`` classifies the cause."""

    def __init__(self, kind: CheckFailure, message: str) -> None:
        super().__init__(message)
        self.kind = kind

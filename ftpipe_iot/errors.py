"""Every error the project raises on purpose, under one root: ``FtpipeError``.

The CLI catches ``FtpipeError`` once and prints its message as a one-line error; anything else is
a bug and keeps its traceback. Each class also derives from the built-in type callers caught
before the root existed (``ValueError``, ``ConnectionError``, ``RuntimeError``), so library users'
``except ValueError`` keeps working. Errors of incoming messages carry ``reason``: the label of
``ftpipe_messages_dropped_total`` under which the message is counted.
"""

from __future__ import annotations

from ftpipe_iot.protocol.vocab import DropReason


class FtpipeError(Exception):
    """Root of the project's errors; ``str(exc)`` is a complete, user-facing sentence."""


# -- configuration and user input ----------------------------------------------------------------
class ConfigError(FtpipeError, ValueError):
    """A connection or process setting is wrong; the message says which and why."""


class PlanError(FtpipeError, ValueError):
    """A plan or a training setting is invalid; the message says which."""


class ModelError(FtpipeError, ValueError):
    """The model choice is wrong or does not fit the data; the message says how."""


class DataError(FtpipeError, ValueError):
    """The data choice is wrong or the file does not hold usable data; the message says how."""


class ProfileError(FtpipeError, ValueError):
    """A device profile is wrong; the message says which value and why."""


class PartitionError(FtpipeError, ValueError):
    """The partition problem is malformed (bad costs, devices or assignment)."""


class InfeasiblePartitionError(PartitionError):
    """No assignment of the layers to the devices fits the memory budgets."""


class FaultSpecError(FtpipeError, ValueError):
    """A fault spec that does not parse; the message shows the syntax."""


class PrivacyError(FtpipeError, ValueError):
    """A differential-privacy setting is wrong or cannot apply to the model; the message says
    which and why."""


class CollabError(FtpipeError, ValueError):
    """A collaborative or federated job cannot be set up as asked (no valid split point, a device
    with too few samples, a missing server); the message says why."""


class ReportError(FtpipeError, ValueError):
    """A run summary cannot be reported on (the message says which part is wrong)."""


# -- incoming messages (dropped and counted under ``reason``) ------------------------------------
class WireError(FtpipeError, ValueError):
    """A frame or message body that cannot be used."""

    reason = DropReason.MALFORMED


class MalformedFrame(WireError):
    """Bytes that are not a frame of this protocol."""

    reason = DropReason.MALFORMED


class UnknownVersion(WireError):
    """A frame of another protocol version."""

    reason = DropReason.UNKNOWN_VERSION


class UnknownKind(WireError):
    """A frame whose message kind this build does not know."""

    reason = DropReason.UNKNOWN_KIND


class BadChecksum(WireError):
    """A reassembled message whose checksum does not match."""

    reason = DropReason.BAD_CHECKSUM


class Oversized(WireError):
    """A frame or body beyond the configured limits."""

    reason = DropReason.OVERSIZED


class BadSignature(WireError):
    """A frame without a valid signature of its sender (docs/security.md)."""

    reason = DropReason.BAD_SIGNATURE


class Replayed(WireError):
    """A validly signed message seen before, or from an earlier session of its sender."""

    reason = DropReason.REPLAYED


class BadBody(WireError):
    """A well-formed frame whose body misses a field or holds a value of the wrong type/range."""

    reason = DropReason.BAD_BODY


class StageInputError(FtpipeError, ValueError):
    """An input a stage cannot use (wrong shape, duplicate, unexpected micro-batch)."""

    def __init__(self, reason: DropReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# -- processes and connections -------------------------------------------------------------------
class TransportError(FtpipeError, ConnectionError):
    """The broker could not be reached or refused us; the message says why."""


class BrokerError(FtpipeError, RuntimeError):
    """The broker could not be started or did not come up."""


class TrainingDiverged(FtpipeError, ArithmeticError):
    """The training loss stopped being a finite number (a learning rate too high, bad data)."""


class DemoError(FtpipeError, RuntimeError):
    """The demo could not run to the end; the message names the process and the reason."""


class NetworkLabError(FtpipeError, RuntimeError):
    """Network namespaces, veth links or tbf caps could not be set up (needs CAP_NET_ADMIN and
    iproute2); the message names the command and its error."""

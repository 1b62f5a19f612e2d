"""Message transports: the paho-mqtt adapter and an in-memory one for unit tests."""

from ftpipe_iot.errors import TransportError
from ftpipe_iot.transport.base import (
    RECONNECTED_TOPIC,
    Incoming,
    Traffic,
    Transport,
    Will,
    topic_matches,
)

__all__ = ["RECONNECTED_TOPIC", "Incoming", "Traffic", "Transport", "TransportError", "Will",
           "topic_matches"]

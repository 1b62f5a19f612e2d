"""Message transports: the paho-mqtt adapter and an in-memory one for unit tests."""

from ftpipe_iot.transport.base import Incoming, Transport, TransportError, Will, topic_matches

__all__ = ["Incoming", "Transport", "TransportError", "Will", "topic_matches"]

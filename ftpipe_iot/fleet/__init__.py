"""Fleet provisioning: a CA, a production Mosquitto config, and one identity per device.

``ftpipe-iot fleet ...`` commands call into this package (docs/design.md §10). Each module owns one
concept: ``ca`` (certificates), ``passwd`` (Mosquitto password hashes), ``acl`` (who may touch which
topic), ``brokerconf`` (the rendered broker config), ``model`` (the fleet.json records), ``bundle``
(what is copied onto a device), ``fleet`` (the operations), ``check`` (diagnosing a connection).
"""

from ftpipe_iot.fleet.errors import (
    CheckFailure,
    ConnectionCheckError,
    FleetError,
    UnknownIdentityError,
)
from ftpipe_iot.fleet.model import Role

__all__ = [
    "CheckFailure",
    "ConnectionCheckError",
    "FleetError",
    "Role",
    "UnknownIdentityError",
]

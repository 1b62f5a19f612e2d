"""Embedded MQTT 3.1.1 broker (amqtt) for a quick local try when Mosquitto is not installed.

Run as ``python -m ftpipe_iot.runtime.embedded_broker --port N``. It keeps nothing on disk, speaks
MQTT 3.1.1 only and is slower than Mosquitto; the caller prints a warning saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal


def broker_config(port: int, bind: str) -> dict:
    """amqtt broker configuration: one TCP listener, anonymous access (local use only)."""
    return {
        "listeners": {"default": {"type": "tcp", "bind": f"{bind}:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }


async def _serve(port: int, bind: str) -> None:
    from amqtt.broker import Broker

    broker = Broker(broker_config(port, bind))
    await broker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await broker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bind", default="127.0.0.1")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve(args.port, args.bind))


if __name__ == "__main__":
    main()

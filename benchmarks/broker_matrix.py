"""The broker compatibility matrix as observed here (prints JSON, writes it): every broker this
host can run, probed with real clients (ftpipe_iot/transport/probe.py): Mosquitto 2 over MQTT 5
and 3.1.1 with the project's config, the embedded amqtt broker, and RabbitMQ's MQTT plugin on a
private node. docs/brokers.md explains each column and what the project does about it.

    python benchmarks/broker_matrix.py [--out benchmarks/results/broker_matrix.json]
                                       [--brokers mosquitto-5,rabbitmq]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess, mosquitto_binary  # noqa: E402
from ftpipe_iot.runtime.rabbitmq import (  # noqa: E402
    RabbitMqBroker,
    mqtt_plugin_version,
    rabbitmq_unavailable,
)
from ftpipe_iot.transport.connection import BrokerConfig, MqttProtocol  # noqa: E402
from ftpipe_iot.transport.probe import probe  # noqa: E402

BROKERS = ("mosquitto-5", "mosquitto-3.1.1", "embedded-amqtt", "rabbitmq")


def _mosquitto_version() -> str:
    import subprocess

    out = subprocess.run([mosquitto_binary() or "mosquitto", "-h"], capture_output=True,
                         text=True).stdout
    return out.splitlines()[0] if out else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" /
                        "broker_matrix.json")
    parser.add_argument("--brokers", default=",".join(BROKERS),
                        help=f"comma-separated subset of {', '.join(BROKERS)} (default: all)")
    args = parser.parse_args()
    wanted = [name.strip() for name in args.brokers.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(BROKERS))
    if unknown or not wanted:
        parser.error(f"--brokers takes names among {', '.join(BROKERS)}; got {args.brokers!r}")
    started = time.monotonic()
    rows: dict[str, dict] = {}
    mosquitto_rows = [(name, protocol) for name, protocol in
                      (("mosquitto-5", MqttProtocol.V5), ("mosquitto-3.1.1", MqttProtocol.V311))
                      if name in wanted]
    if mosquitto_rows and mosquitto_binary():
        for name, protocol in mosquitto_rows:
            with BrokerProcess(kind=BrokerKind.MOSQUITTO) as broker:
                rows[name] = {"version": _mosquitto_version(),
                              **probe(BrokerConfig(port=broker.port, protocol=protocol))
                              .to_dict()}
    elif mosquitto_rows:
        rows["mosquitto"] = {"skipped": "mosquitto is not installed"}
    if "embedded-amqtt" in wanted:
        with BrokerProcess(kind=BrokerKind.EMBEDDED) as broker:
            from importlib.metadata import version

            rows["embedded-amqtt"] = {"version": f"amqtt {version('amqtt')}",
                                      **probe(BrokerConfig(port=broker.port)).to_dict()}
    if "rabbitmq" in wanted:
        reason = rabbitmq_unavailable()
        if reason:
            rows["rabbitmq"] = {"skipped": reason}
        else:
            with RabbitMqBroker() as node:
                rows["rabbitmq"] = {"version": f"RabbitMQ {mqtt_plugin_version()} "
                                               "(rabbitmq_mqtt)",
                                    **probe(BrokerConfig(port=node.port)).to_dict()}
    for row in rows.values():
        row.pop("url", None)
    results = {"brokers": rows, "loadavg": os.getloadavg(),
               "wall_s": round(time.monotonic() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()

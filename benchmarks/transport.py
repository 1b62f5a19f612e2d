"""Transport throughput, one hop publisher -> broker -> subscriber (prints JSON, writes it and a
PNG): fp32 tensors through the project's wire and transport (``Messenger`` over ``MqttTransport``,
received on a worker thread as a device does) against bare paho-mqtt publishing the same MQTT
messages (same sizes, QoS, in-flight window and TCP_NODELAY: a user's ceiling) through the same
Mosquitto, and raw TCP between the two processes (the physical ceiling of this host).

Publisher and subscriber are separate processes, as on real devices. Each case sends ``count``
tensors of ``tensor`` bytes; the project chunks them to ``message`` bytes, and bare paho sends
the same number of messages of the same size. Throughput is tensor bytes over the time from the
first to the last tensor received (complete and decoded, for the project).

    python benchmarks/transport.py [--count 150] [--out benchmarks/results/transport.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import save_figure, write_results  # noqa: E402

KIB, MIB = 1024, 1024 * 1024
# (tensor bytes, MQTT message bytes, QoS): the project's default message size, 1 MiB messages
# (the bare-paho figure), one message per tensor, and QoS 0 for comparison.
CASES = [(4 * MIB, 256 * KIB, 1), (1 * MIB, 1 * MIB + 4 * KIB, 1), (4 * MIB, 1 * MIB, 1),
         (4 * MIB, 4 * MIB + 4 * KIB, 1), (4 * MIB, 1 * MIB, 0)]
TOPIC = "bench/transport"
INFLIGHT = 200  # the project's MqttTransport window; bare paho gets the same
# Bare paho as a user runs it, and with the process settings the project's processes apply
# (ftpipe_iot.transport.tuning): the fair yardstick for the project's own code.
MODES = ("project", "paho", "paho-tuned", "tcp")
TUNED = ("project", "paho-tuned")


def say(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


# -- one side of one case (run in a child process) ---------------------------------------------
def _paho_client(name: str):
    import paho.mqtt.client as mqtt

    from ftpipe_iot.transport.mqtt import _no_delay

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name,
                         protocol=mqtt.MQTTv5)
    client.max_inflight_messages_set(INFLIGHT)
    client.max_queued_messages_set(0)
    client.on_socket_open = _no_delay
    return client


def _messages(tensor: int, message: int) -> list[bytes]:
    """The MQTT payloads bare paho sends for one tensor: as many, and as large, as the
    project's chunks (sizes taken from the project's own encoding of the same tensor)."""
    return [os.urandom(len(frame)) for frame in _project_frames(tensor, message)]


def _project_frames(tensor: int, message: int) -> list[bytes]:
    from ftpipe_iot.protocol.messages import Activation, envelope
    from ftpipe_iot.protocol.wire import WireOptions, encode

    x, y = _tensor(tensor)
    env = envelope(Activation(x, y, True), "bench", "pub", 1, 0, 0, 1)
    return encode(env, WireOptions(max_message_bytes=message))


def _tensor(tensor: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.standard_normal(tensor // 4, dtype=np.float32), np.zeros(8, dtype=np.int64)


def _publish(mode: str, port: int, tensor: int, message: int, qos: int, count: int) -> dict:
    if mode == "tcp":
        payload = os.urandom(tensor)
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for _ in range(count):
                sock.sendall(payload)
        return {}
    if mode.startswith("paho"):
        client = _paho_client("bench-pub")
        client.connect("127.0.0.1", port)
        client.loop_start()
        payloads = _messages(tensor, message)
        infos = [client.publish(TOPIC, p, qos=qos) for _ in range(count) for p in payloads]
        for info in infos:
            if qos:
                info.wait_for_publish(120)
        client.disconnect()
        client.loop_stop()
        return {}
    from prometheus_client import CollectorRegistry

    from ftpipe_iot.observability.metrics import DeviceMetrics
    from ftpipe_iot.protocol.messages import Activation
    from ftpipe_iot.protocol.wire import WireOptions
    from ftpipe_iot.transport.connection import BrokerConfig
    from ftpipe_iot.transport.messenger import Messenger
    from ftpipe_iot.transport.mqtt import MqttTransport

    transport = MqttTransport(BrokerConfig(port=port, max_message_bytes=message), "bench-pub")
    transport.connect()
    messenger = Messenger(transport, "pub", "bench", DeviceMetrics(CollectorRegistry()),
                          WireOptions(max_message_bytes=message))
    x, y = _tensor(tensor)
    started = time.perf_counter()
    for i in range(count):
        messenger.send(TOPIC, Activation(x, y, True), 1, i, 0, qos=qos)
    encode_s = time.perf_counter() - started
    transport.close(flush_timeout_s=120)
    return {"publisher_busy_s": encode_s}


class _Arrivals:
    """Arrival times of complete tensors on the subscriber side."""

    def __init__(self, count: int) -> None:
        self.times: list[float] = []
        self.count = count
        self.done = threading.Event()

    def arrived(self) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) >= self.count:
            self.done.set()


def _subscribe(mode: str, port: int, tensor: int, message: int, qos: int, count: int,
               ready: Path) -> dict:
    arrivals = _Arrivals(count)
    if mode == "tcp":
        server = socket.create_server(("127.0.0.1", port))
        ready.write_text("ready")
        conn, _ = server.accept()
        got = 0
        buffer = bytearray(4 * MIB)
        while got < tensor * count:
            n = conn.recv_into(buffer)
            if n == 0:
                break
            before = got // tensor
            got += n
            for _ in range(got // tensor - before):
                arrivals.arrived()
        conn.close()
        server.close()
    elif mode.startswith("paho"):
        per_tensor = len(_project_frames(tensor, message))
        seen = [0]

        def on_message(client, userdata, msg) -> None:
            seen[0] += 1
            if seen[0] % per_tensor == 0:
                arrivals.arrived()

        client = _paho_client("bench-sub")
        client.on_message = on_message
        client.on_connect = lambda c, *a: (c.subscribe(TOPIC, qos), ready.write_text("ready"))
        client.connect("127.0.0.1", port)
        client.loop_start()
        arrivals.done.wait(300)
        client.disconnect()
        client.loop_stop()
    else:
        _subscribe_project(port, message, qos, ready, arrivals)
    times = arrivals.times
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return {"received": len(times),
            "mb_per_s": (len(times) - 1) * tensor / span / 1e6 if span > 0 else None}


def _subscribe_project(port: int, message: int, qos: int, ready: Path,
                       arrivals: _Arrivals) -> None:
    from prometheus_client import CollectorRegistry

    from ftpipe_iot.observability.metrics import DeviceMetrics
    from ftpipe_iot.protocol.messages import Activation
    from ftpipe_iot.transport.base import serve
    from ftpipe_iot.transport.connection import BrokerConfig
    from ftpipe_iot.transport.messenger import Messenger
    from ftpipe_iot.transport.mqtt import MqttTransport

    transport = MqttTransport(BrokerConfig(port=port, max_message_bytes=message), "bench-sub")
    transport.connect()
    transport.subscribe(TOPIC, qos)
    messenger = Messenger(transport, "sub", "bench", DeviceMetrics(CollectorRegistry()))

    def handle(incoming) -> None:
        inbound = messenger.receive(incoming)
        if inbound is not None and isinstance(inbound.message, Activation):
            arrivals.arrived()

    time.sleep(0.2)  # the SUBACK has no callback in the transport; give it a moment
    ready.write_text("ready")
    worker = threading.Thread(target=serve, args=(transport.inbox, handle, lambda: None,
                                                  arrivals.done.is_set, 0.05), daemon=True)
    worker.start()
    arrivals.done.wait(300)
    transport.close()


# -- the driver -------------------------------------------------------------------------------
def _child(role: str, mode: str, port: int, tensor: int, message: int, qos: int, count: int,
           ready: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--role", role, "--mode", mode, "--port", str(port),
         "--tensor", str(tensor), "--message", str(message), "--qos", str(qos),
         "--count", str(count), "--ready", str(ready)],
        stdout=subprocess.PIPE, text=True, start_new_session=True)


def run_case(mode: str, port: int, tensor: int, message: int, qos: int, count: int,
             work: Path) -> dict:
    """One measurement: start the subscriber, wait until it is ready, run the publisher."""
    ready = work / f"ready-{mode}-{tensor}-{message}-{qos}"
    ready.unlink(missing_ok=True)
    sub = _child("sub", mode, port, tensor, message, qos, count, ready)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if time.monotonic() > deadline or sub.poll() is not None:
            sub.kill()
            raise RuntimeError(f"{mode} subscriber never became ready")
        time.sleep(0.02)
    pub = _child("pub", mode, port, tensor, message, qos, count, ready)
    try:
        pub_out, _ = pub.communicate(timeout=300)
        sub_out, _ = sub.communicate(timeout=300)
    finally:
        for proc in (pub, sub):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    result = json.loads(sub_out.strip().splitlines()[-1])
    result.update(json.loads(pub_out.strip().splitlines()[-1]))
    return result


def measure(count: int, repeats: int, work: Path) -> list[dict]:
    from ftpipe_iot.runtime.broker import BrokerProcess, find_free_port

    rows = []
    with BrokerProcess(max_message_bytes=8 * MIB) as broker:
        for tensor, message, qos in CASES:
            row: dict = {"tensor_bytes": tensor, "message_bytes": message, "qos": qos,
                         "messages_per_tensor": len(_project_frames(tensor, message))}
            # Modes interleaved within each repeat, so that load from other work on the host
            # hits them alike; the best of the repeats is kept.
            runs: dict[str, list[dict]] = {}
            for _ in range(repeats):
                for mode in MODES:
                    if mode == "tcp" and (message != CASES[0][1] or qos != 1):
                        continue  # raw TCP has neither messages nor QoS: once per tensor size
                    port = broker.port if mode != "tcp" else find_free_port()
                    result = run_case(mode, port, tensor, message, qos, count, work)
                    runs.setdefault(mode, []).append(result)
                    say(f"{mode:10s} tensor {tensor // KIB} KiB message {message // KIB} KiB "
                        f"qos {qos}: {result['mb_per_s']} MB/s")
            for mode, results in runs.items():
                rates = [r["mb_per_s"] for r in results if r["mb_per_s"]]
                row[mode] = {"mb_per_s": max(rates) if rates else None,
                             "runs_mb_per_s": [r["mb_per_s"] for r in results],
                             "received": [r["received"] for r in results]}
            for peer in ("paho", "paho-tuned"):
                if row["project"]["mb_per_s"] and row[peer]["mb_per_s"]:
                    row[f"project_over_{peer}"] = round(row["project"]["mb_per_s"] /
                                                        row[peer]["mb_per_s"], 3)
            rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['tensor_bytes'] // MIB} MiB / {r['message_bytes'] // KIB} KiB msg\nQoS "
              f"{r['qos']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.27
    names = {"project": "ftpipe-iot wire + transport", "paho": "bare paho-mqtt",
             "paho-tuned": "bare paho-mqtt, same process settings"}
    for i, mode in enumerate(names):
        values = [r[mode]["mb_per_s"] or 0 for r in rows]
        ax.bar([j + (i - 1) * width for j in range(len(rows))], values, width,
               label=names[mode])
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("MB/s (tensor bytes, one hop via Mosquitto)")
    tcp = next((r["tcp"]["mb_per_s"] for r in rows if "tcp" in r), None)
    ax.set_title(f"Transport throughput (raw TCP on this host: {tcp:.0f} MB/s)" if tcp
                 else "Transport throughput")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("pub", "sub"), default=None)
    parser.add_argument("--mode", choices=MODES, default="project")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tensor", type=int, default=4 * MIB)
    parser.add_argument("--message", type=int, default=256 * KIB)
    parser.add_argument("--qos", type=int, default=1)
    parser.add_argument("--count", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ready", type=Path, default=None)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "transport.json")
    args = parser.parse_args()
    if args.mode in TUNED:
        from ftpipe_iot.transport.tuning import tune_for_large_messages

        tune_for_large_messages()
    if args.role == "pub":
        print(json.dumps(_publish(args.mode, args.port, args.tensor, args.message, args.qos,
                                  args.count)))
        return
    if args.role == "sub":
        print(json.dumps(_subscribe(args.mode, args.port, args.tensor, args.message, args.qos,
                                    args.count, args.ready)))
        return
    import tempfile

    started = time.monotonic()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-transport-") as work:
        rows = measure(args.count, args.repeats, Path(work))
    results = {"cases": rows, "count": args.count, "repeats": args.repeats,
               "note": "best of the repeats; CPU is shared with other work on this host",
               "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
               "wall_s": round(time.monotonic() - started, 1)}
    write_results(results, args.out, lambda png: plot(rows, png))


if __name__ == "__main__":
    main()

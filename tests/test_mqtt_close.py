"""Closing an MQTT transport when paho's network thread ends on its own meanwhile: paho's
``loop_stop`` checks its thread and then joins it, and the ending thread clears it in between
(eclipse-paho/paho.mqtt.python#872). A controller that had finished its job exited with that
AttributeError's traceback (a full suite run, tests/test_faults.py's hung-device job)."""

from __future__ import annotations

import paho.mqtt.client as mqtt
import pytest

from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.mqtt import MqttTransport

pytestmark = pytest.mark.broker


def test_close_survives_the_network_thread_ending_while_it_is_stopped(mosquitto, monkeypatch):
    raced = []
    transport = MqttTransport(BrokerConfig(port=mosquitto.port), "closing")
    transport.connect()
    # the network thread as connect started it: by the time close stops it, it may have ended
    # and paho may have cleared it already (the race's timing depends on the host's load)
    network_thread = transport._client._thread
    assert network_thread is not None

    def loop_stop_losing_the_race(client: mqtt.Client):
        network_thread.join(10)  # after the disconnect the network thread ends on its own
        raced.append(network_thread.is_alive())
        # what paho does when its check saw the thread and the join finds it cleared
        raise AttributeError("'NoneType' object has no attribute 'join'")

    monkeypatch.setattr(mqtt.Client, "loop_stop", loop_stop_losing_the_race)
    transport.close()
    assert raced == [False]  # the race was run, and the thread had ended
    transport.close()  # closing again is a no-op

"""ftpipe-iot: pipeline-parallel DNN training across heterogeneous IoT/edge devices over MQTT.

``ftpipe_iot.load_model(path)`` rebuilds a trained ``nn.Sequential`` from a checkpoint written
by ``--save-model`` (imported on first use: ``import ftpipe_iot`` does not import torch).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from ftpipe_iot.artifacts.checkpoint import load_model

        return load_model
    raise AttributeError(f"module 'ftpipe_iot' has no attribute {name!r}")

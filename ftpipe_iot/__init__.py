"""ftpipe-iot: pipeline-parallel DNN training across heterogeneous IoT/edge devices over MQTT."""

__version__ = "0.1.0"

#!/usr/bin/env bash
# Installs the system packages the demo and the tests use, where they are missing:
# Mosquitto and its command-line clients, the Prometheus server (end-to-end metrics test),
# iproute2 (network labs: ip, tc) and RabbitMQ with its MQTT plugin (broker compatibility tests;
# they start a private node on free ports and skip when RabbitMQ cannot be installed).
set -euo pipefail
need=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
command -v mosquitto_pub >/dev/null 2>&1 || need+=(mosquitto-clients)
if [ "${FTPIPE_SKIP_PROMETHEUS:-0}" != "1" ]; then
  command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
fi
command -v tc >/dev/null 2>&1 || [ -x /usr/sbin/tc ] || need+=(iproute2)
if [ "${FTPIPE_SKIP_RABBITMQ:-0}" != "1" ]; then
  [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || need+=(rabbitmq-server)
fi
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
echo "installing system packages: ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# Debian starts these as services on install; the project starts its own on free ports.
for svc in "${need[@]}"; do
  case "$svc" in
    prometheus) $SUDO systemctl stop prometheus >/dev/null 2>&1 || true ;;
    rabbitmq-server) $SUDO systemctl stop rabbitmq-server >/dev/null 2>&1 \
      || $SUDO service rabbitmq-server stop >/dev/null 2>&1 || true ;;
  esac
done

#!/usr/bin/env bash
# Installs kcat (Debian's package) when missing: the Kafka tests read back
# what walbox wrote with it, a client that shares no code with walbox's.
set -euo pipefail
command -v kcat >/dev/null && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kcat >/dev/null 2>&1 || {
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kcat >/dev/null
  }
elif command -v sudo >/dev/null && command -v apt-get >/dev/null; then
  sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kcat >/dev/null
else
  echo "kcat is needed by the Kafka tests: install it (Debian/Ubuntu: apt-get install kcat; macOS: brew install kcat)" >&2
  exit 1
fi
command -v kcat >/dev/null

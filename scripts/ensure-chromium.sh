#!/usr/bin/env bash
# Installs Chromium (Debian's package) when missing: the web console's tests
# (internal/console) drive it headless with chromedp. They fail without it.
set -euo pipefail
if [ -n "${WALBOX_CHROMIUM:-}" ] || command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 || {
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  }
elif command -v sudo >/dev/null && command -v apt-get >/dev/null; then
  sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
else
  echo "Chromium is needed by the web console's tests: install it (Debian/Ubuntu: apt-get install chromium), or set WALBOX_CHROMIUM to a Chrome or Chromium binary" >&2
  exit 1
fi
command -v chromium >/dev/null

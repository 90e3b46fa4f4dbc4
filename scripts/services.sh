#!/usr/bin/env bash
# Make sure the services the tests need run on loopback: PostgreSQL on $PGPORT (5432) and Redis on
# 6379. Starts them when stopped; installs them from Debian's packages when missing. Safe to run again.
#
# PostgreSQL, three cases, none of which touches how anyone else connects:
#  * the tests' default login works (user postgres over TCP without a password): nothing to do;
#  * it runs (or is installed) with password authentication: a role `tessera_test` with a password and
#    CREATEDB is created or updated through the local socket as the postgres system user, and its URL
#    is written to .tessera-test-database-url, which `make test` passes to the tests
#    (TESSERA_TEST_DATABASE_URL); pg_hba.conf is left as it is;
#  * it is not installed: Debian's package is installed (a new cluster, which we may configure: its
#    loopback logins are trusted, the configuration reloaded) and started.
#
# TESSERA_TEST_DATABASE_URL / TESSERA_TEST_REDIS_URL (for example a PostgreSQL or Redis in a container,
# with a password): the service that URL names is only checked, nothing local is set up for it. Without
# root and sudo, what is missing is named in one line.
set -euo pipefail

PYTHON=${PYTHON:-.venv/bin/python}
# check_url VARIABLE: one line saying whether the service the URL names answers (exit 1 when not).
check_url() {
  "$PYTHON" - "$1" <<'PY'
import os, sys
name = sys.argv[1]
url = os.environ[name]
try:
    if name.endswith("REDIS_URL"):
        import redis
        redis.Redis.from_url(url, socket_connect_timeout=5).ping()
    else:
        from sqlalchemy import create_engine, text
        with create_engine(url, connect_args={"connect_timeout": 5}).connect() as conn:
            conn.execute(text("select 1"))
except Exception as exc:
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    from urllib.parse import urlsplit
    password = urlsplit(url.replace("+psycopg2", "")).password
    if password:
        reason = reason.replace(password, "***")
    print(f"services: {name} does not answer: {reason}", file=sys.stderr)
    sys.exit(1)
print(f"services: {name} answers")
PY
}
given_db=${TESSERA_TEST_DATABASE_URL:-}
given_redis=${TESSERA_TEST_REDIS_URL:-}
[ -z "$given_db" ] || check_url TESSERA_TEST_DATABASE_URL
[ -z "$given_redis" ] || check_url TESSERA_TEST_REDIS_URL
if [ -n "$given_db" ] && [ -n "$given_redis" ]; then exit 0; fi

if [ "$(id -u)" != 0 ] && ! sudo -n true 2>/dev/null; then
  missing=""
  [ -n "$given_db" ] || pg_isready -q -h 127.0.0.1 -p "${PGPORT:-5432}" 2>/dev/null || missing="$missing postgresql"
  [ -n "$given_redis" ] || redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG || missing="$missing redis-server"
  if [ -n "$missing" ]; then
    echo "services: neither root nor sudo here: install and start${missing} yourself, or set TESSERA_TEST_DATABASE_URL and TESSERA_TEST_REDIS_URL" >&2
    exit 1
  fi
fi

PGPORT=${PGPORT:-5432}
URL_FILE=${TESSERA_TEST_URL_FILE:-.tessera-test-database-url}
TEST_ROLE=tessera_test
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
as_postgres() { if [ "$(id -un)" = postgres ]; then "$@"; else as_root runuser -u postgres -- "$@"; fi; }
apt_ready=""
apt_install() {
  if [ -z "$apt_ready" ]; then as_root apt-get update -qq; apt_ready=1; fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

pg_up() { pg_isready -q -h 127.0.0.1 -p "$PGPORT" 2>/dev/null; }
default_login() { PGCONNECT_TIMEOUT=5 psql -w -h 127.0.0.1 -p "$PGPORT" -U postgres -d postgres -Atc 'select 1' >/dev/null 2>&1; }
newest() { ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1; }

if [ -z "$given_db" ]; then
if ! command -v pg_isready >/dev/null || { ! pg_up && [ -z "$(newest)" ]; }; then
  apt_install postgresql postgresql-client
  version=$(newest)
  hba=/etc/postgresql/$version/main/pg_hba.conf
  if ! as_root grep -q "tessera-test" "$hba"; then
    # A cluster this script installed: the tests log in as postgres over TCP on loopback.
    as_root sed -i '1i host all all 127.0.0.1/32 trust # tessera-test\nhost all all ::1/128 trust # tessera-test' "$hba"
  fi
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start 2>/dev/null \
    || as_root pg_ctlcluster --skip-systemctl-redirect "$version" main reload || true
fi
if ! pg_up; then
  version=$(newest)
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
fi
for _ in $(seq 1 30); do pg_up && break; sleep 1; done
pg_up || { echo "PostgreSQL did not start on 127.0.0.1:$PGPORT" >&2; exit 1; }

if default_login; then
  rm -f "$URL_FILE"
  echo "services: PostgreSQL on 127.0.0.1:$PGPORT takes the tests' default login"
else
  # Password authentication: a role of our own, made through the local socket (peer auth as postgres).
  if [ -s "$URL_FILE" ]; then
    password=$(sed -E 's|^[^:]+://[^:]+:([^@]+)@.*|\1|' "$URL_FILE")
  else
    password=$(head -c 18 /dev/urandom | base64 | tr -d '/+=')
  fi
  as_postgres psql -q -v ON_ERROR_STOP=1 -p "$PGPORT" -d postgres -v role="$TEST_ROLE" -v pw="$password" <<'SQL'
SELECT format('CREATE ROLE %I LOGIN CREATEDB PASSWORD %L', :'role', :'pw')
 WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'role') \gexec
SELECT format('ALTER ROLE %I LOGIN CREATEDB PASSWORD %L', :'role', :'pw') \gexec
SQL
  umask 077
  echo "postgresql+psycopg2://$TEST_ROLE:$password@127.0.0.1:$PGPORT/tessera_test" > "$URL_FILE"
  PGPASSWORD=$password psql -w -h 127.0.0.1 -p "$PGPORT" -U "$TEST_ROLE" -d postgres -Atc 'select 1' >/dev/null \
    || { echo "PostgreSQL refuses the $TEST_ROLE role over TCP on loopback; see its pg_hba.conf" >&2; exit 1; }
  echo "services: PostgreSQL on 127.0.0.1:$PGPORT asks for passwords: the tests use the role $TEST_ROLE ($URL_FILE)"
fi
fi

redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }
if [ -z "$given_redis" ] && ! redis_up; then
  command -v redis-server >/dev/null || apt_install redis-server
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /tmp --logfile /tmp/tessera-redis.log
  for _ in $(seq 1 30); do redis_up && break; sleep 0.5; done
  redis_up || { echo "Redis did not start" >&2; exit 1; }
fi
echo "services: PostgreSQL and Redis are up"

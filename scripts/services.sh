#!/usr/bin/env bash
# Make sure the services the tests need run on loopback: PostgreSQL on 5432 (user postgres, trust auth
# from 127.0.0.1) and Redis on 6379. Starts them when stopped; installs them from Debian's packages
# when missing. Safe to run again.
set -euo pipefail

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_ready=""
apt_install() {
  if [ -z "$apt_ready" ]; then as_root apt-get update -qq; apt_ready=1; fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
if ! pg_up; then
  command -v pg_ctlcluster >/dev/null || apt_install postgresql postgresql-client
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  hba=/etc/postgresql/$version/main/pg_hba.conf
  if ! as_root grep -q "tessera-test" "$hba"; then
    # The tests connect as postgres over TCP on loopback without a password.
    as_root sed -i '1i host all all 127.0.0.1/32 trust # tessera-test\nhost all all ::1/128 trust # tessera-test' "$hba"
  fi
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  for _ in $(seq 1 30); do pg_up && break; sleep 1; done
  pg_up || { echo "PostgreSQL did not start" >&2; exit 1; }
fi

redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }
if ! redis_up; then
  command -v redis-server >/dev/null || apt_install redis-server
  mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /tmp --logfile /tmp/tessera-redis.log
  for _ in $(seq 1 30); do redis_up && break; sleep 0.5; done
  redis_up || { echo "Redis did not start" >&2; exit 1; }
fi
echo "services: PostgreSQL and Redis are up"

#!/usr/bin/env bash
# The spine's tests and the kill tests on the other brokers Tessera supports (make test-brokers):
#  * RabbitMQ on loopback (quorum queues, publisher confirms): started when stopped, restarted when it
#    runs but does not answer within 20 s, installed from Debian's packages when missing (root or
#    sudo); the virtual hosts that killed runs left behind are deleted first;
#  * Redis behind a password: a second redis-server of this run's own on a free port, with a password
#    it makes up, stopped at the end: the kill tests;
#  * Redis Sentinel: a master behind a password, one replica and one sentinel of this run's own
#    (tests/factories/sentinel.py: redis-server on free ports, the sentinel's config file written for
#    it, all stopped at the end), reached through sentinel:// URLs for the broker and for Redis: the
#    spine's tests (the failover test, tests/chaos/test_sentinel_failover.py, runs in make test).
# The kill tests and the spine's tests each run once on a Redis other than the default one, so the
# Sentinel stage costs no more time than the spine's second run on the password Redis it replaced.
# Each run uses the test suite's own database handling (a fresh database per run).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTEST=${PYTEST:-.venv/bin/pytest}
SPINE=(tests/infra tests/webhooks)
KILLS=(tests/agentic tests/network_tokens tests/reactors tests/keys)

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }

# ---- RabbitMQ ----
if ! command -v rabbitmq-server >/dev/null; then
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server >/dev/null
fi
rabbit_answers() { as_root timeout 20 rabbitmqctl -q status >/dev/null 2>&1; }
if ! rabbit_answers; then
  # Not running, or running and not answering (a node left overloaded or wedged by an earlier run):
  # stopped first, then started afresh.
  if pgrep -f 'beam.*rabbit' >/dev/null; then
    echo "brokers: RabbitMQ does not answer; restarting it"
    as_root timeout 30 rabbitmqctl -q stop >/dev/null 2>&1 || true
    as_root pkill -KILL -f 'beam.*rabbit' || true
    sleep 1
  fi
  as_root rabbitmq-server -detached
  for _ in $(seq 1 60); do rabbit_answers && break; sleep 1; done
fi
as_root timeout 120 rabbitmqctl -q await_startup
# Virtual hosts of runs that were killed before their cleanup (a stage's here, tessera-test-<pid>-<stage>;
# a kill test's, test<pid>:<name>): each one left costs the node memory and processes.
as_root rabbitmqctl -q list_vhosts --no-table-headers name | while read -r vhost; do
  owner=$(sed -nE 's/^(tessera-test-|test)([0-9]+)[-:].*/\2/p' <<<"$vhost")
  if [ -n "$owner" ] && ! kill -0 "$owner" 2>/dev/null; then
    as_root timeout 60 rabbitmqctl -q delete_vhost "$vhost" </dev/null >/dev/null 2>&1 || true
  fi
done
# A virtual host of this run's own, deleted at the end: RabbitMQ's queues outlive a run (as Redis keys
# do not: each run has its own key prefix), and messages a stopped run left would reach this run's
# workers. Each of the two runs below gets its own.
rabbit_vhost=""
rabbit_url=""
drop_vhost() { [ -n "$rabbit_vhost" ] && as_root rabbitmqctl -q delete_vhost "$rabbit_vhost" >/dev/null 2>&1 || true; }
fresh_vhost() {
  drop_vhost
  rabbit_vhost="tessera-test-$$-$1"
  as_root rabbitmqctl -q add_vhost "$rabbit_vhost" >/dev/null
  as_root rabbitmqctl -q set_permissions -p "$rabbit_vhost" guest ".*" ".*" ".*" >/dev/null
  rabbit_url="amqp://guest:guest@127.0.0.1:5672/$rabbit_vhost"
}
trap drop_vhost EXIT
echo "brokers: RabbitMQ"
fresh_vhost spine
TESSERA_TEST_BROKER_URL=$rabbit_url "$PYTEST" -q "${SPINE[@]}"
fresh_vhost kills
TESSERA_TEST_BROKER_URL=$rabbit_url "$PYTEST" -q -m kill "${KILLS[@]}"
drop_vhost

# ---- Redis behind a password ----
port=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
password=$(.venv/bin/python -c 'import secrets; print(secrets.token_urlsafe(24))')
folder=$(mktemp -d)
redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --requirepass "$password" --save "" \
  --appendonly no --dir "$folder" --pidfile "$folder/redis.pid" --logfile "$folder/redis.log"
trap 'kill "$(cat "$folder/redis.pid")" 2>/dev/null || true; rm -rf "$folder"' EXIT
for _ in $(seq 1 50); do redis-cli -p "$port" -a "$password" --no-auth-warning ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done
echo "brokers: Redis with a password"
TESSERA_TEST_REDIS_URL="redis://:$password@127.0.0.1:$port/0" "$PYTEST" -q -m kill "${KILLS[@]}"

# ---- Redis Sentinel ----
echo "brokers: Redis Sentinel"
.venv/bin/python -m tests.factories.sentinel "$PYTEST" -q "${SPINE[@]}"

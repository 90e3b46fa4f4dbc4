#!/bin/sh
# The part of the postgres image's entrypoint docker-compose.yml relies on: a cluster made on first
# start in /var/lib/postgresql/data with POSTGRES_USER (a superuser) whose password is the file
# POSTGRES_PASSWORD_FILE names, the database POSTGRES_DB, password logins from the network.
set -eu
data=/var/lib/postgresql/data
mkdir -p "$data" /var/run/postgresql
chown -R postgres:postgres "$data" /var/run/postgresql
chmod 700 "$data"
if [ ! -s "$data/PG_VERSION" ]; then
    install -o postgres -m 600 "$POSTGRES_PASSWORD_FILE" /tmp/pwfile
    su postgres -s /bin/sh -c "initdb -D $data -U $POSTGRES_USER --pwfile=/tmp/pwfile --auth-local=trust --auth-host=scram-sha-256" >/dev/null
    rm -f /tmp/pwfile
    echo "host all all all scram-sha-256" >> "$data/pg_hba.conf"
    su postgres -s /bin/sh -c "pg_ctl -D $data -o '-c listen_addresses=' -w start >/dev/null && createdb -U $POSTGRES_USER $POSTGRES_DB && pg_ctl -D $data -w stop >/dev/null"
fi
exec su postgres -s /bin/sh -c "exec postgres -D $data -c listen_addresses='*'"

#!/bin/sh
# Restore a backup of scripts/backup.sh: the database into an EMPTY database (a new one, or the old one
# dropped and made again), the S3 objects into the bucket (made when missing), then check that the
# master key in place opens the restored database.
#
#   sh scripts/restore.sh BACKUP_DIR
#
# Before it: stop every platform service (api, worker, reactors, beat, flower), make the empty
# database, and put the backup's key back where the deployment reads it (secrets/master_key in
# docker-compose.yml; TESSERA_MASTER_KEY_FILE elsewhere). After it: `tessera migrate` (a backup of
# an older release is brought up to this one), then start the services.
#
# It reads the same settings as backup.sh (TESSERA_DATABASE_URL, TESSERA_S3_*, AWS credentials, the
# key, each secret also as TESSERA_<NAME>_FILE) and runs PG_RESTORE (pg_restore), PYTHON (python3 with
# boto3) and TESSERA (tessera: `tessera keys status`, the key check), each replaceable (README
# "Operating Tessera" shows them for the compose stack). The database is restored in one transaction:
# on any error (a database not empty, a dump cut short) nothing of it is kept and the script stops.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
PG_RESTORE=${PG_RESTORE:-pg_restore}
PYTHON=${PYTHON:-python3}
TESSERA=${TESSERA:-tessera}
. "$here/settings.sh"

if [ $# -ne 1 ]; then
    echo "usage: sh scripts/restore.sh BACKUP_DIR" >&2
    exit 2
fi
backup=$1

# 0. The backup is whole.
(cd "$backup" && sha256sum --check --quiet SHA256SUMS) || {
    echo "restore: $backup does not match its SHA256SUMS: not restoring it" >&2
    exit 1
}

# 1. The database.
database_env
target=${PGDATABASE:+--dbname=$PGDATABASE}
# shellcheck disable=SC2086  # PG_RESTORE may be a command with arguments
if ! $PG_RESTORE --single-transaction --exit-on-error --no-owner --no-privileges $target \
    < "$backup/database.dump"; then
    echo "restore: pg_restore failed; nothing of the database was restored (is the database empty?)" >&2
    exit 1
fi
echo "database: restored"

# 2. The S3 objects.
"$PYTHON" "$here/s3_archive.py" load < "$backup/s3.tar"

# 3. The key opens it (the key check recorded in the database): exit status 1 when it does not.
# shellcheck disable=SC2086  # TESSERA may be a command with arguments
if command -v "${TESSERA%% *}" > /dev/null 2>&1; then
    if ! $TESSERA keys status; then
        echo "restore: the master key in place does not open this database; put the backup's key back" >&2
        exit 1
    fi
else
    echo "restore: run 'tessera keys status' where the platform runs: it must say 'key check: ok'"
fi
echo "restore: done; now 'tessera migrate', then start the services"

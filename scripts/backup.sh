#!/bin/sh
# Back up a Tessera deployment: the PostgreSQL database, every object of the S3 bucket, and the master
# key, the key into a folder of its own. Keep that folder apart from the backups (a secrets manager, an
# offline copy): a backup opens only with its key, and a backup stored with its key opens for anyone.
#
#   sh scripts/backup.sh BACKUP_DIR KEY_DIR
#
# BACKUP_DIR gets database.dump (pg_dump's custom format), s3.tar (scripts/s3_archive.py) and
# SHA256SUMS; KEY_DIR gets master_key (mode 0400). Neither may exist yet. The database is dumped first,
# then the bucket, so every object a dumped row names is in s3.tar (objects written in between are
# extra, harmless). The platform may keep serving meanwhile: pg_dump reads one consistent snapshot.
#
# What it reads: the platform's own settings, from the environment (each secret also as
# TESSERA_<NAME>_FILE, as the services read them):
#   TESSERA_DATABASE_URL   the database (its SQLAlchemy URL; given to pg_dump as PG* variables, never on a
#                          command line). Unset: pg_dump's own PG* variables or PG_DUMP's arguments decide.
#   TESSERA_S3_ENDPOINT_URL, TESSERA_S3_BUCKET, TESSERA_S3_REGION, and AWS credentials boto3's way.
#   TESSERA_MASTER_KEY     the master key. With TESSERA_KMS_KEY_ID the key never leaves KMS: nothing is copied.
# The commands it runs (override them to run elsewhere, e.g. in the compose stack; README
# "Operating Tessera"): PG_DUMP (pg_dump) and PYTHON (python3 with boto3, e.g. .venv/bin/python).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
PG_DUMP=${PG_DUMP:-pg_dump}
PYTHON=${PYTHON:-python3}
. "$here/settings.sh"

if [ $# -ne 2 ]; then
    echo "usage: sh scripts/backup.sh BACKUP_DIR KEY_DIR" >&2
    exit 2
fi
backup=$1
keys=$2
for dir in "$backup" "$keys"; do
    if [ -e "$dir" ]; then
        echo "backup: $dir exists; name a new folder" >&2
        exit 2
    fi
done

umask 077
mkdir -p "$backup" "$keys"

# 1. The database: one consistent snapshot (pg_dump runs in a single transaction).
database_env
# shellcheck disable=SC2086  # PG_DUMP may be a command with arguments
$PG_DUMP --format=custom --no-owner --no-privileges > "$backup/database.dump"
echo "database: $(wc -c < "$backup/database.dump") bytes"

# 2. The S3 bucket: documents and account-updater files, as stored (sealed ones stay sealed).
"$PYTHON" "$here/s3_archive.py" dump > "$backup/s3.tar"

# 3. The key, apart.
if [ -n "$(setting KMS_KEY_ID)" ]; then
    echo "key: AWS KMS ($(setting KMS_KEY_ID)) wraps the data keys; it stays in KMS (nothing copied)"
else
    key=$(setting MASTER_KEY)
    if [ -z "$key" ]; then
        echo "backup: neither TESSERA_MASTER_KEY(_FILE) nor TESSERA_KMS_KEY_ID is set: no key to keep" >&2
        exit 1
    fi
    printf '%s\n' "$key" > "$keys/master_key"
    chmod 400 "$keys/master_key"
    echo "key: $keys/master_key (keep it apart from $backup)"
fi

(cd "$backup" && sha256sum database.dump s3.tar > SHA256SUMS)
echo "backup: $backup"

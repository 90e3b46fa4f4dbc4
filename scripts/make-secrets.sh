#!/bin/sh
# Write the secrets docker-compose.yml reads (Docker secrets), once: the master key, every password and
# the mail server's URL, each a file in ./secrets (or the folder given as the first argument). Run it
# once per deployment, before the first `docker compose up`; it never replaces a file that exists, so
# running it again only adds what is missing. The folder is 0700 (only you on this host); its files are
# 0444 because compose bind-mounts them into containers whose users (tessera, postgres, redis) are not you.
#
# secrets/master_key wraps every tenant's data keys: back it up now, apart from the database and its
# backups (a secrets manager, or an offline copy). A backup without its key opens nothing; a new key
# over the same database is refused at start.
set -eu

dir=${1:-secrets}
umask 077
mkdir -p "$dir"
chmod 700 "$dir"

random() {  # $1 bytes of randomness, URL-safe base64 (no '+', '/', ',' or ':')
    head -c "$1" /dev/urandom | base64 | tr -d '\n' | tr '+/' '-_'
}

# write NAME VALUE: $dir/NAME holds VALUE unless it exists already.
write() {
    if [ -e "$dir/$1" ]; then
        echo "kept    $dir/$1"
        return
    fi
    printf '%s\n' "$2" > "$dir/$1"
    chmod 444 "$dir/$1"
    echo "wrote   $dir/$1"
}

# read NAME: the first line of $dir/NAME.
read_secret() { head -n 1 "$dir/$1"; }

# The master key: base64 of 32 random bytes (standard alphabet, as TESSERA_MASTER_KEY takes it).
write master_key "$(head -c 32 /dev/urandom | base64 | tr -d '\n')"
write postgres_password "$(random 24)"
write redis_password "$(random 24)"
write s3_access_key "tessera-$(random 6)"
write s3_secret_key "$(random 30)"
write flower_password "$(random 18)"

# Derived files: the URLs and credentials the platform reads, made from the passwords above.
postgres=$(read_secret postgres_password)
redis=$(read_secret redis_password)
write database_url "postgresql+psycopg2://tessera:$postgres@postgres:5432/tessera"
write broker_url "redis://:$redis@redis:6379/0"
write redis_url "redis://:$redis@redis:6379/1"
write redis.conf "requirepass $redis"
# Redis Sentinel's own password (the sentinels' requirepass), empty: the compose Redis has no
# sentinels. Behind a Sentinel group, put sentinel:// URLs in broker_url and redis_url, its password
# here, and set TESSERA_REDIS_SENTINEL_MASTER (README "Choosing a broker").
write redis_sentinel_password ""
# The mail server, as a URL that may carry its password (smtp://user:pass@host:587?starttls=true):
# $TESSERA_SMTP_URL when set while this runs, else the dev profile's Mailpit. Replace the file to change it.
write smtp_url "${TESSERA_SMTP_URL:-smtp://mailpit:1025}"
write aws_credentials "$(printf '[default]\naws_access_key_id = %s\naws_secret_access_key = %s' \
    "$(read_secret s3_access_key)" "$(read_secret s3_secret_key)")"

echo "Back up $dir/master_key apart from the database and its backups: without it no backup opens."

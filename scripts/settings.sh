# Sourced by scripts/backup.sh and scripts/restore.sh (after they set `here` and PYTHON): the platform's
# settings read as its services read them.

# setting NAME: TESSERA_NAME, else the first line of the file TESSERA_NAME_FILE names, else empty.
setting() {
    eval "value=\${TESSERA_$1:-}" "file=\${TESSERA_$1_FILE:-}"
    if [ -n "$value" ]; then
        printf '%s' "$value"
    elif [ -n "$file" ]; then
        head -n 1 "$file" | tr -d '\r\n'
    fi
}

# database_env: TESSERA_DATABASE_URL (postgresql+psycopg2://user:pass@host:port/name) exported as
# PGHOST, PGPORT, PGUSER, PGPASSWORD and PGDATABASE for pg_dump and pg_restore, never on a command
# line; unset, the PG* variables already set (or PG_DUMP's and PG_RESTORE's arguments) decide.
database_env() {
    url=$(setting DATABASE_URL)
    if [ -n "$url" ]; then
        eval "$(TESSERA_URL=$url "$PYTHON" "$here/pg_env.py")"
    fi
}

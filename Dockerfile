# Ferry's image: the proxy alone (no vLLM, no test or bench extras), run as a
# non-root user, configured by a YAML file mounted at /etc/ferry/ferry.yaml.
#
#   docker build -t ferry .
#   docker run -p 8000:8000 -v $PWD/ferry.yaml:/etc/ferry/ferry.yaml:ro ferry
#
# The file's server.host is overridden by --host 0.0.0.0 (a container must listen
# on every interface); set server.port in the file and publish the same port.

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy/ proxy/
COPY adapters/ adapters/
COPY migration_shim/ migration_shim/
COPY loadtest/ loadtest/
# proxy/data/example.yaml links to it: the example that `ferry init` writes.
COPY configs/example.yaml configs/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin ferry
COPY --from=build /wheels/ /tmp/wheels/
# Runtime dependencies only (aiohttp, uvloop, prometheus-client, pyyaml, orjson,
# pyzmq, msgspec) and the redis client, so that replicas of the image can share
# one view (`redis_url:`); no vLLM, test or bench extras.
RUN pip install "$(echo /tmp/wheels/*.whl)[redis]" && rm -rf /tmp/wheels
# No config of its own: mount one. `docker run --rm ferry init -` prints the
# documented example to start from.
USER 10001:10001
EXPOSE 8000
# On the port the mounted file's server.port names (8000 where it names none,
# or where no file is mounted).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s \
    CMD ["python", "-c", "import os, urllib.request, yaml; f = '/etc/ferry/ferry.yaml'; s = ((yaml.safe_load(open(f)) or {}).get('server') or {}) if os.path.exists(f) else {}; urllib.request.urlopen(f\"http://127.0.0.1:{s.get('port', 8000)}/livez\", timeout=2)"]
ENTRYPOINT ["ferry"]
CMD ["serve", "--config", "/etc/ferry/ferry.yaml", "--host", "0.0.0.0"]

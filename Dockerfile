# Two images from one file (docker-compose.yml and deploy/kubernetes/ name the targets):
#   docker build --target agent  -t fleetscope-agent  .   the node agent: Debian's bcc, the core install, root
#   docker build --target worker -t fleetscope-worker .   `streams`, `sink` and `db migrate`: non-root
# Both install the wheel built in the builder stage (not an editable checkout) with the core dependencies only:
# no chDB, torch or matplotlib. Against a ClickHouse server the worker needs nothing more; the embedded chDB
# store is for `fleetscope up` on one machine, not for these images.
# Debian bookworm because its python3-bpfcc is built for its python3 (3.11); versions pinned to bookworm's.
# BASE: any bookworm image; deploy/images/build-local.sh passes one it made with debootstrap when no registry is
# reachable (podman build --build-arg BASE=localhost/fleetscope-base:bookworm).

ARG BASE=debian:bookworm-slim
FROM ${BASE} AS python-base
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3=3.11.2-1+b1 python3-venv=3.11.2-1+b1 \
 && rm -rf /var/lib/apt/lists/*
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1

FROM python-base AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src/ src/
COPY producers/ producers/
COPY streams/ streams/
COPY sql/ sql/
COPY kb/ kb/
COPY bpf/ bpf/
RUN python3 -m venv /opt/build \
 && /opt/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python-base AS agent
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-bpfcc=0.26.0+ds-1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=builder /wheels/ /tmp/wheels/
# --system-site-packages: bcc's Python bindings come from Debian's dist-packages, not PyPI (PyPI's `bcc` is unrelated)
RUN python3 -m venv --system-site-packages /opt/fleetscope \
 && /opt/fleetscope/bin/pip install --no-cache-dir /tmp/wheels/fleetscope-*.whl \
 && rm -rf /tmp/wheels \
 && /opt/fleetscope/bin/python -c "import bcc, fleetscope.producers.agent"
ENV PATH=/opt/fleetscope/bin:$PATH
# Runs as root on purpose: it loads eBPF programs and reads every process's /proc (Kubernetes grants only the
# capabilities it needs: deploy/kubernetes/10-agent-daemonset.yaml). Healthy while it answers on its /metrics.
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 CMD ["python3", "-m", "fleetscope.health"]
ENTRYPOINT ["fleetscope"]
CMD ["agent"]

FROM python-base AS worker
COPY --from=builder /wheels/ /tmp/wheels/
RUN python3 -m venv /opt/fleetscope \
 && /opt/fleetscope/bin/pip install --no-cache-dir /tmp/wheels/fleetscope-*.whl \
 && rm -rf /tmp/wheels \
 && useradd --system --uid 10001 --home-dir /var/lib/fleetscope --create-home --shell /usr/sbin/nologin fleetscope
ENV PATH=/opt/fleetscope/bin:$PATH FLEETSCOPE_DATA_DIR=/var/lib/fleetscope
USER 10001
WORKDIR /var/lib/fleetscope
# Healthy while `streams` answers on its /metrics, or `sink` on its loopback store endpoint (fleetscope/health.py).
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 CMD ["python3", "-m", "fleetscope.health"]
ENTRYPOINT ["fleetscope"]
CMD ["streams"]

# The image for the agent and the stream workers of the production-shaped stack
# (docker-compose.yml). The agent needs bcc from Debian, so this is Debian-based.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends python3-bpfcc make && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/fleetscope
COPY . .
RUN python -m venv .venv && .venv/bin/pip install --no-cache-dir -e . \
 && ln -s /usr/lib/python3/dist-packages/bcc "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/bcc"
ENV PATH=/opt/fleetscope/.venv/bin:$PATH
ENTRYPOINT ["fleetscope"]

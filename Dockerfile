# syntax=docker/dockerfile:1
#
# The sessionfleet image: one image, one entrypoint (`sessionfleet`) for the operator,
# the router, the Endpoint Picker (`sessionfleet epp`, the `epp` extra), the node agent
# and the simulated engine:
#
#   docker build -t ghcr.io/sessionfleet/sessionfleet:0.1.0 .
#   docker run --rm ghcr.io/sessionfleet/sessionfleet:0.1.0 version
#
# The build stage installs the package and its dependencies into a virtual environment;
# the final stage copies only that environment onto a slim Python, so no compiler,
# pip cache or source tree ships. See docs/install.md.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/sessionfleet
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY controllers ./controllers
# The epp extra (grpcio, the Envoy ext_proc messages, the gRPC health service) is
# installed so the chart's epp.enabled runs from this image; the import fails the build
# without it. pip and setuptools are needed only to install: removed, they take ~30 MB
# (with their bytecode) out of every node's pull.
RUN /opt/sessionfleet/bin/pip install --no-cache-dir ".[epp]" \
    && /opt/sessionfleet/bin/sessionfleet version \
    && /opt/sessionfleet/bin/python -c "import sessionfleet.epp.server" \
    && /opt/sessionfleet/bin/pip uninstall --yes --quiet pip setuptools \
    && /opt/sessionfleet/bin/sessionfleet version

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="sessionfleet" \
      org.opencontainers.image.description="Session-aware GPU inference fleets on Kubernetes: operator, router, Endpoint Picker, node agent, simulated engine" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/sessionfleet/sessionfleet"
# A fixed, unprivileged identity that matches the chart's runAsUser, so the pod
# security context and the image agree; no home directory, no login shell.
RUN groupadd --system --gid 65532 sessionfleet \
    && useradd --system --uid 65532 --gid 65532 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin sessionfleet
COPY --from=build /opt/sessionfleet /opt/sessionfleet
# Unbuffered logs reach `kubectl logs` at once; no .pyc writes on a read-only root
# filesystem.
ENV PATH=/opt/sessionfleet/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER 65532:65532
# Operator metrics, operator health (/healthz), router and simulated engine, and the
# Endpoint Picker's gRPC port.
EXPOSE 8080 8081 8000 9002
ENTRYPOINT ["sessionfleet"]
CMD ["--help"]

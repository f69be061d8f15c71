# kvxferd: one daemon per GPU, as a sidecar of the inference engine.
#
#   docker build -t kvxferd .                                    # torch CPU build (host-memory caches)
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t kvxferd:cuda .
#   docker run --rm kvxferd demo                                 # the README's demo, inside the image
#
# Stage 1 builds a virtual environment; stage 2 copies it into a slim image
# that runs as an unprivileged user with `kvxferd serve` as its command.
ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/kvxferd
# torch first, from the chosen index, so the package's torch requirement is
# already met and pip never pulls the multi-GB CUDA build by accident.
RUN /opt/kvxferd/bin/pip install torch==2.13.0 --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY kvxferd ./kvxferd
RUN /opt/kvxferd/bin/pip install . \
 && /opt/kvxferd/bin/kvxferd serve --help > /dev/null

FROM python:${PYTHON}-slim AS runtime
LABEL org.opencontainers.image.title="kvxferd" \
      org.opencontainers.image.description="Disaggregated KV-cache transfer daemon (NIXL data plane)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 kvxferd \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvxferd \
 && mkdir -p /run/kvxferd && chown kvxferd:kvxferd /run/kvxferd
COPY --from=build /opt/kvxferd /opt/kvxferd
ENV PATH=/opt/kvxferd/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    KVXFERD_ENGINE_SOCKET=/run/kvxferd/engine.sock
USER 10001:10001
# peer (gRPC), notify bus (ZMQ PUB), metrics (Prometheus)
EXPOSE 47100 47200 9464
# grpc.health.v1 over the engine socket (KVXFERD_ENGINE_SOCKET): the peer port may speak mutual TLS only.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["kvxferd", "health"]
ENTRYPOINT ["kvxferd"]
CMD ["serve"]

# kvxferd: one daemon per GPU, as a sidecar of the inference engine.
#
#   docker build -t kvxferd .                                    # torch CPU build, NIXL for CPU (host-memory caches)
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#                --build-arg NIXL_VARIANT=cu12 -t kvxferd:cuda .  # CUDA 12 torch and NIXL (13: cu130, cu13)
#   docker run --rm --shm-size=1g kvxferd demo                   # the README's demo; 64 MB of /dev/shm is too little
#   scripts/build_image.sh                                       # no registry: podman, a debootstrap base, /opt/wheels
#
# Build arguments: BASE, an image with python3 >= 3.11 and its venv module (python:3.11-slim, or the
# Debian bookworm base scripts/build_image.sh makes); TORCH_SPEC and TORCH_INDEX, where torch comes from
# (a requirement and its index, or a wheel file the build mounts, with TORCH_INDEX empty); NIXL_VARIANT,
# which one NIXL wheel: cu12, cu13 (CUDA torch builds) or cpu (the cu13 wheel without its GPU-only
# expert-parallel kernels: NIXL has no CPU wheel, and its UCX runs without a GPU).
#
# Stages: `deps` makes a virtual environment with torch, the NIXL wheel and kvxferd's other
# requirements (cached until pyproject.toml or an argument changes); `build` turns kvxferd's source
# into a wheel and checks it loads NIXL; `runtime` copies the environment into a clean base, installs
# the wheel (a change of the source makes a layer of a few MB, not a second copy of the environment)
# and runs as an unprivileged user with `kvxferd serve` as its command.
ARG BASE=python:3.11-slim

FROM ${BASE} AS deps
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
RUN python3 -m venv /opt/kvxferd
# torch first, from the chosen index or file, so the package's torch requirement is already met
# and pip never pulls the multi-GB CUDA build by accident.
RUN /opt/kvxferd/bin/pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
# The `nixl` meta package requires both nixl-cu12 and nixl-cu13 (~430 MB together): install the
# package's requirements with `nixl` replaced by the one wheel chosen, then the meta package (it
# picks the wheel at import) without its dependencies. (The argument comes here, after torch: the
# variants share every layer before this one.)
ARG NIXL_VARIANT=cpu
COPY pyproject.toml README.md ./
RUN case "$NIXL_VARIANT" in cu12) wheel=nixl-cu12 ;; cu13|cpu) wheel=nixl-cu13 ;; \
        *) echo "NIXL_VARIANT must be cu12, cu13 or cpu, not '$NIXL_VARIANT'" >&2; exit 2 ;; esac \
 && NIXL_WHEEL=$wheel /opt/kvxferd/bin/python -c "import os, re, tomllib; print('\n'.join(re.sub(r'^nixl(?![-\w])', os.environ['NIXL_WHEEL'], d) for d in tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
 && /opt/kvxferd/bin/pip install -r /tmp/requirements.txt \
 && /opt/kvxferd/bin/pip install --no-deps "nixl==$(/opt/kvxferd/bin/python -c "import importlib.metadata as m; print(m.version('$wheel'))")" \
 && if [ "$NIXL_VARIANT" = cpu ]; then rm -rf /opt/kvxferd/lib/python3*/site-packages/nixl_ep_cu*; fi

FROM deps AS build
COPY kvxferd ./kvxferd
# The wheel, installed here once to check it: the CLI starts and a NIXL agent with UCX comes up, as
# the daemon makes one (the chosen NIXL wheel loads).
RUN /opt/kvxferd/bin/pip wheel --no-deps --wheel-dir /dist . \
 && /opt/kvxferd/bin/pip install --no-deps /dist/kvxferd-*.whl \
 && /opt/kvxferd/bin/kvxferd serve --help > /dev/null \
 && /opt/kvxferd/bin/python -c "from kvxferd.xfer.nixl_module import nixl_api; api, _ = nixl_api(); api.nixl_agent('build-check', api.nixl_agent_config(backends=['UCX']))"

FROM ${BASE} AS runtime
LABEL org.opencontainers.image.title="kvxferd" \
      org.opencontainers.image.description="Disaggregated KV-cache transfer daemon (NIXL data plane)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 kvxferd \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvxferd \
 && mkdir -p /run/kvxferd && chown kvxferd:kvxferd /run/kvxferd
COPY --from=deps /opt/kvxferd /opt/kvxferd
COPY --from=build /dist /tmp/dist
RUN /opt/kvxferd/bin/pip install --no-deps --no-cache-dir --disable-pip-version-check --root-user-action=ignore \
        /tmp/dist/kvxferd-*.whl \
 && rm -rf /tmp/dist
ENV PATH=/opt/kvxferd/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
# No EXPOSE: by default the peer port (47100), the notify bus (47200) and the metrics endpoint (9464)
# listen on 127.0.0.1 only (kvxferd/service/config.py). A deployment that opens one sets its host
# (with TLS, CURVE) and publishes the port itself, as the Helm chart does.
#
# grpc.health.v1 over the engine socket (the peer port may speak mutual TLS only). With no --target,
# `kvxferd health` asks the daemon serving in this container on whatever --engine-socket it was given:
# the daemon records it in its runtime directory, /run/kvxferd (kvxferd/wire/serving.py).
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["kvxferd", "health"]
ENTRYPOINT ["kvxferd"]
CMD ["serve"]

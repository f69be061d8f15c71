# kvxferd: one daemon per GPU, as a sidecar of the inference engine. The image has no torch: the daemon
# imports none (torch is the `engine` extra's, for the vLLM connector and the GPU checks).
#
#   docker build -t kvxferd .                                   # NIXL for host-memory caches (no GPU needed)
#   docker build --build-arg NIXL_VARIANT=cu12 -t kvxferd:cu12 .  # NIXL and the CUDA runtime for CUDA 12 (13: cu13)
#   docker run --rm --shm-size=1g kvxferd demo                  # the README's demo; 64 MB of /dev/shm is too little
#   scripts/build_image.sh                                      # no registry: podman, a debootstrap base
#
# Build arguments: BASE, an image with python3 >= 3.11 and its venv module (python:3.11-slim, or the
# Debian bookworm base scripts/build_image.sh makes); NIXL_VARIANT, which one NIXL wheel: cu12, cu13
# (GPU nodes) or cpu (the cu13 wheel without its GPU-only parts: NIXL has no CPU wheel, and its UCX
# runs without a GPU).
#
# Stages: `deps` makes a virtual environment with the NIXL wheel, the CUDA runtime library for the
# cu variants and kvxferd's other requirements (cached until pyproject.toml or the argument changes);
# `build` turns kvxferd's source into a wheel and checks it loads NIXL and that no torch came with it;
# `runtime` copies the environment into a clean base, installs the wheel (a change of the source makes
# a layer of a few MB, not a second copy of the environment) and runs as an unprivileged user with
# `kvxferd serve` as its command.
ARG BASE=python:3.11-slim

FROM ${BASE} AS deps
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
RUN python3 -m venv /opt/kvxferd
# NIXL's wheels (nixl-cu12, nixl-cu13) require torch, which neither they nor the daemon import (only
# their expert-parallel kernels, nixl_ep, need it): the package's requirements go in without `nixl`,
# then the one NIXL wheel chosen and the `nixl` meta package (it picks the installed wheel at import)
# without their dependencies, and nixl_ep goes. The `nixl` meta package would also pull both wheels
# (~430 MB together).
# A CUDA torch used to bring the CUDA runtime; the cu variants now take it from NVIDIA's wheel:
# UCX's CUDA memory hooks (libucm_cuda.so) and NIXL's GDS, GPUNETIO and LIBFABRIC plugins link
# libcudart.so.12/.13, and the daemon's CUDA IPC imports use it. Its directory goes into the loader's
# configuration in the runtime stage (/opt/kvxferd/cuda-runtime.conf). The driver (libcuda.so.1) comes
# from the node, mounted by the container runtime.
ARG NIXL_VARIANT=cpu
COPY pyproject.toml README.md ./
RUN case "$NIXL_VARIANT" in cu12) wheel=nixl-cu12 cudart=nvidia-cuda-runtime-cu12 ;; \
        cu13) wheel=nixl-cu13 cudart="nvidia-cuda-runtime>=13,<14" ;; cpu) wheel=nixl-cu13 cudart= ;; \
        *) echo "NIXL_VARIANT must be cu12, cu13 or cpu, not '$NIXL_VARIANT'" >&2; exit 2 ;; esac \
 && /opt/kvxferd/bin/python -c "import re, tomllib; print('\n'.join(d for d in tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'] if not re.match(r'nixl(?![-\w])', d)))" > /tmp/requirements.txt \
 && /opt/kvxferd/bin/pip install -r /tmp/requirements.txt ${cudart:+"$cudart"} \
 && /opt/kvxferd/bin/pip install --no-deps "$wheel" \
 && /opt/kvxferd/bin/pip install --no-deps "nixl==$(/opt/kvxferd/bin/python -c "import importlib.metadata as m; print(m.version('$wheel'))")" \
 && rm -rf /opt/kvxferd/lib/python3*/site-packages/nixl_ep* \
 && find /opt/kvxferd/lib -name 'libcudart.so.*' -printf '%h\n' | sort -u > /opt/kvxferd/cuda-runtime.conf

FROM deps AS build
COPY kvxferd ./kvxferd
# The wheel, installed here once to check it: the CLI starts and a NIXL agent with UCX comes up, as
# the daemon makes one (the chosen NIXL wheel loads).
RUN /opt/kvxferd/bin/pip wheel --no-deps --wheel-dir /dist . \
 && /opt/kvxferd/bin/pip install --no-deps /dist/kvxferd-*.whl \
 && /opt/kvxferd/bin/kvxferd serve --help > /dev/null \
 && /opt/kvxferd/bin/python -c "from kvxferd.xfer.nixl.nixl_module import nixl_api; api, _ = nixl_api(); api.nixl_agent('build-check', api.nixl_agent_config(backends=['UCX']))" \
 && /opt/kvxferd/bin/python -c "import importlib.util as u, sys; sys.exit('torch came into the image' if u.find_spec('torch') else 0)"

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
 && rm -rf /tmp/dist \
 && cp /opt/kvxferd/cuda-runtime.conf /etc/ld.so.conf.d/kvxferd-cuda-runtime.conf && ldconfig
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

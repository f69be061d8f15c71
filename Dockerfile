# kvxferd image. Not yet built in CI (no Docker engine on the build machines);
# issue #5 adds the health check, the daemon entrypoint and validation.
# TORCH_INDEX selects torch's build: the CPU index by default, a CUDA index for GPU nodes.
ARG PYTHON=3.11
FROM python:${PYTHON}-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvxferd ./kvxferd
RUN python -m venv /opt/kvxferd \
 && /opt/kvxferd/bin/pip install --no-cache-dir torch==2.13.0 --index-url "${TORCH_INDEX}" \
 && /opt/kvxferd/bin/pip install --no-cache-dir .

FROM python:${PYTHON}-slim
RUN useradd --create-home --uid 10001 kvxferd
COPY --from=build /opt/kvxferd /opt/kvxferd
ENV PATH=/opt/kvxferd/bin:$PATH PYTHONUNBUFFERED=1
USER kvxferd
ENTRYPOINT ["kvxferd"]
CMD ["demo"]

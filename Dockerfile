# syntax=docker/dockerfile:1
#
# skippy-stage: one pipeline stage of an LLM per container.
#
#   docker build -t skippy-stage .
#   docker run --rm -p 7000:7000 -v "$PWD/stage.json:/config/stage.json:ro" -v /models:/models:ro skippy-stage
#
# The builder compiles llama-cpp-python once and turns the project and every dependency into
# wheels; the runtime image installs those wheels only (no compiler, no network at install).
#
# CPU kernels: portable by default. llama.cpp's CPU backend is built once per CPU family
# (x64, sse42, sandybridge, haswell, skylakex, icelake, alderlake, sapphirerapids, zen4, ...)
# and ggml loads the best one for the host at start (GGML_BACKEND_DL), as llama.cpp's own
# images do: one image runs on an AVX2 EPYC and an AVX-512/AMX Xeon alike. A native build
# (-march=native of the *build* host) is a little faster there and dies with SIGILL on an
# older CPU; pick it only when the image never leaves hosts like the one that built it:
#   --build-arg CMAKE_ARGS="-DGGML_NATIVE=ON"
# For GPUs, build on images that carry CUDA and Python 3.11 and turn the backend on, e.g.
#   --build-arg PYTHON_IMAGE=<cuda image with python3.11> \
#   --build-arg CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_CUDA=on"

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ARG CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Dependencies first, from pyproject.toml alone: the llama-cpp-python compile (minutes) is a
# layer that only a dependency change invalidates, not an edit to the code.
COPY pyproject.toml README.md ./
# With GGML_BACKEND_DL the wheel of llama-cpp-python carries one libggml-cpu-<family>.so per
# CPU family (installed to site-packages/bin); skippy-stage loads them at start
# (llama_ffi.init_backend) and ggml picks the best one for the CPU it finds.
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
    && CMAKE_ARGS="${CMAKE_ARGS}" pip wheel --wheel-dir /wheels -r requirements.txt
COPY proto ./proto
COPY skippy_stage ./skippy_stage
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS runtime
# libgomp1: llama.cpp's CPU backend uses OpenMP.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 skippy \
    && useradd --system --uid 10001 --gid skippy --home-dir /home/skippy --create-home \
        --shell /usr/sbin/nologin skippy \
    && mkdir -p /config /models /var/cache/skippy-stage \
    && chown skippy:skippy /var/cache/skippy-stage \
    && python -m venv /opt/skippy-stage
ENV PATH=/opt/skippy-stage/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SKIPPY_STAGE_CACHE=/var/cache/skippy-stage
# Wheels only, bind-mounted from the builder so they never become a layer of this image.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels skippy-stage \
    && skippy-stage info

USER 10001:10001
WORKDIR /home/skippy
# Stage files sliced at start are cached here; mount a volume to keep them across restarts.
VOLUME ["/var/cache/skippy-stage"]
# 7000: gRPC (stage service, health, reflection); 7001: TCP frames (frame_port, hop_transport "tcp");
# 9100: Prometheus metrics (metrics_port).
EXPOSE 7000 7001 9100
# The standard gRPC health protocol, exit 0 only on SERVING (the head: only once the chain
# below it answers; every stage: NOT_SERVING while it drains). Same check as the Compose files.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; r = g.HealthStub(grpc.insecure_channel('127.0.0.1:7000')).Check(h.HealthCheckRequest(), timeout=4); sys.exit(0 if r.status == h.HealthCheckResponse.SERVING else 1)"]
# serve drains in-flight work on SIGTERM within --grace seconds, then exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["skippy-stage"]
CMD ["serve", "--config", "/config/stage.json"]

# The trainer's CUDA image: ddp-launch (then torchrun) as PID 1's exec-form entrypoint, a
# non-root user. `make image` builds it, also on a machine without a registry (README, "The image").
#   docker build -t ddp-trainer:0.1.0 .
#   behind a TLS-intercepting proxy: add --secret id=pip_ca,src=/path/to/ca-bundle.pem
# No `# syntax=` line: the frontend built into the engine (Dockerfile 1.2: RUN --mount) is
# enough, and naming one makes BuildKit pull it from a registry, which air-gapped builders lack.
#
# The base: python:3.11-slim-bookworm pinned by digest (CPython 3.11, which image-requirements.txt
# is resolved for). The digest is the one two public Dockerfiles pin; it was not pulled here
# (no registry). Check or refresh it with `docker buildx imagetools inspect python:3.11-slim-bookworm`.
ARG BASE_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

# ---- deps: the 5 GB of pinned packages, rebuilt only when image-requirements.txt changes --
FROM ${BASE_IMAGE} AS deps
ENV VIRTUAL_ENV=/opt/venv \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
    HOME=/tmp \
    TMPDIR=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib
# UID/GID 10001 is the chart's runAsUser; group 0 owns nothing writable, so an arbitrary
# UID (OpenShift) runs too: the only writable paths are mounted volumes (/tmp, /dev/shm,
# /checkpoints), which the read-only root filesystem leaves to Kubernetes.
RUN groupadd --gid 10001 trainer && \
    useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin trainer && \
    mkdir -p /checkpoints && chown 10001:10001 /checkpoints
# A package index other than PyPI (a mirror); credentials never go here, they would be in the history.
ARG PIP_INDEX_URL=https://pypi.org/simple
# Exactly the lock's packages, each checked against its hash (--no-deps: nothing unpinned
# comes in; `pip check`: nothing is missing). The venv has no pip of its own: the base's pip
# installs into it. The optional CA bundle is a secret mount: it never lands in a layer.
RUN --mount=type=bind,source=image-requirements.txt,target=/run/image-requirements.txt \
    --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi && \
    python3 -m venv --without-pip "$VIRTUAL_ENV" && \
    python3 -m pip --python "$VIRTUAL_ENV/bin/python" install --no-deps --require-hashes \
        --requirement /run/image-requirements.txt && \
    python3 -m pip --python "$VIRTUAL_ENV/bin/python" check

# ---- wheel: the project, built with the lock's setuptools ---------------------------------
FROM deps AS wheel
RUN --mount=type=bind,target=/src,rw \
    python3 -m pip --python "$VIRTUAL_ENV/bin/python" wheel --no-deps --no-build-isolation \
        --wheel-dir /dist /src

# ---- runtime: deps plus the project in a layer of its own (under 1 MB per code change) ----
FROM deps AS runtime
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="ddp-trainer" \
      org.opencontainers.image.description="Data-parallel PyTorch trainer run by torchrun in a Kubeflow PyTorchJob" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/ddp-trainer/ddp-trainer"
# The compiler torch.compile needs: inductor builds its CPU kernels with g++, Triton its
# launcher with gcc, both against Python.h (python:3.11-slim has it; Debian's own python3, the
# stand-in base, in python3-dev). A layer of its own after the packages, so that neither
# changes the other's cache; docs/performance.md says what it adds. Pinned to bookworm's
# versions, the base's release.
RUN apt-get update && \
    apt-get install --yes --no-install-recommends g++=4:12.2.0-3 && \
    if [ ! -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]; then \
        apt-get install --yes --no-install-recommends python3-dev=3.11.2-1+b1; \
    fi && \
    rm -rf /var/lib/apt/lists/* && \
    g++ --version
RUN --mount=type=bind,from=wheel,source=/dist,target=/dist \
    python3 -m pip --python "$VIRTUAL_ENV/bin/python" install --no-deps --no-index /dist/*.whl && \
    "$VIRTUAL_ENV/bin/python" -c "import trainer, torch; print('torch', torch.__version__)"
ENV PATH="/opt/venv/bin:$PATH"
USER 10001:10001
WORKDIR /tmp
EXPOSE 23456 9401 9402
# exec form: ddp-launch is PID 1 and gets SIGTERM, which it forwards to torchrun; it checks
# the config, waits for the rendezvous host, then runs torchrun with the options after "--"
# (the rest come from the operator's PET_* env)
ENTRYPOINT ["ddp-launch"]
CMD ["--", "-m", "trainer", "--config", "digits"]

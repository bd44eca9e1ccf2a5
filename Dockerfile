# syntax=docker/dockerfile:1.7
# The trainer's CUDA image: torchrun as PID 1's exec-form entrypoint, a non-root user.
#   docker build -t ddp-trainer:0.1.0 .
ARG PYTHON_VERSION=3.11

# ---- build: resolve and install pinned dependencies into a virtual environment --------
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv
RUN python -m venv "$VIRTUAL_ENV"
ENV PATH="$VIRTUAL_ENV/bin:$PATH"
WORKDIR /src
# dependencies first, so code changes reuse this layer; torch==2.13.0 from PyPI is the
# CUDA build (it brings its CUDA and cuDNN runtime libraries as nvidia-* wheels)
COPY pyproject.toml constraints.txt README.md ./
COPY trainer/__init__.py trainer/__init__.py
RUN pip install -c constraints.txt .
COPY trainer trainer
COPY operator_scripts operator_scripts
# the project itself, installed the way CI installs it (constraints.txt), without dev extras
RUN pip install --no-deps -c constraints.txt . && \
    python -c "import trainer, torch; print(torch.__version__)"

# ---- runtime: the environment only, run as an unprivileged user ------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="ddp-trainer" \
      org.opencontainers.image.description="Data-parallel PyTorch trainer run by torchrun in a Kubeflow PyTorchJob" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/ddp-trainer/ddp-trainer"
ENV VIRTUAL_ENV=/opt/venv \
    PATH="/opt/venv/bin:$PATH" \
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
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /tmp
EXPOSE 23456 9401
# exec form: ddp-launch is PID 1 and gets SIGTERM, which it forwards to torchrun; it checks
# the config, waits for the rendezvous host, then runs torchrun with the options after "--"
# (the rest come from the operator's PET_* env)
ENTRYPOINT ["ddp-launch"]
CMD ["--", "-m", "trainer", "--config", "digits"]

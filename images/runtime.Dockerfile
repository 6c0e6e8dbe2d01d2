# syntax=docker/dockerfile:1
# specrl runtime image: the coordinator, trainer and rollout workers of an RLJob (`specrl worker <role>`).
# CUDA torch and vLLM come from their PyPI wheels (which bundle the CUDA user-space libraries); the NVIDIA
# driver comes from the node through the NVIDIA container toolkit, so a slim Python base is enough.
#
#   docker build -f images/runtime.Dockerfile -t ghcr.io/specrl/specrl:0.1.0-vllm .
#   docker build -f images/runtime.Dockerfile --build-arg EXTRAS=runtime -t ghcr.io/specrl/specrl:0.1.0 .
#
# The `-vllm` tag rolls out with the vLLM backend; the plain tag (the RLJob API's default image) with specrl's own
# engine on CUDA torch.
#
# The operator runs its pods with uid 1000 (restricted Pod Security Standard), the job's ConfigMap at
# /etc/specrl and a cache volume at /var/cache/specrl (models, checkpoints: SPECRL_CACHE_DIR).
ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator/ operator/
COPY runtime/ runtime/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim
ARG EXTRAS=runtime,vllm
RUN useradd --uid 1000 --user-group --create-home --home-dir /home/specrl --shell /usr/sbin/nologin specrl \
    && mkdir -p /var/cache/specrl && chown 1000:1000 /var/cache/specrl
COPY --from=build /wheels /wheels
# vLLM pins the CUDA torch it was built against; installing both extras in one resolve keeps them consistent.
RUN pip install --no-cache-dir "$(ls /wheels/specrl-*.whl)[${EXTRAS}]" && rm -rf /wheels
ENV PYTHONUNBUFFERED=1 HOME=/home/specrl SPECRL_CACHE_DIR=/var/cache/specrl HF_HOME=/var/cache/specrl/huggingface
USER 1000:1000
WORKDIR /home/specrl
# coordinator HTTP (/status, /drain, /metrics), Ray GCS, worker metrics, torch.distributed rendezvous
EXPOSE 8000 6379 9090 29500
ENTRYPOINT ["specrl"]
CMD ["--help"]

# syntax=docker/dockerfile:1
# specrl operator image: Python + kopf (its login and our aiohttp adapter reach the API server), no torch (the operator
# never imports it) and no kubernetes client (operator/README.md).
#
#   docker build -f images/operator.Dockerfile -t ghcr.io/specrl/specrl-operator:0.1.0 .
#
# The Helm chart runs it as `specrl operator ...` with uid 10001, a read-only root filesystem and /tmp on an
# emptyDir; `helm test` runs `python /specrl-test/helm-test.py` in it (needs only the base dependencies).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator/ operator/
COPY runtime/ runtime/
# Base dependencies only: no `runtime` extra, so no torch, transformers or ray.
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin specrl
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels specrl && rm -rf /wheels \
    && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
USER 10001:10001
# metrics, liveness (/healthz)
EXPOSE 8080 8081
ENTRYPOINT ["specrl", "operator"]

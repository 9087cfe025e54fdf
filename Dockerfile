# caravan: the scheduler (`caravan scheduler`) and the router (`caravan router`)
# in one image. Build from the repository root with `make image`, which runs:
#
#   docker build -t caravan-llm:<version> .
#
# The jobspecs in jobspecs/ run it with the docker driver; push it to a
# registry every Nomad client can pull from.
#
# Two stages. The first builds the wheel and installs it, without the `demo`
# extra, into /install, then deletes devcluster and the example profiles (the
# wheel carries both for `caravan demo`). The image is the second stage: Python
# and /install, nothing else of the build context, so no layer of it holds
# devcluster, the example profiles or the sources.

FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /build
COPY pyproject.toml README.md ./
COPY caravan_llm/ caravan_llm/
COPY examples/profiles/ examples/profiles/
RUN pip wheel --no-deps --wheel-dir /wheels . \
    && pip install --prefix=/install /wheels/caravan_llm-*.whl \
    && site=/install/lib/python3.11/site-packages \
    && rm -rf "$site/caravan_llm/devcluster" "$site/caravan_llm/cli/example_profiles_data" \
    && PYTHONPATH="$site" python -c 'import caravan_llm.cli.main, caravan_llm.router.wiring.app, caravan_llm.scheduler.app'

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

COPY --from=build /install /usr/local

# A fixed, unprivileged user: the processes need no root and write nothing
# outside Nomad's task directories.
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin caravan
USER 10001:10001
WORKDIR /tmp

# Router default port, scheduler default port (both overridable by flags).
EXPOSE 8080 8090

ENTRYPOINT ["caravan"]
CMD ["--help"]

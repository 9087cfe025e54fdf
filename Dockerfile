# caravan: the scheduler (`caravan scheduler`) and the router (`caravan router`)
# in one image. Build from the repository root:
#
#   docker build -t caravan:0.1.0 .
#
# The jobspecs in jobspecs/ run it with the docker driver; push it to a
# registry every Nomad client can pull from.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what `pip install .` needs: the build metadata and the packages.
WORKDIR /build
COPY pyproject.toml README.md ./
COPY caravan/ caravan/
COPY scheduler/ scheduler/
COPY router/ router/
COPY devcluster/ devcluster/
COPY caravan_cli/ caravan_cli/
RUN pip install . \
    && rm -rf /build

# A fixed, unprivileged user: the processes need no root and write nothing
# outside Nomad's task directories.
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin caravan
USER 10001:10001
WORKDIR /tmp

# Router default port, scheduler default port (both overridable by flags).
EXPOSE 8080 8090

ENTRYPOINT ["caravan"]
CMD ["--help"]

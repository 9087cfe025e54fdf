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

# Only what building the wheel needs: the build metadata and the packages
# pyproject lists (devcluster and the example profiles among them, since the
# wheel carries them for the `demo` extra). The runtime is installed without
# that extra, and devcluster and the example profiles are removed in the same
# layer: the production image holds none of the demo.
WORKDIR /build
COPY pyproject.toml README.md ./
COPY caravan/ caravan/
COPY scheduler/ scheduler/
COPY router/ router/
COPY devcluster/ devcluster/
COPY caravan_cli/ caravan_cli/
COPY examples/profiles/ examples/profiles/
RUN pip install . \
    && site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && rm -rf "$site/devcluster" "$site/caravan_cli/example_profiles_data" /build \
    && python -c 'import caravan_cli.main, router.wiring.app, scheduler.app'

# A fixed, unprivileged user: the processes need no root and write nothing
# outside Nomad's task directories.
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin caravan
USER 10001:10001
WORKDIR /tmp

# Router default port, scheduler default port (both overridable by flags).
EXPOSE 8080 8090

ENTRYPOINT ["caravan"]
CMD ["--help"]

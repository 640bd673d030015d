# Prometheus from Debian's package, for running the compose stack where no
# image registry is reachable (the tests); it takes the same command-line
# flags as the official image, which the compose file passes.
ARG BASE_IMAGE=debian:12
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus \
 && chown nobody:nogroup /prometheus
USER nobody
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]

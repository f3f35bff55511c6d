# A Debian 12 machine for the course, for macOS and Windows (Docker Desktop) or to keep it apart
# from your own system: Debian 12 with git, make and ca-certificates, as the fresh root that
# scripts/fresh-check.sh tests, and this checkout in /course. Not built on the course's own
# machine (it has no Docker engine); the root it copies is what the fresh check proves.
#
#   docker build -t dtc .
#   docker run -it --name dtc dtc            # a shell in /course: make run, make lesson01, ...
#   docker start -ai dtc                     # back into the same container later
FROM debian:12
RUN apt-get update \
 && apt-get install -y --no-install-recommends git make ca-certificates \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /course
COPY . /course
CMD ["bash"]

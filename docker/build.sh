#!/usr/bin/env bash
# Build the Docker image with no network inside the build: bash docker/build.sh
#
# 1. The base: BASE=<image> when given (the NVIDIA PyTorch image for GPUs, pulled or loaded
#    beforehand); otherwise a CPU base made here from Debian's packages with debootstrap (needs
#    root and the debootstrap package; Debian 13, whose Python 3.13 meets the project's >= 3.12).
# 2. The wheelhouse: every wheel the image needs, downloaded by the base image's own Python in
#    a container (docker/wheelhouse.py; the host's CA bundle and a pip cache are mounted), once
#    per base and set of requirements.
# 3. The build: docker build --network none, the wheelhouse imported as an image and mounted
#    into the RUN steps that install; nothing inside the build reaches the network.
#
# Environment:
#   BASE                base image                      [a Debian CPU base made here]
#   TAG                 image tag                       [mimir-megatron:0.1.0-cpu, or :0.1.0 with BASE]
#   MIMIR_DOCKER_CACHE  the CPU base's root file system, the wheelhouses and pip's cache, kept
#                       between builds                  [/var/cache/mimir-docker]
#   WHEELHOUSE          a wheelhouse filled elsewhere (air-gapped machines: fill it where the
#                       network is, copy it over)       [$MIMIR_DOCKER_CACHE/wheelhouse/<base>]
#   DEBIAN_MIRROR       [http://deb.debian.org/debian]   DEBIAN_SUITE  [trixie]
#   DOCKER              docker client with BuildKit (buildx, or Debian's docker.io) [found]
# Prints the build time and the image size at the end. docs/operations.md ("Docker").
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${MIMIR_DOCKER_CACHE:-/var/cache/mimir-docker}"
suite="${DEBIAN_SUITE:-trixie}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
cpu_base="mimir-base:debian-$suite"
base="${BASE:-$cpu_base}"
if [ -n "${BASE:-}" ]; then tag="${TAG:-mimir-megatron:0.1.0}"; else tag="${TAG:-mimir-megatron:0.1.0-cpu}"; fi

die() {
    echo "docker/build.sh: $*" >&2
    exit 1
}
say() { echo "docker/build.sh: $*" >&2; }

# A client that builds with BuildKit (the legacy builder has no RUN --mount and ignores
# docker/Dockerfile.dockerignore): one with the buildx plugin, or a client older than 23 (Debian's
# docker.io), whose BuildKit is built in.
find_client() {
    local candidate major
    for candidate in ${DOCKER:-docker /usr/bin/docker}; do
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" buildx version >/dev/null 2>&1; then
            echo "$candidate buildx build --load"
            return 0
        fi
        major="$("$candidate" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)" || true
        if [ -n "$major" ] && [ "$major" -lt 23 ] 2>/dev/null; then
            echo "$candidate build"
            return 0
        fi
    done
    return 1
}

command -v docker >/dev/null 2>&1 || command -v "${DOCKER:-/usr/bin/docker}" >/dev/null 2>&1 \
    || die "no docker command: install Docker (Debian: apt-get install docker.io)"
build_cmd="$(find_client)" \
    || die "no docker client with BuildKit: install the buildx plugin, or Debian's docker.io (its client has BuildKit built in)"
read -r -a build <<<"$build_cmd"
docker=("${build[0]}")
if ! server_err="$("${docker[@]}" version --format '{{.Server.Version}}' 2>&1 >/dev/null)"; then
    case "$server_err" in
        *"permission denied"*) die "no permission on the Docker socket: run as root or join the docker group (usermod -aG docker \$USER)" ;;
        *) die "no Docker daemon answers: start it (systemctl start docker, or as root: dockerd &)" ;;
    esac
fi

make_cpu_base() {
    [ "$(id -u)" = 0 ] || die "making the CPU base needs root (debootstrap): run as root, or give BASE=<image with python3 and pip>"
    command -v debootstrap >/dev/null 2>&1 || die "no debootstrap: apt-get install debootstrap (or give BASE=<image>)"
    local rootfs="$cache/rootfs-$suite"
    say "making the CPU base $cpu_base from Debian $suite ($mirror) in $rootfs (about 2-4 min)"
    rm -rf "$rootfs.tmp"
    mkdir -p "$cache"
    debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates \
        "$suite" "$rootfs.tmp" "$mirror" >"$cache/debootstrap.log" 2>&1 \
        || die "debootstrap failed (is $mirror reachable?); log: $cache/debootstrap.log"
    chroot "$rootfs.tmp" apt-get clean
    rm -rf "$rootfs.tmp"/var/lib/apt/lists/* "$rootfs.tmp"/var/cache/apt/*.bin
    rm -rf "$rootfs" && mv "$rootfs.tmp" "$rootfs"
    tar --numeric-owner -C "$rootfs" -c . \
        | "${docker[@]}" import --change 'CMD ["/bin/bash"]' \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            - "$cpu_base" >/dev/null
}

if ! "${docker[@]}" image inspect "$base" >/dev/null 2>&1; then
    if [ "$base" = "$cpu_base" ]; then
        make_cpu_base
    else
        die "base image $base is not on this machine: docker pull $base (air-gapped: docker save on a connected machine, docker load -i here)"
    fi
fi

py_tag="$("${docker[@]}" run --rm --network none --entrypoint python3 "$base" \
    -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")' 2>/dev/null)" \
    || die "base image $base has no python3"
case "$py_tag" in cp3[0-9] | cp310 | cp311) die "base image $base runs Python ${py_tag#cp3} (3.x); the project needs Python >= 3.12" ;; esac

wheelhouse="${WHEELHOUSE:-$cache/wheelhouse/${base//[^A-Za-z0-9._-]/_}}"
if [ -n "${WHEELHOUSE:-}" ]; then
    for part in torch deps; do
        [ -f "$wheelhouse/$part/PYTHON" ] || die "WHEELHOUSE=$wheelhouse has no $part/PYTHON: fill it with docker/build.sh (unset WHEELHOUSE)"
        have="$(cat "$wheelhouse/$part/PYTHON")"
        [ "$have" = "$py_tag" ] || die "WHEELHOUSE=$wheelhouse holds wheels for $have, base $base runs $py_tag: fill one for this base (unset WHEELHOUSE)"
    done
elif ! "${docker[@]}" run --rm --network none --entrypoint python3 -v "$repo/docker:/src:ro" \
        -v "$wheelhouse:/wheelhouse:ro" "$base" /src/wheelhouse.py current /wheelhouse 2>/dev/null; then
    say "filling the wheelhouse $wheelhouse for $py_tag (pip in a container of $base)"
    mkdir -p "$wheelhouse" "$cache/pip"
    ca=()
    for bundle in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
        if [ -f "$bundle" ]; then
            ca=(-v "$bundle:/etc/mimir-host-ca.crt:ro" -e PIP_CERT=/etc/mimir-host-ca.crt)
            break
        fi
    done
    "${docker[@]}" run --rm --entrypoint python3 "${ca[@]}" -e PIP_BREAK_SYSTEM_PACKAGES=1 \
        -e PIP_DISABLE_PIP_VERSION_CHECK=1 -e "PIP_INDEX_URL=${PIP_INDEX_URL:-https://pypi.org/simple}" \
        -e PIP_CACHE_DIR=/pip-cache -v "$cache/pip:/pip-cache" \
        -v "$repo/docker:/src:ro" -v "$wheelhouse:/wheelhouse" "$base" /src/wheelhouse.py fill /wheelhouse \
        || die "filling the wheelhouse failed (no route to the package index? fill WHEELHOUSE where there is one)"
fi

# The wheelhouse enters the build as an image of its own (imported once per fill), mounted where
# pip reads it: nothing of it is sent with the build context or kept in the image's layers.
wheel_image="mimir-wheelhouse:${py_tag}-$(cat "$wheelhouse/torch/STAMP" "$wheelhouse/deps/STAMP" | sha256sum | cut -c1-16)"
if ! "${docker[@]}" image inspect "$wheel_image" >/dev/null 2>&1; then
    say "importing the wheelhouse as $wheel_image"
    tar -C "$wheelhouse" -c torch deps | "${docker[@]}" import - "$wheel_image" >/dev/null
fi

say "building $tag from $base ($py_tag), no network inside the build"
start="$(date +%s)"
DOCKER_BUILDKIT=1 "${build[@]}" --network none --progress plain --build-arg "BASE=$base" \
    --build-arg "WHEELHOUSE=$wheel_image" \
    -f "$repo/docker/Dockerfile" -t "$tag" "$repo"
seconds="$(($(date +%s) - start))"
size="$("${docker[@]}" image inspect -f '{{.Size}}' "$tag")"
say "built $tag in ${seconds} s; image size $((size / 1000000)) MB"

#!/usr/bin/env bash
# Build the sessionfleet image from the committed Dockerfile, unchanged, without a Docker
# engine: Debian's buildah (chroot isolation) on a base made with mmdebstrap.
#
#   e2e/tools/build-image.sh            # prints the image name, e.g. localhost/sessionfleet:3f2a…
#   SESSIONFLEET_IMAGE_VLLM=1 e2e/tools/build-image.sh   # also Dockerfile.vllm (see below)
#
# The base is a minbase Debian 12 root with python3, python3-venv, python-is-python3 and
# passwd, standing in for python:3.11-slim (Debian 12's Python is 3.11). It is built once
# into ~/.cache/sessionfleet/images/ and imported as localhost/sessionfleet-base:bookworm.
# The image is tagged with a hash of the build context (Dockerfile, .dockerignore,
# pyproject.toml, README.md, operator/, controllers/): an unchanged context reuses the
# image. The build reaches the package index through this machine's CA bundle, which is
# mounted into the build.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${SESSIONFLEET_CACHE:-$HOME/.cache/sessionfleet}/images
BASE=localhost/sessionfleet-base:bookworm
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
mkdir -p "$CACHE"

log() { echo "build-image: $*" >&2; }

need() {
    local missing=()
    for tool in buildah mmdebstrap; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    [ ${#missing[@]} -eq 0 ] && return
    if [ "$(id -u)" != 0 ]; then
        log "missing ${missing[*]}: install them (apt-get install ${missing[*]}) or run as root"
        exit 1
    fi
    log "installing ${missing[*]} with apt"
    # A fresh machine may have no package lists yet: fetch them once if the install fails.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2 || {
        apt-get update -q >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2
    }
}

base() {
    if buildah inspect --type image "$BASE" >/dev/null 2>&1; then
        return
    fi
    local root=$CACHE/bookworm-python.tar
    if [ ! -s "$root" ]; then
        log "making the base root (mmdebstrap, about 30 s)"
        mmdebstrap --quiet --variant=minbase \
            --include=python3,python3-venv,python-is-python3,passwd \
            bookworm "$CACHE/partial.tar" >&2
        mv "$CACHE/partial.tar" "$root"
    fi
    local ctr
    ctr=$(buildah from scratch)
    buildah add --quiet "$ctr" "$root" / >/dev/null
    buildah commit --quiet "$ctr" "$BASE" >/dev/null
    buildah rm "$ctr" >/dev/null
}

context_hash() {
    cd "$REPO"
    git ls-files -z --cached --others --exclude-standard -- \
        Dockerfile Dockerfile.vllm .dockerignore pyproject.toml README.md operator controllers \
        | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}

build() {
    local dockerfile=$1 image=$2
    shift 2
    if buildah inspect --type image "$image" >/dev/null 2>&1; then
        log "$image is built (same context)"
        return
    fi
    log "building $image from $dockerfile"
    local started=$SECONDS
    buildah bud --quiet --isolation chroot \
        --volume "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro" \
        --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
        "$@" -t "$image" -f "$REPO/$dockerfile" "$REPO" >&2
    log "built $image in $((SECONDS - started)) s"
    # Earlier contexts' images of the same name would pile up in the store: drop them.
    local name=${image%:*} old
    for old in $(buildah images --noheading --format '{{.Name}}:{{.Tag}}' | grep "^$name:"); do
        [ "$old" = "$image" ] || buildah rmi "$old" >/dev/null 2>&1 || true
    done
}

need
base
HASH=$(context_hash)
IMAGE=localhost/sessionfleet:$HASH
build Dockerfile "$IMAGE" --build-arg "PYTHON_IMAGE=$BASE"
if [ -n "${SESSIONFLEET_IMAGE_VLLM:-}" ]; then
    # vLLM's image is a CUDA image of several GB that this machine cannot pull; the same
    # Python base stands in for it, with a venv's python3 on PATH as vLLM's image has pip
    # under python3. What this proves: Dockerfile.vllm's own steps (copy, install the
    # package without its dependencies, the environment) work; not vLLM itself.
    VLLM_BASE=localhost/sessionfleet-vllm-standin:bookworm
    if ! buildah inspect --type image "$VLLM_BASE" >/dev/null 2>&1; then
        ctr=$(buildah from "$BASE")
        buildah run --isolation chroot "$ctr" python3 -m venv /opt/venv >&2
        buildah config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
        buildah commit --quiet "$ctr" "$VLLM_BASE" >/dev/null
        buildah rm "$ctr" >/dev/null
    fi
    build Dockerfile.vllm "localhost/sessionfleet-vllm:$HASH" --build-arg "VLLM_IMAGE=$VLLM_BASE"
fi
echo "$IMAGE"

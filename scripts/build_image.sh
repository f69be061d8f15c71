#!/usr/bin/env bash
# Build the kvxferd container image where no container registry is reachable (Debian's apt
# repositories and PyPI are enough):
#
#   1. podman and debootstrap, installed with apt-get when missing (as root; else it says what to install);
#   2. a minimal Debian bookworm base (python3, python3-venv, ca-certificates) made by debootstrap,
#      with Debian's security updates, kept as a tarball in the cache directory (~/.cache/kvxferd-image)
#      and imported with `podman import`;
#   3. `podman build` of the Dockerfile on that base (no torch: the daemon's image has none);
#   4. the image's size and the build's time.
#
# Usage: scripts/build_image.sh [--tag kvxferd:latest] [--nixl-variant cpu|cu12|cu13] [--no-cache]
#                               [--rebuild-base] [--cache-dir DIR]
# Exit status: 0 built, 1 the build failed, 3 it cannot run here (not root, no podman or debootstrap).
# Needs nothing from the repository's virtual environments.
set -euo pipefail
cd "$(dirname "$0")/.."

tag=kvxferd:latest
nixl_variant=cpu
no_cache=()
rebuild_base=0
cache_dir=${KVXFERD_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvxferd-image}
mirror=${KVXFERD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${KVXFERD_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
suite=bookworm  # its python3 is 3.11 (kvxferd needs >= 3.11)
base_packages=python3,python3-venv,ca-certificates

while [ $# -gt 0 ]; do
    case "$1" in
        --tag) tag=$2; shift 2 ;;
        --nixl-variant) nixl_variant=$2; shift 2 ;;
        --no-cache) no_cache=(--no-cache); shift ;;
        --rebuild-base) rebuild_base=1; shift ;;
        --cache-dir) cache_dir=$2; shift 2 ;;
        -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
        *) echo "build_image: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$nixl_variant" in cpu|cu12|cu13) ;; *) echo "build_image: --nixl-variant must be cpu, cu12 or cu13" >&2; exit 2 ;; esac

say() { echo "build_image: $*" >&2; }
cannot() { say "$*"; exit 3; }

# 1. Tools. debootstrap and podman's storage under /var/lib/containers need root.
if [ "$(id -u)" != 0 ]; then
    cannot "needs root (debootstrap, rootful podman); as root it installs what is missing: apt-get install podman debootstrap"
fi
if ! command -v podman > /dev/null || ! command -v debootstrap > /dev/null; then
    say "installing podman and debootstrap with apt-get"
    install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman debootstrap)
    "${install[@]}" > /dev/null 2>&1 || { apt-get update -qq > /dev/null 2>&1 && "${install[@]}" > /dev/null; } \
        || cannot "apt-get could not install podman and debootstrap"
fi
# Where podman's defaults cannot run a container, a drop-in gives it what runs (podman >= 4.3 reads it):
#  - hybrid cgroups with a controller on cgroup v2 (crun refuses them: "cgroups in hybrid mode not
#    supported"): runc, which handles them;
#  - no CAP_SYS_RESOURCE (a sandboxed root): podman asks for RLIMIT_NOFILE 1048576 and NPROC 4194304,
#    which nothing may raise to here; ask for what podman itself has (it runs with NPROC <= 32768).
settings=()
if [ ! -e /sys/fs/cgroup/cgroup.controllers ] && [ -n "$(cat /sys/fs/cgroup/unified/cgroup.controllers 2>/dev/null)" ]; then
    command -v runc > /dev/null || env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        runc > /dev/null || cannot "hybrid cgroups here, which crun refuses; apt-get could not install runc"
    settings+=("[engine]" 'runtime = "runc"')
fi
if (( ! ((0x$(awk '/^CapEff/ {print $2}' /proc/self/status) >> 24) & 1) )); then
    nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
    [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ] && nproc=32768
    settings=("[containers]" "default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=$nproc:$nproc\"]" "${settings[@]}")
fi
dropin=/etc/containers/containers.conf.d/50-kvxferd-build-image.conf
if [ ${#settings[@]} -gt 0 ]; then
    mkdir -p "$(dirname "$dropin")"
    printf '%s\n' "# Written by kvxferd's scripts/build_image.sh: what podman needs to run containers on this host." \
        "${settings[@]}" > "$dropin"
fi
podman=(podman)
if ! podman info > /dev/null 2>&1; then  # no overlay here (an overlay root, an old kernel): the slow, plain driver
    podman=(podman --storage-driver vfs)
    "${podman[@]}" info > /dev/null || cannot "podman does not run here (podman info fails with overlay and vfs)"
fi

# 2. The base: one per package list, suite and mirror; rebuilt only when one of them changes.
key=$(echo "$suite $base_packages $mirror $security_mirror" | sha256sum | cut -c1-12)
base=localhost/kvxferd-base:$suite-$key
tarball=$cache_dir/base-$suite-$key.tar
mkdir -p "$cache_dir"
if [ "$rebuild_base" = 1 ]; then
    rm -f "$tarball"
    "${podman[@]}" image rm -f "$base" > /dev/null 2>&1 || true
fi
if ! "${podman[@]}" image exists "$base"; then
    if [ ! -f "$tarball" ]; then
        say "making the $suite base with debootstrap ($base_packages)"
        start=$(date +%s)
        rootfs=$(mktemp -d "$cache_dir/rootfs.XXXXXX")
        trap 'rm -rf "$rootfs"' EXIT
        debootstrap --variant=minbase --include="$base_packages" "$suite" "$rootfs" "$mirror" > "$cache_dir/debootstrap.log" 2>&1 \
            || { tail -n 20 "$cache_dir/debootstrap.log" >&2; exit 1; }
        # debootstrap installs the release as published; the security and point updates come on top, as in
        # Debian's own images (the base is made again with --rebuild-base, e.g. for newer fixes).
        printf 'deb %s %s main\n' "$mirror" "$suite" "$mirror" "$suite-updates" "$security_mirror" "$suite-security" \
            > "$rootfs/etc/apt/sources.list"
        chroot "$rootfs" sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get upgrade -y -qq' \
            >> "$cache_dir/debootstrap.log" 2>&1 || { tail -n 20 "$cache_dir/debootstrap.log" >&2; exit 1; }
        # What an image never uses: downloaded packages, package lists and caches, documentation (copyrights stay).
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* \
               "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
        find "$rootfs/usr/share/doc" -type f ! -name copyright -delete
        tar -C "$rootfs" --numeric-owner -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
        rm -rf "$rootfs"
        trap - EXIT
        say "base made in $(( $(date +%s) - start )) s ($(du -h "$tarball" | cut -f1) uncompressed)"
    fi
    "${podman[@]}" import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' "$tarball" "$base" > /dev/null
fi

# 3. The image. --format docker: the OCI format has no HEALTHCHECK. --network host: pip reaches PyPI
# without container networking (CNI) being set up here.
build_args=()
# The host's CA bundle over the base's in every RUN step (a bind mount: never in a layer), so that pip
# trusts what the host trusts: a proxy that re-signs TLS, as where this was written, included.
ca_bundle=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
[ -f "$ca_bundle" ] && build_args+=(--volume "$(realpath "$ca_bundle")":/etc/ssl/certs/ca-certificates.crt:ro)
say "building $tag (NIXL: $nixl_variant) on $base"
start=$(date +%s%N)
"${podman[@]}" build --format docker --network host --pull=never "${no_cache[@]}" --build-arg BASE="$base" \
    --build-arg NIXL_VARIANT="$nixl_variant" "${build_args[@]}" --tag "$tag" . >&2 || exit 1
seconds=$(( ($(date +%s%N) - start) / 1000000000 ))

# 4. What it cost.
size=$("${podman[@]}" image inspect --format '{{.Size}}' "$tag")
echo "$tag $seconds $size" | awk '{printf "build_image: built %s in %d s; image size %.2f GB (%d bytes)\n", $1, $2, $3 / 1e9, $3}'

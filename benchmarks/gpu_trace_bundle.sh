#!/usr/bin/env bash
# Prepare, on this Debian machine, what the GPU device machine cannot fetch for
# benchmarks/gpu_trace_check.py: nothing outside that machine can be reached, and its
# image has PyTorch and numpy but no bcc and no kernel headers for bcc to compile with.
#
# Writes .gpu_bundle/bcc-bundle.tar.xz (ignored by git through .git/info/exclude):
#   lib/       libbcc, libbcc_bpf and every library they load except glibc's own
#              (LLVM, clang, z3, ICU, libelf, ...), copied from this machine
#   python/    Debian's bcc Python package (pure Python; it loads lib/libbcc.so.0)
#   usr/src/   the kernel headers bcc compiles against here (/lib/modules/$(uname -r)/build
#              and source); bcc needs headers, not an exact match, for uprobes
#   MANIFEST   where each part came from
# Then carry it: device run with carry [".gpu_bundle"] (see gpu_trace_check.py).
# Measured here (2 shared cores): 59 MB with all architectures' headers, 11 min of xz;
# the carried tree may hold 64 MiB in all, so keep the bundle the only large thing.
#   bash benchmarks/gpu_trace_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu_bundle
grep -qx '/.gpu_bundle/' .git/info/exclude 2>/dev/null || echo '/.gpu_bundle/' >>.git/info/exclude
mkdir -p "$out"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib" "$stage/python" "$stage/usr/src"

libbcc="$(ls /usr/lib/x86_64-linux-gnu/libbcc.so.0 2>/dev/null)" \
  || { echo "gpu_trace_bundle: libbcc.so.0 not found; install Debian's python3-bpfcc (install.sh)" >&2; exit 1; }
glibc_own='^(libc|libm|libdl|libpthread|librt|ld-linux-x86-64|libresolv|libutil)\.so'
for f in "$libbcc" /usr/lib/x86_64-linux-gnu/libbcc_bpf.so.0 \
         $(ldd "$libbcc" | awk '$3 ~ /^\// {print $3}'); do
  base="$(basename "$f")"
  [[ "$base" =~ $glibc_own ]] && continue
  cp -L "$f" "$stage/lib/$base"
done
cp -r /usr/lib/python3/dist-packages/bcc "$stage/python/bcc"
find "$stage/python" -name __pycache__ -prune -exec rm -rf {} +

kver="$(uname -r)"
build="$(readlink -f "/lib/modules/$kver/build")"
source="$(readlink -f "/lib/modules/$kver/source" 2>/dev/null || true)"
[ -f "$build/Makefile" ] || { echo "gpu_trace_bundle: no kernel headers at /lib/modules/$kver/build (run install.sh)" >&2; exit 1; }
cp -a "$build" "$stage/usr/src/"
if [ -n "$source" ] && [ "$source" != "$build" ]; then cp -a "$source" "$stage/usr/src/"; fi
# x86-64 only: the other architectures' headers are 20 MB of the common package
find "$stage/usr/src" -mindepth 3 -maxdepth 3 -path '*/arch/*' ! -name x86 -exec rm -rf {} +
{
  echo "made $(date -u +%FT%TZ) on $(. /etc/os-release; echo "$PRETTY_NAME"), glibc $(ldd --version | head -1 | awk '{print $NF}')"
  echo "bcc $(dpkg-query -W -f='${Version}' python3-bpfcc 2>/dev/null || echo '?')"
  echo "headers_build $(basename "$build")"
  echo "headers_source $(basename "${source:-$build}")"
  echo "libs $(ls "$stage/lib" | tr '\n' ' ')"
} >"$stage/MANIFEST"
tar -C "$stage" -cf - . | xz -T2 -6 >"$out/bcc-bundle.tar.xz.tmp"
mv "$out/bcc-bundle.tar.xz.tmp" "$out/bcc-bundle.tar.xz"
cat "$stage/MANIFEST"
du -h "$out/bcc-bundle.tar.xz"

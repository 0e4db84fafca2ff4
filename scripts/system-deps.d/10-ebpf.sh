#!/usr/bin/env bash
# System packages for the eBPF CUDA API probes (gpudiag probe cuda), Debian 12.
#
# Installs bcc (bpfcc-tools, python3-bpfcc) and gcc, and builds a kernel header tree for
# bcc under .cache/kernel-headers/tree in the checkout. The headers are Debian's 6.12
# ones: uprobe and tracepoint programs do not depend on the exact kernel build, and the
# running kernel may have no header package at all. The header packages are downloaded
# and unpacked (apt-get download + dpkg -x), not installed: installing them drags in a
# kernel image. Nothing is written under /lib/modules.
#
# Idempotent and non-interactive; run as root (scripts/setup --test does).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive LC_ALL=C

checkout="$(cd "$(dirname "$0")/../.." && pwd -P)"
cache="$checkout/.cache/kernel-headers"
headers_meta="linux-headers-6.12-amd64"

if [[ "$(id -u)" != 0 ]]; then
  echo "10-ebpf.sh: must run as root (it installs packages with apt-get)" >&2
  exit 1
fi

# Root writes into the checkout: refuse a cache path that is (or passes through) a
# symbolic link, so a planted link cannot redirect root's writes elsewhere.
for p in "$checkout/.cache" "$cache"; do
  if [[ -L "$p" ]]; then
    echo "10-ebpf.sh: refusing to use $p: it is a symbolic link" >&2
    exit 1
  fi
done

updated=0
apt_update_once() {
  if [[ "$updated" == 0 ]]; then
    apt-get update -qq >&2
    updated=1
  fi
}

missing=()
for pkg in bpfcc-tools python3-bpfcc gcc; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
if ((${#missing[@]})); then
  apt_update_once
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# The metapackage names the concrete "<version>-amd64" package, which names its "-common"
# companion: resolve both now rather than hard-coding a revision.
depends_of() { apt-cache depends "$1" 2>/dev/null | sed -n 's/^ *|\?Depends: //p'; }
resolve_headers() {
  amd64_pkg="$(depends_of "$headers_meta" | grep -E '^linux-headers-.*-amd64$' | head -n1 || true)"
  common_pkg=""
  if [[ -n "$amd64_pkg" ]]; then
    common_pkg="$(depends_of "$amd64_pkg" | grep -E '^linux-headers-.*-common$' | head -n1 || true)"
  fi
}
resolve_headers
if [[ -z "$amd64_pkg" || -z "$common_pkg" ]]; then
  apt_update_once
  resolve_headers
fi
if [[ -z "$amd64_pkg" || -z "$common_pkg" ]]; then
  echo "10-ebpf.sh: apt knows no $headers_meta (is bookworm-security enabled?)" >&2
  exit 1
fi
version="${amd64_pkg#linux-headers-}"
version="${version%-amd64}"

if [[ -f "$cache/VERSION" && "$(cat "$cache/VERSION")" == "$version" && -f "$cache/tree/Makefile" ]]; then
  echo "kernel headers $version already in $cache/tree" >&2
  exit 0
fi

work="$(mktemp -d "$checkout/.cache/kernel-headers.XXXXXX" 2>/dev/null || true)"
if [[ -z "$work" ]]; then
  mkdir -p "$checkout/.cache"
  work="$(mktemp -d "$checkout/.cache/kernel-headers.XXXXXX")"
fi
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/debs" "$work/common" "$work/amd64"
(
  cd "$work/debs"
  # apt-get download runs as the _apt user when it can; a private directory it cannot
  # write to only costs a warning, so download as root explicitly.
  apt-get download -qq -o APT::Sandbox::User=root "$amd64_pkg" "$common_pkg" >&2 \
    || { apt_update_once; apt-get download -qq -o APT::Sandbox::User=root "$amd64_pkg" "$common_pkg" >&2; }
)
dpkg -x "$work/debs/${common_pkg}"_*.deb "$work/common"
dpkg -x "$work/debs/${amd64_pkg}"_*.deb "$work/amd64"

common_src="$work/common/usr/src/linux-headers-$version-common"
amd64_src="$work/amd64/usr/src/linux-headers-$version-amd64"
for d in "$common_src" "$amd64_src"; do
  [[ -d "$d" ]] || { echo "10-ebpf.sh: unexpected package layout, no $d" >&2; exit 1; }
done

# The symbolic-link copies point at absolute paths, so the unpacked packages move to
# their final place first. VERSION is written last: an interrupted run is redone.
rm -rf "$cache"
mkdir -p "$cache/tree"
mv "$common_src" "$cache/common"
mv "$amd64_src" "$cache/amd64"
cp -rs "$cache/common/." "$cache/tree/"
cp -rsf "$cache/amd64/." "$cache/tree/"
echo "$version" > "$cache/VERSION"
echo "kernel headers $version unpacked into $cache/tree" >&2

#!/usr/bin/env bash
# System package for the HTML report tests: Debian's chromium, run headless to load the
# report of `gpudiag investigate --html` (JavaScript errors, charts drawn, a screenshot).
#
# Installed without recommends, plus a font so that text in the screenshot is drawn.
# A no-op where apt-get is not Debian's (the browser test then says why it cannot run).
# Idempotent and non-interactive; run as root (scripts/setup --test does). apt-get update
# runs at most once, and only when a package is missing.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive LC_ALL=C

if command -v chromium >/dev/null && fc-list 2>/dev/null | grep -qi dejavu; then
  echo "chromium $(dpkg-query -W -f='${Version}' chromium 2>/dev/null || echo '(not from dpkg)') already installed" >&2
  exit 0
fi

if [[ ! -r /etc/debian_version ]] || ! command -v apt-get >/dev/null; then
  echo "40-chromium.sh: not a Debian system; install chromium by hand for the HTML report tests" >&2
  exit 0
fi

if [[ "$(id -u)" != 0 ]]; then
  echo "40-chromium.sh: must run as root (it installs packages with apt-get)" >&2
  exit 1
fi

packages=(chromium fonts-dejavu-core)
if ! apt-get install -y -qq --no-install-recommends "${packages[@]}" >&2; then
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${packages[@]}" >&2
fi
command -v chromium >/dev/null || { echo "40-chromium.sh: chromium missing after install" >&2; exit 1; }
echo "chromium $(dpkg-query -W -f='${Version}' chromium) installed" >&2

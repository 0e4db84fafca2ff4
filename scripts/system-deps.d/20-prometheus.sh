#!/usr/bin/env bash
# System package for the exporter tests: Debian's prometheus, for `promtool check metrics`
# (the agent's /metrics output must pass its lint) and a real Prometheus for query checks.
#
# Installed without recommends; the package's own service is not needed by the tests and
# is left as Debian sets it up. Idempotent and non-interactive; run as root
# (scripts/setup --test does). apt-get update runs at most once, and only when the
# package is missing.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive LC_ALL=C

if [[ "$(id -u)" != 0 ]]; then
  echo "20-prometheus.sh: must run as root (it installs packages with apt-get)" >&2
  exit 1
fi

if dpkg-query -W -f='${Status}' prometheus 2>/dev/null | grep -q "install ok installed" \
    && command -v promtool >/dev/null; then
  echo "prometheus $(dpkg-query -W -f='${Version}' prometheus) already installed" >&2
  exit 0
fi

if ! apt-get install -y -qq --no-install-recommends prometheus >&2; then
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends prometheus >&2
fi
command -v promtool >/dev/null || { echo "20-prometheus.sh: promtool missing after install" >&2; exit 1; }
echo "prometheus $(dpkg-query -W -f='${Version}' prometheus) installed" >&2

#!/usr/bin/env bash
# System package for the `gpudiag top` tests: tmux, a real terminal the tests drive
# (start the live view, capture the screen, press q).
#
# Idempotent and non-interactive; run as root (scripts/setup --test does). apt-get update
# runs at most once, and only when the package is missing.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive LC_ALL=C

if command -v tmux >/dev/null; then
  echo "tmux $(tmux -V | cut -d' ' -f2) already installed" >&2
  exit 0
fi

if [[ "$(id -u)" != 0 ]]; then
  echo "30-tmux.sh: must run as root (it installs packages with apt-get)" >&2
  exit 1
fi

if ! apt-get install -y -qq --no-install-recommends tmux >&2; then
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends tmux >&2
fi
command -v tmux >/dev/null || { echo "30-tmux.sh: tmux missing after install" >&2; exit 1; }
echo "tmux $(tmux -V | cut -d' ' -f2) installed" >&2

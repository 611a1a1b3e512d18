#!/usr/bin/env bash
# Installs Debian's headless-capable Chromium for the HTML rendering test of
# `dplc viz --format html` (tests/viz.rs). Idempotent; needs root (or sudo)
# and the Debian package mirror. Prints the browser's path on the last line.
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
    SUDO=""
    [[ $(id -u) -eq 0 ]] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq >&2
    $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >&2
fi
command -v chromium

#!/bin/sh
# The real components some tests start on loopback (Debian packages): installed once, by
# `make test`, only when missing and when running as root on a system with apt-get (CI is
# root). Elsewhere nothing is installed, and the tests that need them skip and say why.
# Usage: tests/system/install.sh COMMAND=PACKAGE ...
missing=""
for pair in "$@"; do
    command -v "${pair%%=*}" >/dev/null 2>&1 || missing="$missing ${pair#*=}"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "not installing$missing (needs root and apt-get): the tests that use them will skip"
    exit 0
fi
echo "installing$missing for the tests (Debian packages)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $missing >/dev/null \
    || echo "could not install$missing: the tests that use them will skip"

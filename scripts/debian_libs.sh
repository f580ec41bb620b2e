#!/usr/bin/env bash
# Usage: scripts/debian_libs.sh SONAME:PACKAGE...  Each shared library that the dynamic
# loader does not know is installed from its Debian package (as root, with apt-get);
# without root or apt-get, the script stops naming the packages to install.
set -euo pipefail
missing=()
for pair in "$@"; do
    soname=${pair%%:*} package=${pair#*:}
    /sbin/ldconfig -p 2>/dev/null | grep -q "$soname" || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "missing system libraries: install the Debian packages ${missing[*]}" \
        "(apt-get install -y ${missing[*]}) and run make again" >&2
    exit 1
fi
echo "installing ${missing[*]} (Debian packages)" >&2
for try in 1 2 3; do
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}" >/dev/null && exit 0
    [ "$try" = 3 ] && break
    echo "apt-get: try $try of 3 failed; again in 10 s" >&2
    sleep 10
done
echo "apt-get could not install ${missing[*]}" >&2
exit 1

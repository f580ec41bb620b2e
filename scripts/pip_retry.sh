#!/usr/bin/env bash
# make's pip installs go through this: up to 3 tries, so that a package index answer cut
# short (seen 2026-12-03: pip's JSONDecodeError on a truncated index page) costs a retry,
# not the build. Usage: scripts/pip_retry.sh PYTHON -m pip install ARGS...
for try in 1 2 3; do
    "$@" && exit 0
    status=$?
    [ "$try" = 3 ] && break
    echo "pip_retry: try $try of 3 failed (exit $status): $*; again in 10 s" >&2
    sleep 10
done
echo "pip_retry: gave up after 3 tries: $*" >&2
exit "$status"

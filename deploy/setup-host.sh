#!/bin/bash
# Prepare a Debian/Ubuntu host to run tokentrace: BCC from the distribution, kernel
# headers where BCC looks for them, tracefs mounted. Idempotent; run as root.
#
# When the running kernel has no headers package (cloud and VM kernels), Debian's
# linux-headers-amd64 is linked in as /lib/modules/$(uname -r)/{build,source}: BCC
# compiles against it and tokentrace never reads kernel structs through it (socket
# probes use syscall tracepoints, GPU probes uprobes).
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "setup-host.sh: run as root" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
kv=$(uname -r)
arch=$(dpkg --print-architecture)

need=()
dpkg -s python3-bpfcc >/dev/null 2>&1 || need+=(python3-bpfcc)
# a C compiler builds the GPU stand-in libraries the tests trace (samples/gpu)
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
# the real verbs.h: the ibverbs stand-ins are built against it (not needed at run time)
[ -f /usr/include/infiniband/verbs.h ] || need+=(libibverbs-dev)
if [ ! -d "/lib/modules/$kv/build/include" ]; then
  if apt-cache show "linux-headers-$kv" >/dev/null 2>&1; then
    need+=("linux-headers-$kv")
  else
    dpkg -s "linux-headers-$arch" >/dev/null 2>&1 || need+=("linux-headers-$arch")
  fi
fi
# venv for Debian's python3: tests/test_deploy.py runs the image recipe with it
dpkg -s python3-venv >/dev/null 2>&1 || need+=(python3-venv)
# Debian's own interpreter (libpython linked into the executable): tests/test_flame.py
# finds and checks it beside the project's; said by name so its tests never skip
[ -x /usr/bin/python3.11 ] || need+=(python3.11)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if [ ! -d "/lib/modules/$kv/build/include" ]; then
  hdr=$(ls -d /usr/src/linux-headers-*-"$arch" 2>/dev/null | sort -V | tail -1)
  common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -1)
  [ -n "$hdr" ] || { echo "setup-host.sh: no kernel headers found under /usr/src" >&2; exit 1; }
  mkdir -p "/lib/modules/$kv"
  ln -sfn "$hdr" "/lib/modules/$kv/build"
  ln -sfn "${common:-$hdr}" "/lib/modules/$kv/source"
  echo "setup-host.sh: linked $hdr as the headers of kernel $kv"
fi

mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
mountpoint -q /sys/kernel/debug || mount -t debugfs nodev /sys/kernel/debug 2>/dev/null || true

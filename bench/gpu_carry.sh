#!/bin/bash
# Make what a bench needs on an offline GPU host small enough to travel with the
# checkout (the device tool sends at most 64 MiB: tracked files, .gpu and .whl).
#
#   bash ../shared/gpu/prepare.sh     # fills .gpu/ (BCC, LLVM, kernel headers)
#   bash bench/gpu_carry.sh           # fills .whl/, trims .gpu/, prints the size
#
# .whl/: wheels for CPython 3.12 of the packages the GPU image lacks (as seen there on
# 2026-12-02): tokentrace's own dependencies and `transformers serve`'s ([serving]).
# Versions are this checkout's .venv's, so the host runs what the tests ran.
# On the host:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#       --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   eval "$(.gpu/setup-bcc.sh)"
#
# .gpu/: the kernel headers keep x86 alone (BCC compiles for the host's arch) and
# lose dt-bindings, sound, drm and media (no probe includes them); linux-kbuild goes
# (its programs build modules, BCC needs none). Checked on an H200 host (kernel 6.18):
# every probe compiled and loaded.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
py=.venv/bin/python
[ -x "$py" ] || { echo "gpu_carry: no .venv here: run the README's test command first" >&2; exit 1; }

missing="httptools opentelemetry-api opentelemetry-sdk opentelemetry-proto
opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-grpc
opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common
opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common
googleapis-common-protos importlib-metadata hpack pyelftools cxxfilt zstandard
openai httpx2 httpcore2 truststore h11 anyio sniffio distro jiter
pydantic pydantic-core annotated-types typing-inspection
fastapi starlette annotated-doc uvicorn"

grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
versions=$("$py" -m pip list --format=freeze 2>/dev/null)
for name in $missing; do
  pin=$(printf '%s\n' "$versions" | grep -i -E "^${name//-/[-_.]}==" | head -1 || true)
  [ -n "$pin" ] || pin=$name   # not in .venv (a dependency of one that is): newest
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$pin" 2>&1 \
    | grep -v '^WARNING: Location' || true
done

# zstandard carries two backends of ~12 MB each: keep the C extension, which it
# imports first
for w in .whl/zstandard-*.whl; do
  [ -e "$w" ] || continue
  if unzip -l "$w" | grep -q '_cffi'; then
    tmp=$(mktemp -d)
    (cd "$tmp" && unzip -q "$top/$w" && rm -f zstandard/_cffi*.so zstandard/backend_cffi.py \
      && sed -i '/_cffi\|backend_cffi/d' zstandard-*.dist-info/RECORD && rm "$top/$w" \
      && zip -q -9 -r "$top/$w" .)
    rm -rf "$tmp"
  fi
done

if [ -d .gpu/debs ]; then
  rm -f .gpu/debs/linux-kbuild-*.deb
  for deb in .gpu/debs/linux-headers-*-common_*.deb; do
    [ -e "$deb" ] || continue
    tmp=$(mktemp -d)
    dpkg-deb -R "$deb" "$tmp"
    src=$(ls -d "$tmp"/usr/src/linux-headers-*-common)
    if [ "$(ls "$src/arch")" != x86 ]; then
      for a in "$src"/arch/*; do [ "$(basename "$a")" = x86 ] || rm -rf "$a"; done
      rm -rf "$src"/include/{dt-bindings,sound,drm,media}
      dpkg-deb -Zxz -z9 -b "$tmp" "$deb" >/dev/null
    fi
    rm -rf "$tmp"
  done
fi

# what the device tool would send: tracked files, untracked files not ignored, and
# the two carried folders
bytes=$( { git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null \
           | tail -1 | cut -f1; du -sb .gpu .whl 2>/dev/null | cut -f1; } | paste -sd+ | bc)
mib=$((bytes / 1048576))
echo "gpu_carry: ${mib} MiB would travel with carry [\".gpu\", \".whl\"] (the limit is 64)"
if [ "$mib" -ge 64 ]; then
  echo "gpu_carry: over: move bench/results and samples/captures aside for the calls" \
       "(no bench reads them) and put them back with 'git checkout -- bench/results samples/captures'" >&2
fi

#!/usr/bin/env bash
# Makes .raybundle/ray-bundle.tar.xz: Ray for a lent GPU machine (CPython 3.12, manylinux, no package
# index there, at most 64 MiB carried per call). The 79 MB wheel less its Java jar (32 MB, for Java
# workers), the dashboard's web client, rllib and llm, plus the dependencies that machine lacks; about
# 30 MB compressed. Unpack there with: tar xJf .raybundle/ray-bundle.tar.xz -C .site
set -euo pipefail
cd "$(dirname "$0")/../../.."
version=${RAY_VERSION:-$(python3 -c 'import importlib.metadata as m; print(m.version("ray"))')}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
platforms="--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
  -d "$work/wheels" "ray==$version" click msgpack jsonschema attrs referencing rpds-py jsonschema-specifications
mkdir "$work/tree"
for w in "$work"/wheels/*.whl; do python3 -m zipfile -e "$w" "$work/tree"; done
rm -rf "$work"/tree/ray/jars "$work"/tree/ray/dashboard/client/build "$work"/tree/ray/rllib "$work"/tree/ray/llm
mkdir -p .raybundle && tar cJf .raybundle/ray-bundle.tar.xz -C "$work/tree" .
ls -l .raybundle/ray-bundle.tar.xz

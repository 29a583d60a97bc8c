#!/bin/sh
# Install ckpt-service into a new virtual environment: torch first (from TORCH_INDEX_URL, CPU build by default
# in the image), then a wheel built from the source tree, with the service, S3 and PostgreSQL extras.
#
#   docker/install.sh VENV SOURCE_DIR
#
# docker/Dockerfile runs this script to make the image's /opt/venv, and tests/test_deploy.py runs it to make a
# venv with the same steps, so the image's install cannot drift from what the tests check.
#
# Environment:
#   TORCH_VERSION    torch release, e.g. 2.13.0 (required)
#   TORCH_INDEX_URL  index that serves torch, e.g. https://download.pytorch.org/whl/cpu; empty: pip's own index
#   CKPT_EXTRAS      extras of ckpt-service to install (default: service,s3,postgres)
set -eu

venv=${1:?usage: install.sh VENV SOURCE_DIR}
src=${2:?usage: install.sh VENV SOURCE_DIR}
: "${TORCH_VERSION:?set TORCH_VERSION, e.g. 2.13.0}"
extras=${CKPT_EXTRAS:-service,s3,postgres}

python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip "$@"; }

if [ -n "${TORCH_INDEX_URL:-}" ]; then
    pip install "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
else
    pip install "torch==$TORCH_VERSION"
fi

wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
pip wheel --no-deps --wheel-dir "$wheels" "$src"
set -- "$wheels"/ckpt_service-*.whl
pip install "$1[$extras]"
pip check
"$venv/bin/ckptctl" --help >/dev/null

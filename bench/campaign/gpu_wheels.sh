#!/usr/bin/env bash
# Wheels the GPU campaign needs on a GPU machine without network (Python 3.12, x86-64), which has
# jax 0.11.2, flax, optax, orbax, chex, torch, transformers and triton 3.6 but not these:
#   bash bench/campaign/gpu_wheels.sh [DIR] # downloads into DIR (default .whl), here, with network
# then, on the GPU machine, before the campaign:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site:$PWD
# (from the checkout's root, where `python -m bench.campaign` then runs)
# --no-deps: each needed dependency is named below. Versions as used on 2026-11-23 (H200).
# jax-triton 0.3.1, not 0.4: 0.4 needs triton >= 3.7. xprof (32 MB) only for tokamax's import.
set -euo pipefail
dir=${1:-.whl}
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$dir" \
    grain==0.2.18 array_record==0.8.6 portpicker tensorboardX==2.6.5 redis==8.1.0 \
    jax-triton==0.3.1 \
    tokamax==0.0.17 einshape immutabledict qwix pydantic==2.14.3 pydantic-core==2.50.4 annotated-types \
    typing-inspection xprof==2.24.2 gviz-api

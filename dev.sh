#!/usr/bin/env bash
# One entry point for a fresh machine:
#   ./dev.sh demo   set everything up, then run a local demo cluster
#   ./dev.sh test   set everything up, then run every test (cargo + pytest)
#   ./dev.sh setup  only set up (.venv with pccl built in release mode, test deps, torch)
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
VENV=.venv

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch is optional for users; the tests that use it run whenever it installs.
    "$VENV/bin/python" -m pip install -q -e ".[test]"
    if [ "${PCCL_SKIP_TORCH:-0}" != "1" ]; then
        "$VENV/bin/python" -m pip install -q -e ".[torch]" \
            || echo "torch did not install: its tests will be skipped" >&2
    fi
}

case "${1:-}" in
    setup)
        setup
        ;;
    demo)
        setup
        shift
        "$VENV/bin/python" -m pccl demo "$@"
        ;;
    test)
        setup
        shift
        cargo test --locked
        "$VENV/bin/python" -m pytest "$@"
        ;;
    *)
        echo "usage: $0 {demo|test|setup}" >&2
        exit 2
        ;;
esac

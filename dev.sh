#!/usr/bin/env bash
# One entry point for a fresh machine:
#   ./dev.sh demo   install pccl (no test deps, no torch), then run a local demo cluster
#   ./dev.sh test   set everything up, run the static checks (below), then every test
#                   (cargo + pytest), then build the documentation strictly (what CI runs)
#   ./dev.sh check  only the static checks, on an existing setup: ruff, mypy --strict over
#                   pccl/, stubtest of pccl/_core.pyi against the built extension, cargo
#                   clippy (-D warnings) and cargo fmt --check
#   ./dev.sh docs   install the docs tools only, then build the documentation strictly
#                   (mkdocs + mkdocstrings read the sources: no Rust build needed)
#   ./dev.sh setup  only set up (.venv with pccl built in release mode, test and docs
#                   deps, torch)
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
VENV=.venv

venv() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip install -q --upgrade pip
}

# The demo (python -m pccl demo) needs only pccl and numpy (no torch).
setup_demo() {
    venv
    "$VENV/bin/python" -m pip install -q -e ".[numpy]"
}

# The pinned requirements of one optional extra in pyproject.toml, installed without
# (re)building pccl itself: the docs build reads the sources, it never imports them.
install_extra_requirements() {
    local reqs
    mapfile -t reqs < <("$VENV/bin/python" - "$1" <<'PYEOF'
import sys, tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"][sys.argv[1]]))
PYEOF
    )
    [ "${#reqs[@]}" -gt 0 ] || { echo "no extra '$1' in pyproject.toml" >&2; exit 1; }
    "$VENV/bin/python" -m pip install -q "${reqs[@]}"
}

docs() {
    # strict: a broken link, a missing page or a docstring griffe cannot parse fails it
    "$VENV/bin/mkdocs" build --strict -d "${PCCL_DOCS_DIR:-site}"
    echo "docs built into ${PCCL_DOCS_DIR:-site}/"
}

# Every check runs even after one failed; the step fails if any did. stubtest imports the
# extension as built into .venv (rebuild it after changing rust/py: ./dev.sh setup).
# stubtest_allowlist.txt: only what a stub cannot express, each entry with its reason.
check() {
    if [ ! -x "$VENV/bin/mypy" ] || [ ! -x "$VENV/bin/ruff" ]; then
        echo "./dev.sh check needs the test tools in $VENV: run ./dev.sh setup first" >&2
        exit 1
    fi
    local failed=()
    step() {
        echo "== $*" >&2
        "$@" || failed+=("$*")
    }
    step "$VENV/bin/ruff" check pccl tests bench
    step "$VENV/bin/mypy"
    step "$VENV/bin/python" -m mypy.stubtest pccl._core --allowlist stubtest_allowlist.txt
    step cargo clippy --all-targets --locked -- -D warnings
    step cargo fmt --check
    if [ "${#failed[@]}" -gt 0 ]; then
        printf 'check failed: %s\n' "${failed[@]}" >&2
        exit 1
    fi
    echo "all checks passed" >&2
}

# System tools some tests drive for real, installed when root on Debian/Ubuntu and
# missing (otherwise those tests skip, saying why): nftables (the NAT tests build routers
# out of network namespaces), chromium + chromium-driver (the status page in a headless
# browser), slurm-wlm + munge (a real single-node Slurm for the launcher test).
system_tools() {
    local want=() cmd pkg
    for cmd_pkg in nft:nftables chromium:chromium chromedriver:chromium-driver \
            slurmctld:slurm-wlm munged:munge; do
        cmd=${cmd_pkg%%:*} pkg=${cmd_pkg#*:}
        command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || want+=("$pkg")
    done
    if [ "${#want[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "${want[@]}"; } >/dev/null 2>&1 \
            || echo "${want[*]} did not install: the tests that need them will skip" >&2
    fi
}

setup() {
    system_tools
    venv
    # torch is optional for users; the tests that use it run whenever it installs.
    "$VENV/bin/python" -m pip install -q -e ".[test,docs]"
    if [ "${PCCL_SKIP_TORCH:-0}" != "1" ]; then
        "$VENV/bin/python" -m pip install -q -e ".[torch]" \
            || echo "torch did not install: its tests will be skipped" >&2
    fi
    # Ray is optional too (pccl.launch.ray); its launcher test runs whenever it installs.
    if [ "${PCCL_SKIP_RAY:-0}" != "1" ]; then
        "$VENV/bin/python" -m pip install -q "$("$VENV/bin/python" - <<'PYEOF'
import tomllib
with open("pyproject.toml", "rb") as f:
    print(tomllib.load(f)["project"]["optional-dependencies"]["ray"][0])
PYEOF
        )" || echo "ray did not install: its tests will be skipped" >&2
    fi
}

case "${1:-}" in
    setup)
        setup
        ;;
    demo)
        setup_demo
        shift
        "$VENV/bin/python" -m pccl demo "$@"
        ;;
    test)
        setup
        shift
        check
        cargo test --locked
        "$VENV/bin/python" -m pytest "$@"
        docs
        ;;
    check)
        check
        ;;
    docs)
        venv
        install_extra_requirements docs
        docs
        ;;
    *)
        echo "usage: $0 {demo|test|check|docs|setup}" >&2
        exit 2
        ;;
esac

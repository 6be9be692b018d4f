#!/usr/bin/env bash
# One entry point for a fresh machine:
#   ./dev.sh demo   install pccl (no test deps, no torch), then run a local demo cluster
#   ./dev.sh test   set everything up, run the static checks (below), then every test
#                   (cargo + pytest: in parallel on PCCL_TEST_WORKERS workers, default 2,
#                   then the `alone` tests one at a time), then the wheel (below), then
#                   build the documentation strictly (what CI runs)
#   ./dev.sh test quick   the quick loop: the unit and integration tiers of pytest only
#                   (tests/unit/ and tests/integration/; minutes, not the full run's)
#   ./dev.sh check  only the static checks, on an existing setup: ruff, mypy --strict over
#                   pccl/, stubtest of pccl/_core.pyi against the built extension, cargo
#                   clippy (-D warnings) and cargo fmt --check
#   ./dev.sh docs   install the docs tools only, then build the documentation strictly
#                   (mkdocs + mkdocstrings read the sources: no Rust build needed)
#   ./dev.sh wheel  build the wheel users install (dist/: abi3, manylinux2014, linked by
#                   zig, no Docker), show `auditwheel show`, then install it into a clean
#                   venv with no Rust on PATH and run the demo and tests/wheel_smoke.py
#   ./dev.sh setup  only set up (.venv with pccl built in release mode the way the wheel
#                   is, test and docs deps, torch)
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
VENV=.venv
# How setup builds .venv's extension and how the wheel is built, the same for both: the
# wheel step then finds everything compiled (same target dir, same cargo fingerprints),
# and the tests run the very binary the wheel ships. zig (PyPI's ziglang, in the `build`
# extra) links against glibc 2.17 symbols: the manylinux2014 tag, without a Docker image.
MATURIN_ARGS=(--locked --zig --compatibility manylinux2014)

venv() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip install -q --upgrade pip
}

# An extension built before abi3 (pccl/_core.cpython-311-x86_64-linux-gnu.so) would
# shadow the pccl/_core.abi3.so built now: CPython prefers the version-tagged name.
remove_stale_extension() {
    rm -f pccl/_core.*.so
}

# The demo (python -m pccl demo) needs only pccl and numpy (no torch).
setup_demo() {
    venv
    remove_stale_extension
    "$VENV/bin/python" -m pip install -q -e ".[numpy]"
}

# .venv's editable pccl, built by the pinned maturin of the `build` extra (no build
# isolation, so it finds ziglang in .venv) with MATURIN_ARGS, plus the extras named in $1.
# maturin looks for zig as `python3 -m ziglang`, hence .venv/bin first on PATH.
install_editable() {
    remove_stale_extension
    PATH="$PWD/$VENV/bin:$PATH" MATURIN_PEP517_ARGS="${MATURIN_ARGS[*]}" \
        "$VENV/bin/python" -m pip install -q --no-build-isolation -e ".[$1]"
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
    install_extra_requirements build
    install_editable test,docs
    # torch is optional for users; the tests that use it run whenever it installs.
    if [ "${PCCL_SKIP_TORCH:-0}" != "1" ]; then
        install_extra_requirements torch \
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

# The wheel users install, checked the way a user gets it: one cp311-abi3 wheel (every
# CPython >= 3.11) tagged manylinux2014 (glibc >= 2.17: Ubuntu 20.04, RHEL 8, CentOS 7),
# installed with its dependencies from PyPI into a fresh venv, then used from outside the
# checkout with PATH cut down to /usr/bin:/bin (no cargo, no rustc). After setup the cargo
# build is already done (MATURIN_ARGS) and this only packages and checks.
wheel() {
    venv
    install_extra_requirements build
    rm -f dist/pccl-*.whl
    # -i names the interpreter as pip names it to maturin in setup: PYO3_PYTHON is part of
    # cargo's fingerprints, and another spelling of the same path recompiles pyo3 and pccl.
    PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/maturin" build --release "${MATURIN_ARGS[@]}" \
        -i "$PWD/$VENV/bin/python" -o dist
    local whls=(dist/pccl-*-cp311-abi3-manylinux2014_x86_64.*.whl)
    local whl="$PWD/${whls[0]}"
    [ -f "$whl" ] || { echo "no cp311-abi3 manylinux2014 wheel in dist/" >&2; exit 1; }
    local shown
    shown=$("$VENV/bin/auditwheel" show "$whl")
    echo "$shown"
    # auditwheel reads the symbol versions the extension needs: glibc 2.17 at most.
    grep -q '"manylinux_2_17_x86_64"' <<<"$shown" \
        || { echo "auditwheel: not manylinux_2_17 (manylinux2014)" >&2; exit 1; }
    ls -l "$whl"
    local smoke tmp
    smoke="$PWD/tests/wheel_smoke.py"
    # left behind when a step fails, for a look
    tmp=$(mktemp -d /tmp/pccl-wheel.XXXXXX)
    "$PY" -m venv "$tmp/venv"
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$tmp/venv/bin/python" -m pip install -q "$whl[numpy]"
    (
        cd "$tmp"
        env PATH=/usr/bin:/bin "$tmp/venv/bin/python" -m pccl demo --peers 3
        env PATH=/usr/bin:/bin "$tmp/venv/bin/python" "$smoke"
    )
    rm -rf "$tmp"
    echo "wheel checked: $whl"
}

# All of pytest in two passes (each ends with its 25 slowest tests). First every test that
# can share the machine, on PCCL_TEST_WORKERS pytest-xdist workers (most of them wait on
# processes, sockets and timers rather than compute; each worker is a process of its own,
# so the leak checks of tests/conftest.py see only that worker's sockets and children;
# tests marked with one xdist_group run on one worker); then the tests marked `alone`
# (netns, Slurm, Ray, the browser, soaks, measurements) one at a time. A -m given in "$@"
# replaces the passes' own, so select with -k or paths instead.
pytest_all() {
    local rc=0 alone=0
    "$VENV/bin/python" -m pytest -n "${PCCL_TEST_WORKERS:-2}" --dist loadgroup \
        -m "not alone" "$@" || rc=$?
    "$VENV/bin/python" -m pytest -m alone "$@" || alone=$?
    # 5: no test selected (e.g. "$@" names no `alone` test)
    [ "$rc" = 5 ] && rc=0
    [ "$alone" = 5 ] && alone=0
    [ "$rc" = 0 ] && rc=$alone
    return "$rc"
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
        shift
        if [ "${1:-}" = quick ]; then
            # The quick loop: the unit and integration tiers only (their folders), on
            # the setup there is (set up first on a fresh machine).
            shift
            "$VENV/bin/python" -c "import pccl._core" 2>/dev/null || setup
            "$VENV/bin/python" -m pytest -q tests/unit tests/integration "$@"
            exit
        fi
        setup
        check
        cargo test --locked
        # The secure transport's tests again with each AES-GCM code forced (the CPU
        # picks one; the other must stay as tested).
        for aead in ring aws-lc; do
            PCCL_AEAD=$aead cargo test --locked --lib net::secure
        done
        pytest_all "$@"
        wheel
        docs
        ;;
    check)
        check
        ;;
    wheel)
        wheel
        ;;
    docs)
        venv
        install_extra_requirements docs
        docs
        ;;
    *)
        echo "usage: $0 {demo|test|check|wheel|docs|setup}" >&2
        exit 2
        ;;
esac

"""Configuration from the environment (pccl/config.py): Communicator.from_env(),
MasterNode.from_env(), the variables table derived from the constructors, the launchers'
local rank, and every error a bad value gives."""

from __future__ import annotations

import asyncio
import inspect
import logging
from pathlib import Path
from typing import Any

import pytest

import pccl
from pccl import config
from pccl.config import from_env, local_rank, markdown_table, names, resolve, variables

CLASSES = (pccl.Communicator, pccl.MasterNode)

# Shared secrets are keys of at least 128 random bits (pccl.identity.check_secret).
SECRET = "5f0c1a9e7d3b42c8a6e1f0b97c2d4e3a"
OTHER_SECRET = "c0ffee00d15ea5e5b16b00b5a11ce0de"

# The contract other code (launchers, manifests, docs) is written against. A new
# constructor parameter fails test_the_variable_names_are_the_documented_ones until it is
# added here and to the operations docs (python -m pccl env prints the table).
COMMUNICATOR_VARIABLES = {
    "master": "PCCL_MASTER",
    "peer_group": "PCCL_PEER_GROUP",
    "p2p_connection_pool_size": "PCCL_POOL_SIZE",
    "secret": "PCCL_SECRET",
    "p2p_listen_host": "PCCL_P2P_LISTEN_HOST",
    "p2p_listen_port": "PCCL_P2P_PORT",
    "p2p_advertise_host": "PCCL_P2P_ADVERTISE_HOST",
    "p2p_advertise_address": "PCCL_P2P_ADVERTISE_ADDRESS",
    "timeout": "PCCL_TIMEOUT",
    "p2p_timeout": "PCCL_P2P_TIMEOUT",
    "peer_timeout": "PCCL_PEER_TIMEOUT",
    "early_start_max_bytes": "PCCL_EARLY_START_MAX_BYTES",
    "via_master_max_bytes": "PCCL_VIA_MASTER_MAX_BYTES",
    "piece_bytes": "PCCL_PIECE_BYTES",
    "max_frame": "PCCL_MAX_FRAME",
    "reconnect_timeout": "PCCL_RECONNECT_TIMEOUT",
    "collective_timeout": "PCCL_COLLECTIVE_TIMEOUT",
    "insecure": "PCCL_INSECURE",
    "allow_relay": "PCCL_ALLOW_RELAY",
    "metrics_listen": "PCCL_METRICS_LISTEN",
    "metrics_token": "PCCL_METRICS_TOKEN",
    "key_file": "PCCL_KEY_FILE",
    "cert_file": "PCCL_CERT_FILE",
    "trust": "PCCL_TRUST",
    "allow_anonymous": "PCCL_ALLOW_ANONYMOUS",
    "name": "PCCL_PEER_NAME",
    "run_id": "PCCL_RUN_ID",
}
MASTER_VARIABLES = {
    "listen": "PCCL_MASTER_LISTEN",
    "secret": "PCCL_SECRET",
    "heartbeat_interval": "PCCL_HEARTBEAT_INTERVAL",
    "heartbeat_timeout": "PCCL_HEARTBEAT_TIMEOUT",
    "handshake_timeout": "PCCL_HANDSHAKE_TIMEOUT",
    "max_frame": "PCCL_MAX_FRAME",
    "max_establish_attempts": "PCCL_MAX_ESTABLISH_ATTEMPTS",
    "recovery_grace": "PCCL_RECOVERY_GRACE",
    "establish_timeout": "PCCL_ESTABLISH_TIMEOUT",
    "repair_rings": "PCCL_REPAIR_RINGS",
    "insecure": "PCCL_INSECURE",
    "dial_back_timeout": "PCCL_DIAL_BACK_TIMEOUT",
    "max_relayed_streams": "PCCL_MAX_RELAYED_STREAMS",
    "max_connections": "PCCL_MAX_CONNECTIONS",
    "mesh_max_bytes": "PCCL_MESH_MAX_BYTES",
    "quorum": "PCCL_QUORUM",
    "standby": "PCCL_STANDBY",
    "status_listen": "PCCL_STATUS_LISTEN",
    "status_token": "PCCL_STATUS_TOKEN",
    "key_file": "PCCL_KEY_FILE",
    "cert_file": "PCCL_CERT_FILE",
    "trust": "PCCL_TRUST",
    "denylist": "PCCL_DENYLIST",
    "allow_anonymous": "PCCL_ALLOW_ANONYMOUS",
    "run_id": "PCCL_RUN_ID",
    "state_dir": "PCCL_STATE_DIR",
    "secret_grace": "PCCL_SECRET_GRACE",
    "admin_socket": "PCCL_ADMIN_SOCKET",
}


def params(cls: type) -> list[str]:
    return list(inspect.signature(cls.__init__).parameters)[1:]  # type: ignore[misc]


# --- the table ----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_constructor_parameter_has_a_documented_variable(cls: type) -> None:
    table = variables(cls)
    assert [v.param for v in table] == params(cls)
    for v in table:
        assert v.help, f"{cls.__name__}({v.param}=): no help line in pccl/config.py _HELP"
        assert v.name.startswith("PCCL_") and v.name == v.name.upper(), v.name
        assert v.name in markdown_table(), v.name
        sig = inspect.signature(cls.__init__).parameters[v.param]  # type: ignore[misc]
        assert v.default == sig.default or (v.default is sig.default)
    assert len({v.name for v in table}) == len(table)


def test_the_variable_names_are_the_documented_ones() -> None:
    assert {v.param: v.name for v in variables(pccl.Communicator)} == COMMUNICATOR_VARIABLES
    assert {v.param: v.name for v in variables(pccl.MasterNode)} == MASTER_VARIABLES
    files = {v.name: v.file_name for cls in CLASSES for v in variables(cls) if v.file_name}
    assert files == {"PCCL_SECRET": "PCCL_SECRET_FILE",
                     "PCCL_STATUS_TOKEN": "PCCL_STATUS_TOKEN_FILE",
                     "PCCL_METRICS_TOKEN": "PCCL_METRICS_TOKEN_FILE"}
    assert names() == frozenset({*COMMUNICATOR_VARIABLES.values(), *MASTER_VARIABLES.values(),
                                 "PCCL_SECRET_FILE", "PCCL_STATUS_TOKEN_FILE",
                                 "PCCL_METRICS_TOKEN_FILE", "PCCL_LOG_LEVEL",
                                 "PCCL_LOG_FORMAT"})


def test_only_parameters_that_mean_the_same_share_a_variable() -> None:
    peer = {v.name: v.param for v in variables(pccl.Communicator)}
    master = {v.name: v.param for v in variables(pccl.MasterNode)}
    shared = set(peer) & set(master)
    # The node's own key, certificate and trusted run keys, and the opt-out from
    # authentication, and the run's id, mean the same on a peer and on the master.
    assert shared == {"PCCL_SECRET", "PCCL_INSECURE", "PCCL_MAX_FRAME", "PCCL_KEY_FILE",
                      "PCCL_CERT_FILE", "PCCL_TRUST", "PCCL_ALLOW_ANONYMOUS", "PCCL_RUN_ID"}
    assert all(peer[name] == master[name] for name in shared)


def test_a_new_parameter_gets_a_variable_and_an_unreadable_type_fails_loudly() -> None:
    class Tuned(pccl.Communicator):
        def __init__(self, *args: Any, knob: int = 3, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.knob = knob

    class Knobs:
        def __init__(self, depth: int = 1, *, weights: dict[str, int] | None = None) -> None:
            pass

    with pytest.raises(TypeError, match=r"__init__ takes \*args: pccl.config needs named"):
        variables(Tuned)

    class Tuned2(pccl.Communicator):
        def __init__(self, master: str = "127.0.0.1:48148", knob: int = 3) -> None:
            super().__init__(master)
            self.knob = knob

    t = Tuned2.from_env({"PCCL_KNOB": "7", "PCCL_MASTER": "localhost:1"})
    assert (t.knob, t.master) == (7, "localhost:1")
    assert [v.name for v in variables(Tuned2)] == ["PCCL_MASTER", "PCCL_KNOB"]
    with pytest.raises(TypeError, match=r"Knobs\(weights: dict\[str, int\] \| None\): "
                                        r"pccl.config cannot read this type"):
        variables(Knobs)


# --- values ---------------------------------------------------------------------------------


def test_every_communicator_variable_is_read_with_its_type(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text(f"  {SECRET} \n\n")
    env = {
        "PCCL_MASTER": "pccl-master.train.svc:48148",
        "PCCL_PEER_GROUP": "3",
        "PCCL_POOL_SIZE": " 8 ",
        "PCCL_SECRET_FILE": str(tmp_path / "secret"),
        "PCCL_P2P_LISTEN_HOST": "0.0.0.0",
        "PCCL_P2P_PORT": "29600",
        "PCCL_P2P_ADVERTISE_HOST": "10.1.2.3",
        "PCCL_P2P_ADVERTISE_ADDRESS": "203.0.113.9:40000",
        "PCCL_TIMEOUT": "12.5",
        "PCCL_P2P_TIMEOUT": "7",
        "PCCL_PEER_TIMEOUT": "45",
        "PCCL_PIECE_BYTES": "65536",
        "PCCL_MAX_FRAME": "2097152",
        "PCCL_RECONNECT_TIMEOUT": "0",
        "PCCL_COLLECTIVE_TIMEOUT": "none",
        "PCCL_INSECURE": "yes",
        "PCCL_ALLOW_RELAY": "Off",
        "PCCL_METRICS_LISTEN": "0.0.0.0:9400",
        "PCCL_METRICS_TOKEN": "scrape-me",
        "PCCL_LOG_LEVEL": "debug",  # read at import, not here
        "HOME": "/root",
    }
    kwargs, sources = resolve(pccl.Communicator, env)
    assert kwargs == {
        "master": "pccl-master.train.svc:48148", "peer_group": 3,
        "p2p_connection_pool_size": 8, "secret": tmp_path / "secret",
        "p2p_listen_host": "0.0.0.0", "p2p_listen_port": 29600,
        "p2p_advertise_host": "10.1.2.3", "p2p_advertise_address": "203.0.113.9:40000",
        "timeout": 12.5, "p2p_timeout": 7.0, "peer_timeout": 45.0, "piece_bytes": 65536,
        "max_frame": 2097152, "reconnect_timeout": 0.0, "collective_timeout": None,
        "insecure": True, "allow_relay": False, "metrics_listen": "0.0.0.0:9400",
        "metrics_token": "scrape-me",
    }
    assert sources["secret"] == f"PCCL_SECRET_FILE={str(tmp_path / 'secret')!r}"
    assert sources["p2p_connection_pool_size"] == "PCCL_POOL_SIZE='8'"
    comm = pccl.Communicator.from_env(env)
    for name, value in kwargs.items():
        if name == "secret":  # (the file is kept to be re-read: a rotation)
            assert comm.secrets.path == value and comm.secret == SECRET.encode()
            continue
        assert getattr(comm, name) == value, name


def test_every_master_variable_is_read_with_its_type(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok-123\n")
    env = {
        "PCCL_MASTER_LISTEN": "0.0.0.0:48148",
        "PCCL_SECRET": f" {SECRET} ",
        "PCCL_HEARTBEAT_INTERVAL": "0.5",
        "PCCL_HEARTBEAT_TIMEOUT": "3",
        "PCCL_HANDSHAKE_TIMEOUT": "4",
        "PCCL_MAX_FRAME": "1048576",
        "PCCL_MAX_ESTABLISH_ATTEMPTS": "5",
        "PCCL_RECOVERY_GRACE": "9",
        "PCCL_ESTABLISH_TIMEOUT": "30",
        "PCCL_REPAIR_RINGS": "FALSE",
        "PCCL_INSECURE": "0",
        "PCCL_DIAL_BACK_TIMEOUT": "1.5",
        "PCCL_MAX_RELAYED_STREAMS": "0",
        "PCCL_STATUS_LISTEN": "0.0.0.0:48180",
        "PCCL_STATUS_TOKEN_FILE": str(tmp_path / "token"),
    }
    kwargs, _ = resolve(pccl.MasterNode, env)
    assert kwargs == {
        "listen": "0.0.0.0:48148", "secret": SECRET, "heartbeat_interval": 0.5,
        "heartbeat_timeout": 3.0, "handshake_timeout": 4.0, "max_frame": 1048576,
        "max_establish_attempts": 5, "recovery_grace": 9.0, "establish_timeout": 30.0,
        "repair_rings": False, "insecure": False, "dial_back_timeout": 1.5,
        "max_relayed_streams": 0, "status_listen": "0.0.0.0:48180", "status_token": "tok-123",
    }
    master = pccl.MasterNode.from_env(env)
    assert master.secret == SECRET.encode()
    assert master.state.repair_rings is False
    assert (master.listen, master.heartbeat_timeout, master.max_relayed_streams,
            master.status_listen, master.status_token) == (
        "0.0.0.0:48148", 3.0, 0, "0.0.0.0:48180", "tok-123")


@pytest.mark.parametrize(("raw", "value"), [
    ("1", True), ("true", True), ("TRUE", True), ("yes", True), ("On", True),
    ("0", False), ("false", False), ("No", False), ("off", False), (" off\n", False),
])
def test_booleans(raw: str, value: bool) -> None:
    assert resolve(pccl.Communicator, {"PCCL_INSECURE": raw})[0] == {"insecure": value}


@pytest.mark.parametrize(("raw", "value"), [
    ("none", None), ("NONE", None), ("off", None), ("600", 600.0), ("1e3", 1000.0)])
def test_optional_numbers_take_none_and_off(raw: str, value: float | None) -> None:
    assert resolve(pccl.Communicator, {"PCCL_COLLECTIVE_TIMEOUT": raw})[0] == {
        "collective_timeout": value}


def test_optional_addresses_take_none_and_off() -> None:
    assert resolve(pccl.MasterNode, {"PCCL_STATUS_LISTEN": "off"})[0] == {
        "status_listen": None}
    assert resolve(pccl.Communicator, {"PCCL_METRICS_LISTEN": "None"})[0] == {
        "metrics_listen": None}


def test_blank_variables_count_as_unset() -> None:
    env = {"PCCL_TIMEOUT": "", "PCCL_PEER_GROUP": "  ", "PCCL_INSECURE": "\t"}
    assert resolve(pccl.Communicator, env) == ({}, {})
    comm = pccl.Communicator.from_env(env)
    assert (comm.timeout, comm.peer_group, comm.insecure) == (10.0, 0, False)


def test_arguments_win_over_the_environment_which_wins_over_defaults() -> None:
    env = {"PCCL_MASTER": "env-host:1", "PCCL_TIMEOUT": "3", "PCCL_SECRET": "from-env",
           "PCCL_POOL_SIZE": "not a number"}
    # (secret=None to a master on another machine: allow_anonymous=True says so.)
    comm = pccl.Communicator.from_env(env, master="arg-host:2", secret=None,
                                      p2p_connection_pool_size=2, allow_anonymous=True)
    # argument > environment > default; an overridden variable is not even read
    assert (comm.master, comm.timeout, comm.secret, comm.p2p_connection_pool_size,
            comm.peer_timeout) == ("arg-host:2", 3.0, None, 2, 30.0)
    master = pccl.MasterNode.from_env({"PCCL_MASTER_LISTEN": "0.0.0.0:1",
                                       "PCCL_SECRET": "a", "PCCL_SECRET_FILE": "/nope"},
                                      listen="127.0.0.1:0", secret=SECRET.encode())
    assert (master.listen, master.secret, master.heartbeat_interval) == (
        "127.0.0.1:0", SECRET.encode(), 1.0)


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in names():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PCCL_MASTER", "from-os-environ:48148")
    monkeypatch.setenv("PCCL_HEARTBEAT_TIMEOUT", "9")
    # A remote master and the default 0.0.0.0 listen address, with no secret: read from
    # os.environ too.
    monkeypatch.setenv("PCCL_ALLOW_ANONYMOUS", "1")
    comm = pccl.Communicator.from_env()
    assert (comm.master, comm.allow_anonymous) == ("from-os-environ:48148", True)
    assert pccl.MasterNode.from_env().heartbeat_timeout == 9.0
    assert from_env(pccl.Communicator).master == "from-os-environ:48148"


def test_secret_files_are_stripped_and_token_files_are_text(tmp_path: Path) -> None:
    # 16 binary bytes (128 bits), between whitespace that is stripped.
    raw = b"\x00\x01binary\xff\x80\x81\x82\x83\x84\x85\x86"
    (tmp_path / "s").write_bytes(b"\n\t" + raw + b" \n")
    (tmp_path / "t").write_text("\n  token with inner space  \n")
    master = pccl.MasterNode.from_env({"PCCL_SECRET_FILE": str(tmp_path / "s"),
                                       "PCCL_STATUS_TOKEN_FILE": str(tmp_path / "t")})
    assert master.secret == raw
    assert master.status_token == "token with inner space"


# --- the local rank ---------------------------------------------------------------------------


@pytest.mark.parametrize(("env", "group"), [
    ({"LOCAL_RANK": "2"}, 2),  # torchrun
    ({"SLURM_LOCALID": "3", "SLURM_PROCID": "11"}, 3),  # srun: the node-local id
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, 1),  # mpirun
    # srun + torchrun: every worker of a node has SLURM_LOCALID=0; torchrun's wins
    ({"LOCAL_RANK": "1", "SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "5"}, 1),
    ({"LOCAL_RANK": "", "SLURM_LOCALID": "4"}, 4),  # blank: unset
])
def test_peer_group_local_rank_follows_the_launcher(env: dict[str, str], group: int) -> None:
    kwargs, sources = resolve(pccl.Communicator, {"PCCL_PEER_GROUP": "local_rank", **env})
    assert kwargs == {"peer_group": group}
    assert pccl.Communicator.from_env({"PCCL_PEER_GROUP": "LOCAL_RANK", **env}).peer_group \
        == group
    assert local_rank(env) == group
    which = next(name for name, _ in config.LOCAL_RANK_VARIABLES if env.get(name))
    assert sources["peer_group"] == f"PCCL_PEER_GROUP='local_rank' with {which}={group}"


@pytest.mark.parametrize(("raw", "env", "port"), [
    ("29600+local_rank", {"LOCAL_RANK": "0"}, 29600),
    ("29600+local_rank", {"SLURM_LOCALID": "3"}, 29603),
    (" 40000 + LOCAL_RANK ", {"OMPI_COMM_WORLD_LOCAL_RANK": "7"}, 40007),
    ("41000", {"LOCAL_RANK": "7"}, 41000),
])
def test_p2p_port_base_plus_local_rank(raw: str, env: dict[str, str], port: int) -> None:
    comm = pccl.Communicator.from_env({"PCCL_P2P_PORT": raw, **env})
    assert comm.p2p_listen_port == port


def test_local_rank_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, _ in config.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "6")
    assert local_rank() == 6


NO_RANK = ("needs the launcher's local rank, but none of LOCAL_RANK (torchrun), "
           "SLURM_LOCALID (Slurm), OMPI_COMM_WORLD_LOCAL_RANK (Open MPI) is set; start the "
           "process with torchrun, srun or mpirun, or give a number")


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "env", "message"), [
    (pccl.Communicator, {"PCCL_POOL_SIZE": "four"},
     "PCCL_POOL_SIZE='four' is not valid: expected an integer"),
    (pccl.Communicator, {"PCCL_PIECE_BYTES": "1.5"},
     "PCCL_PIECE_BYTES='1.5' is not valid: expected an integer"),
    (pccl.Communicator, {"PCCL_TIMEOUT": "soon"},
     "PCCL_TIMEOUT='soon' is not valid: expected a number (e.g. 10 or 2.5)"),
    (pccl.Communicator, {"PCCL_TIMEOUT": "nan"},
     "PCCL_TIMEOUT='nan' is not valid: expected a finite number (e.g. 10 or 2.5)"),
    (pccl.Communicator, {"PCCL_COLLECTIVE_TIMEOUT": "never"},
     "PCCL_COLLECTIVE_TIMEOUT='never' is not valid: expected a number (e.g. 10 or 2.5) or "
     "none/off"),
    (pccl.Communicator, {"PCCL_INSECURE": "maybe"},
     "PCCL_INSECURE='maybe' is not valid: expected a boolean: 1/0, true/false, yes/no or "
     "on/off"),
    (pccl.MasterNode, {"PCCL_REPAIR_RINGS": "2"},
     "PCCL_REPAIR_RINGS='2' is not valid: expected a boolean: 1/0, true/false, yes/no or "
     "on/off"),
    (pccl.Communicator, {"PCCL_PEER_GROUP": "first"},
     "PCCL_PEER_GROUP='first' is not valid: expected an integer, or local_rank (the "
     "launcher's local rank: LOCAL_RANK (torchrun), SLURM_LOCALID (Slurm), "
     "OMPI_COMM_WORLD_LOCAL_RANK (Open MPI))"),
    (pccl.Communicator, {"PCCL_P2P_PORT": "high"},
     "PCCL_P2P_PORT='high' is not valid: expected a port number, or BASE+local_rank (e.g. "
     "29600+local_rank: consecutive ports for the peers of one node)"),
    (pccl.Communicator, {"PCCL_PEER_GROUP": "local_rank", "SLURM_PROCID": "3"},
     "PCCL_PEER_GROUP='local_rank' " + NO_RANK),
    (pccl.Communicator, {"PCCL_P2P_PORT": "29600+local_rank"},
     "PCCL_P2P_PORT='29600+local_rank' " + NO_RANK),
    (pccl.Communicator, {"PCCL_PEER_GROUP": "local_rank", "LOCAL_RANK": "-1",
                         "SLURM_LOCALID": "0"},
     "LOCAL_RANK='-1' (read for PCCL_PEER_GROUP='local_rank') is not a local rank: "
     "expected an integer >= 0"),
    (pccl.Communicator, {"PCCL_SECRET": "a", "PCCL_SECRET_FILE": "/run/secret"},
     "both PCCL_SECRET and PCCL_SECRET_FILE are set: set one of them"),
    (pccl.MasterNode, {"PCCL_STATUS_TOKEN": "a", "PCCL_STATUS_TOKEN_FILE": "/t"},
     "both PCCL_STATUS_TOKEN and PCCL_STATUS_TOKEN_FILE are set: set one of them"),
    (pccl.Communicator, {"PCCL_SECRET": " "},
     "PCCL_SECRET is set but empty: give the secret, or unset it"),
    (pccl.MasterNode, {"PCCL_STATUS_TOKEN": ""},
     "PCCL_STATUS_TOKEN is set but empty: give the status token, or unset it"),
    (pccl.MasterNode, {"PCCL_SECRET_FILE": ""},
     "PCCL_SECRET_FILE is set but empty: give the path of the secret file, or unset it"),
    (pccl.Communicator, {"PCCL_SECRET_FILE": "/no/such/pccl.secret"},
     "cannot read the secret file '/no/such/pccl.secret': No such file or directory"),
    (pccl.MasterNode, {"PCCL_STATUS_TOKEN_FILE": "/no/such/token"},
     "cannot read the status token file '/no/such/token': No such file or directory"),
    # Values of the right form that the constructor refuses: its message, plus where the
    # value came from.
    (pccl.Communicator, {"PCCL_POOL_SIZE": "0"},
     "p2p_connection_pool_size must be an integer in 1..64, got 0 (from the environment: "
     "PCCL_POOL_SIZE='0')"),
    (pccl.Communicator, {"PCCL_SECRET": "s3cret"},
     "the secret is too weak (6 bytes, 6 distinct): a secret is a key, not a password: at "
     "least 128 random bits, e.g. `pccl secret new --out FILE` (or `openssl rand -hex 16`), "
     "given to every node as --secret-file / PCCL_SECRET_FILE (from the environment: "
     "PCCL_SECRET)"),
    (pccl.Communicator, {"PCCL_P2P_PORT": "65535+local_rank", "LOCAL_RANK": "1"},
     "p2p_listen_port must be an integer in 0..65535, got 65536 (from the environment: "
     "PCCL_P2P_PORT='65535+local_rank' with LOCAL_RANK=1)"),
    (pccl.Communicator, {"PCCL_MASTER": "pccl-master"},
     "master address 'pccl-master' has no valid port: give 'host:port' (pccl's default port "
     "is 48148, e.g. 'pccl-master:48148') (from the environment: PCCL_MASTER='pccl-master')"),
    (pccl.Communicator, {"PCCL_TIMEOUT": "-1"},
     "timeout must be a positive number of seconds up to a week (604800), got -1.0 (from "
     "the environment: PCCL_TIMEOUT='-1')"),
    (pccl.MasterNode, {"PCCL_HEARTBEAT_INTERVAL": "2", "PCCL_HEARTBEAT_TIMEOUT": "1"},
     "MasterNode(heartbeat_timeout=1.0) must exceed heartbeat_interval=2.0 (from the "
     "environment: PCCL_HEARTBEAT_INTERVAL='2', PCCL_HEARTBEAT_TIMEOUT='1')"),
    (pccl.MasterNode, {"PCCL_STATUS_LISTEN": "0.0.0.0:48180",
                       "PCCL_MASTER_LISTEN": "127.0.0.1:48148"},
     "MasterNode(status_listen='0.0.0.0:48180') is reachable from other machines: give "
     "status_token=... (clients send 'Authorization: Bearer TOKEN'), or listen on 127.0.0.1 "
     "(from the environment: PCCL_MASTER_LISTEN='127.0.0.1:48148', "
     "PCCL_STATUS_LISTEN='0.0.0.0:48180')"),
], ids=lambda x: x.__name__ if isinstance(x, type) else None)
def test_bad_values_name_the_variable(cls: type, env: dict[str, str], message: str) -> None:
    with pytest.raises(pccl.InvalidArgumentError) as e:
        from_env(cls, env)
    assert str(e.value) == message


def test_empty_or_undecodable_secret_files(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text(" \n\n")
    latin1 = b"caf\xe9 cr\xe8me br\xfbl\xe9e"  # 16 bytes, not UTF-8
    (tmp_path / "latin1").write_bytes(latin1)
    with pytest.raises(pccl.InvalidArgumentError) as e:
        pccl.Communicator.from_env({"PCCL_SECRET_FILE": str(tmp_path / "empty")})
    assert str(e.value) == f"the secret file {str(tmp_path / 'empty')!r} is empty"
    with pytest.raises(pccl.InvalidArgumentError) as e:
        pccl.MasterNode.from_env({"PCCL_STATUS_TOKEN_FILE": str(tmp_path / "empty")})
    assert str(e.value) == f"the status token file {str(tmp_path / 'empty')!r} is empty"
    with pytest.raises(pccl.InvalidArgumentError) as e:
        pccl.MasterNode.from_env({"PCCL_STATUS_TOKEN_FILE": str(tmp_path / "latin1")})
    assert str(e.value) == (f"the status token file {str(tmp_path / 'latin1')!r} "
                            f"(PCCL_STATUS_TOKEN_FILE) is not UTF-8 text")
    # A binary *secret* is fine: it is bytes anyway.
    assert pccl.Communicator.from_env(
        {"PCCL_SECRET_FILE": str(tmp_path / "latin1")}).secret == latin1


def test_anonymity_off_loopback_is_refused_unless_the_environment_allows_it() -> None:
    for cls, env in ((pccl.Communicator, {"PCCL_MASTER": "10.0.0.1:48148"}),
                     (pccl.MasterNode, {"PCCL_MASTER_LISTEN": "0.0.0.0:0"})):
        with pytest.raises(pccl.InvalidUsageError, match="allow_anonymous=True"):
            from_env(cls, env)
        assert from_env(cls, {**env, "PCCL_ALLOW_ANONYMOUS": "1"}).allow_anonymous is True
        assert from_env(cls, {**env, "PCCL_SECRET": SECRET}).secret == SECRET.encode()


def test_a_bad_argument_is_not_blamed_on_the_environment() -> None:
    with pytest.raises(pccl.InvalidArgumentError) as e:
        pccl.Communicator.from_env({"PCCL_TIMEOUT": "5"}, p2p_connection_pool_size=0)
    assert str(e.value) == "p2p_connection_pool_size must be an integer in 1..64, got 0"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_unknown_keywords_are_a_type_error_before_the_environment_is_read(cls: type) -> None:
    with pytest.raises(TypeError) as e:
        cls.from_env({"PCCL_TIMEOUT": "bad", "PCCL_HEARTBEAT_TIMEOUT": "bad"},  # type: ignore[attr-defined]
                     peer_grup=1)
    assert str(e.value) == f"{cls.__name__}.from_env() got an unexpected keyword argument " \
                           f"'peer_grup'"


# --- logging ------------------------------------------------------------------------------------


def test_the_configuration_is_logged_at_debug_without_the_secret(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    (tmp_path / "s").write_text(SECRET)
    caplog.set_level(logging.DEBUG, logger="pccl.config")
    pccl.MasterNode.from_env({"PCCL_SECRET_FILE": str(tmp_path / "s"),
                              "PCCL_STATUS_LISTEN": "127.0.0.1:0",
                              "PCCL_STATUS_TOKEN": "tok-secret"},
                             listen="127.0.0.1:0")
    pccl.Communicator.from_env({"PCCL_SECRET": OTHER_SECRET, "PCCL_PEER_GROUP": "local_rank",
                                "SLURM_LOCALID": "2"})
    records = [r for r in caplog.records if r.name == "pccl.config"]
    assert [r.levelno for r in records] == [logging.DEBUG, logging.DEBUG]
    master_line, peer_line = (r.getMessage() for r in records)
    assert master_line.startswith("MasterNode.from_env(): listen='127.0.0.1:0' (argument), "
                                  f"secret=<hidden> (PCCL_SECRET_FILE="
                                  f"{str(tmp_path / 's')!r}), heartbeat_interval=1.0 "
                                  f"(default), ")
    assert master_line.endswith("status_listen='127.0.0.1:0' (PCCL_STATUS_LISTEN='127.0.0.1:0'), "
                                "status_token=<hidden> (PCCL_STATUS_TOKEN), key_file=None "
                                "(default), cert_file=None (default), trust=None (default), "
                                "denylist=None (default), allow_anonymous=False (default), "
                                "run_id=None (default), state_dir=None (default), "
                                "secret_grace=3600.0 (default), admin_socket=None (default)")
    assert "peer_group=2 (PCCL_PEER_GROUP='local_rank' with SLURM_LOCALID=2)" in peer_line
    assert "secret=<hidden> (PCCL_SECRET)" in peer_line
    assert "metrics_listen=None (default)" in peer_line
    assert not any(SECRET in r.getMessage() or OTHER_SECRET in r.getMessage()
                   or "tok-secret" in r.getMessage()
                   for r in caplog.records)


def test_read_secret_file_messages(tmp_path: Path) -> None:
    with pytest.raises(pccl.InvalidArgumentError) as e:
        config.read_secret_file(tmp_path, "status token file")
    assert str(e.value) == f"cannot read the status token file {str(tmp_path)!r}: Is a directory"


# --- a real run ----------------------------------------------------------------------------------


async def test_peers_from_env_join_a_master_from_env(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text(SECRET + "\n")
    master = pccl.MasterNode.from_env({
        "PCCL_MASTER_LISTEN": "127.0.0.1:0", "PCCL_SECRET_FILE": str(tmp_path / "secret"),
        "PCCL_STATUS_LISTEN": "off", "PCCL_HEARTBEAT_INTERVAL": "0.5"})
    async with master:
        node = {"PCCL_MASTER": master.address, "PCCL_SECRET": SECRET,
                "PCCL_PEER_GROUP": "local_rank", "PCCL_P2P_LISTEN_HOST": "127.0.0.1",
                "PCCL_TIMEOUT": "30"}
        a = pccl.Communicator.from_env({**node, "LOCAL_RANK": "0"})
        b = pccl.Communicator.from_env({**node, "SLURM_LOCALID": "1"})
        try:
            await a.connect()
            assert a.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 1
            joining = asyncio.create_task(b.connect())
            await master.wait_for(lambda s: bool(s.pending()))
            await a.update_topology()
            await joining
            for comm in (a, b):
                assert comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 2
                assert comm.get_attribute(pccl.Attribute.NUM_DISTINCT_PEER_GROUPS) == 2
                assert comm.get_attribute(pccl.Attribute.PEER_GROUP_WORLD_SIZE) == 1
            assert (a.peer_group, b.peer_group) == (0, 1)
        finally:
            await b.close()
            await a.close()


def test_the_documented_table_is_the_generated_one() -> None:
    """docs/operations.md carries `python -m pccl env`'s table verbatim: a new or
    changed variable must be documented (regenerate the table and paste it)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    assert markdown_table().strip() in doc

"""Configuration from the environment: :meth:`pccl.Communicator.from_env` and
:meth:`pccl.MasterNode.from_env`.

Every constructor parameter of :class:`~pccl.Communicator` and :class:`~pccl.MasterNode`
has one environment variable, derived here from the constructor's signature (so a new
parameter gets one without anybody writing it down): ``PCCL_`` + the parameter's name
in capitals, except for the few names in :data:`RENAMED` (``master`` is ``PCCL_MASTER``,
``p2p_listen_port`` is ``PCCL_P2P_PORT``, ...). A parameter that both classes take
(``secret``, ``insecure``, ``max_frame``) has one variable for both, so one setting
holds for a whole run. The secrets also come from files: ``PCCL_SECRET_FILE``,
``PCCL_STATUS_TOKEN_FILE``, ``PCCL_METRICS_TOKEN_FILE``.

Rules, the same for every variable:

- a keyword argument of ``from_env()`` wins over the variable; an unset variable leaves
  the constructor's default;
- values are read by the parameter's type: integers, numbers (``2.5``), booleans (``1``,
  ``true``, ``yes``, ``on`` / ``0``, ``false``, ``no``, ``off``, any case), text; where
  the parameter may be ``None``, the words ``none`` and ``off`` mean ``None``;
- surrounding whitespace is ignored, and a variable set to nothing (``PCCL_TIMEOUT=``)
  counts as unset, except a secret: ``PCCL_SECRET=`` is an error rather than a run
  without authentication;
- a value that cannot be read raises :class:`~pccl.InvalidArgumentError` naming the
  variable, its value and what it accepts; a value the constructor refuses (a negative
  timeout) raises its error with the variable it came from added.

``PCCL_PEER_GROUP=local_rank`` takes the peer group from the launcher's local rank (see
:func:`local_rank`), for sharded nodes where local rank ``r`` of every node is a peer of
group ``r``; ``PCCL_P2P_PORT=BASE+local_rank`` gives the peers of one node consecutive
fixed p2p ports. ``python -m pccl env`` prints the table of variables (Markdown).

Example::

    import pccl
    env = {"PCCL_MASTER": "pccl-master:48148", "PCCL_PEER_GROUP": "3"}  # os.environ if omitted
    comm = pccl.Communicator.from_env(env, peer_group=0)                 # arguments win
    assert comm.master == "pccl-master:48148" and comm.peer_group == 0
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import re
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pccl.errors import InvalidArgumentError

__all__ = ["LOCAL_RANK_VARIABLES", "LOG_FORMAT", "LOG_LEVEL", "RENAMED", "SECRETS", "Variable",
           "env_name", "from_env", "is_set", "local_rank", "markdown_table", "names",
           "read_secret_file", "resolve", "variables"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Env = Mapping[str, str]

PREFIX = "PCCL_"
#: Read once, at ``import pccl`` (``pccl/_logging.py``), not by ``from_env()``.
LOG_LEVEL = "PCCL_LOG_LEVEL"
LOG_FORMAT = "PCCL_LOG_FORMAT"

#: Parameters whose variable is not ``PCCL_`` + the name in capitals.
RENAMED: dict[str, str] = {
    "master": "PCCL_MASTER",
    "p2p_connection_pool_size": "PCCL_POOL_SIZE",
    "p2p_listen_port": "PCCL_P2P_PORT",
    "listen": "PCCL_MASTER_LISTEN",
    "name": "PCCL_PEER_NAME",
}

#: Parameters that hold a secret: the value is never logged, and it may come from a
#: file (the variable's name + ``_FILE``), whitespace around it stripped.
SECRETS: dict[str, str] = {"secret": "secret", "status_token": "status token",
                           "metrics_token": "metrics token"}

#: Where ``local_rank`` is read from, first set wins: torchrun sets ``LOCAL_RANK`` for
#: each worker (under ``srun ... torchrun`` every worker of a node also inherits the
#: same ``SLURM_LOCALID``, so torchrun's must come first), ``srun`` sets
#: ``SLURM_LOCALID`` for each task of a node, Open MPI's ``mpirun`` sets
#: ``OMPI_COMM_WORLD_LOCAL_RANK``.
LOCAL_RANK_VARIABLES: tuple[tuple[str, str], ...] = (
    ("LOCAL_RANK", "torchrun"),
    ("SLURM_LOCALID", "Slurm"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI"),
)

# What each parameter means, for the table (``markdown_table()``) and ``--help``. Every
# parameter needs a line: tests/integration/test_config.py fails on one that has none.
_HELP: dict[str, str] = {
    # Communicator
    "master": "`host:port` of the master; several, comma-separated: the peer fails over "
              "between them in that order",
    "peer_group": "the peer group this peer reduces and syncs with",
    "p2p_connection_pool_size": "parallel TCP streams per ring neighbour",
    "p2p_listen_host": "address the p2p listener binds (none: every interface)",
    "p2p_listen_port": "p2p listening port (0: a free one)",
    "p2p_advertise_host": "host other peers should dial for this peer's p2p port",
    "p2p_advertise_address": "`host:port` other peers should dial instead of the listener "
                             "(a forwarded port, NAT)",
    "timeout": "seconds for each wait on the master that depends on no other peer",
    "p2p_timeout": "seconds to establish a p2p connection",
    "peer_timeout": "seconds a ring link may go without progress",
    "piece_bytes": "bytes per piece of a ring transfer",
    "early_start_max_bytes": "all-reduces up to this size start the ring at once (0: never)",
    "via_master_max_bytes": "all-reduces up to this size are reduced by the master (0: never)",
    "max_frame": "largest control message accepted, in bytes",
    "reconnect_timeout": "seconds to keep registering again after losing the master "
                         "(0: never); the default outlasts a VM reboot",
    "collective_timeout": "seconds a collective waits for the other peers (none: no limit)",
    "allow_relay": "whether ring links may go through the master's relay",
    "metrics_listen": "`host:port` of this peer's Prometheus `/metrics` (none: off)",
    "metrics_token": "bearer token this peer's `/metrics` asks for; needed off loopback",
    "name": "what the operator calls this peer (status page, the master's log); a "
            "certificate's name takes precedence",
    # both
    "secret": "shared secret of the run, the same on every node: a key of at least 128 "
              "random bits (`pccl secret new`), not a password",
    "key_file": "this node's key file (`pccl node new`); none: a fresh key per process",
    "cert_file": "this node's certificate, signed by the run key (`pccl ca sign`)",
    "trust": "run-key files (`run.pub`, comma-separated) whose certificates every other "
             "node must present; none: certificates are not checked",
    "allow_anonymous": "run with nothing authenticating the nodes (no secret, no "
                       "certificates) on a non-loopback address",
    "run_id": "the run this node is for: a master refuses peers that name another run "
              "(or none when it has one)",
    "secret_grace": "seconds the previous secret is still accepted after a rotation (the "
                    "secret file changed)",
    "state_dir": "directory where the master keeps what outlives a restart: its timeline "
                 "(`timeline.jsonl`) and the keys the operator removed (`bans.json`); "
                 "none: nothing kept",
    "denylist": "signed denylist file (`pccl ca revoke`), watched: its keys are dropped "
                "and refused",
    "insecure": "clear-text connections (trusted networks only; the same on every node)",
    # MasterNode
    "listen": "address the master listens on (port 0: a free one)",
    "heartbeat_interval": "seconds between the master's pings to each peer",
    "heartbeat_timeout": "a peer silent this long is dropped",
    "handshake_timeout": "seconds a connecting peer has to say hello",
    "max_establish_attempts": "attempts at building the rings before a round fails",
    "recovery_grace": "after a restart: seconds to wait for the rest of an old group",
    "establish_timeout": "seconds the peers of a topology round have to report their links",
    "repair_rings": "rebuild a ring that lost a peer without waiting for update_topology()",
    "dial_back_timeout": "seconds for the reachability check of each peer's p2p address",
    "max_relayed_streams": "ring-link streams relayed at once (0: no relay)",
    "max_connections": "control-port connections held at once, of every kind; past it the "
                       "master stops accepting (none: the open-files limit less 128)",
    "standby": "start no group: only take one over from the peers of a lost master",
    "quorum": "a new ring needs a majority of the group's previous ring (split-brain "
              "protection; none: on for a standby, else off)",
    "mesh_max_bytes": "all-reduces up to this size run on the mesh (recursive doubling) "
                      "instead of the ring (-1: chosen from k and the measured links; 0: "
                      "never)",
    "status_listen": "`host:port` of the status page, `/api/status`, `/metrics` and "
                     "`/healthz` (none: off)",
    "status_token": "bearer token the status server asks for; needed off loopback",
    "admin_socket": "Unix socket of the master's admin channel (`pccl admin`: remove a "
                    "contributor, end the run), 0600, for root and the master's user only "
                    "(none: off)",
}


class _Bad(ValueError):
    """A value of the wrong form; ``from_env`` adds the variable and what it accepts."""


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable and the constructor parameter it sets."""

    name: str  #: ``PCCL_...``
    param: str  #: the constructor's parameter
    accepts: str  #: what values it takes, in words
    default: Any  #: the constructor's default (``inspect.Parameter.empty``: none)
    help: str  #: what it means ("" when nobody wrote it down: a test fails)
    file_name: str | None = None  #: ``PCCL_..._FILE`` for a secret, else None
    parse: Callable[[str, Env], tuple[Any, str]] = dataclasses.field(
        default=lambda raw, env: (raw, ""), repr=False, compare=False)


def env_name(param: str) -> str:
    """The variable of a constructor parameter."""
    return RENAMED.get(param, PREFIX + param.upper())


def is_set(env: Env, name: str) -> bool:
    """Whether ``name`` is set to something other than blanks."""
    return bool(env.get(name, "").strip())


# --- values --------------------------------------------------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("none", "off")
_INT = re.compile(r"[+-]?[0-9]+")
_PORT_PLUS_RANK = re.compile(r"([0-9]+)\s*\+\s*local_rank", re.IGNORECASE)


def _int(raw: str, env: Env) -> tuple[Any, str]:
    if not _INT.fullmatch(raw):
        raise _Bad("an integer")
    return int(raw), ""


def _float(raw: str, env: Env) -> tuple[Any, str]:
    try:
        value = float(raw)
    except ValueError:
        raise _Bad("a number (e.g. 10 or 2.5)") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise _Bad("a finite number (e.g. 10 or 2.5)")
    return value, ""


def _bool(raw: str, env: Env) -> tuple[Any, str]:
    if raw.lower() in _TRUE:
        return True, ""
    if raw.lower() in _FALSE:
        return False, ""
    raise _Bad("a boolean: 1/0, true/false, yes/no or on/off")


def _str(raw: str, env: Env) -> tuple[Any, str]:
    return raw, ""


def _optional(parse: Callable[[str, Env], tuple[Any, str]]) -> Callable[[str, Env],
                                                                         tuple[Any, str]]:
    def parse_optional(raw: str, env: Env) -> tuple[Any, str]:
        if raw.lower() in _NONE:
            return None, ""
        try:
            return parse(raw, env)
        except _Bad as e:
            raise _Bad(f"{e} or none/off") from None
    return parse_optional


def _peer_group(raw: str, env: Env) -> tuple[Any, str]:
    if raw.lower() == "local_rank":
        rank, source = _local_rank(env, f"PCCL_PEER_GROUP={raw!r}")
        return rank, f" with {source}"
    try:
        return _int(raw, env)
    except _Bad:
        raise _Bad("an integer, or local_rank (the launcher's local rank: "
                   + _rank_sources() + ")") from None


def _port(raw: str, env: Env) -> tuple[Any, str]:
    match = _PORT_PLUS_RANK.fullmatch(raw)
    if match:
        rank, source = _local_rank(env, f"{env_name('p2p_listen_port')}={raw!r}")
        return int(match[1]) + rank, f" with {source}"
    try:
        return _int(raw, env)
    except _Bad:
        raise _Bad("a port number, or BASE+local_rank (e.g. 29600+local_rank: "
                   "consecutive ports for the peers of one node)") from None


def _rank_sources() -> str:
    return ", ".join(f"{name} ({who})" for name, who in LOCAL_RANK_VARIABLES)


def _local_rank(env: Env, why: str) -> tuple[int, str]:
    for name, _ in LOCAL_RANK_VARIABLES:
        raw = env.get(name, "").strip()
        if raw:
            if not raw.isascii() or not raw.isdigit():
                raise InvalidArgumentError(
                    f"{name}={raw!r} (read for {why}) is not a local rank: expected an "
                    f"integer >= 0")
            return int(raw), f"{name}={raw}"
    raise InvalidArgumentError(
        f"{why} needs the launcher's local rank, but none of {_rank_sources()} is set; "
        f"start the process with torchrun, srun or mpirun, or give a number")


def local_rank(env: Env | None = None) -> int:
    """This process's rank among the processes of its node, as its launcher set it:
    the first set of ``LOCAL_RANK`` (torchrun), ``SLURM_LOCALID`` (Slurm) and
    ``OMPI_COMM_WORLD_LOCAL_RANK`` (Open MPI). ``env`` defaults to ``os.environ``.

    Raises :class:`~pccl.InvalidArgumentError` when none is set (naming them) or the
    first one set is not an integer >= 0.

    Example::

        from pccl.config import local_rank
        assert local_rank({"SLURM_LOCALID": "3"}) == 3
        assert local_rank({"LOCAL_RANK": "1", "SLURM_LOCALID": "0"}) == 1
    """
    return _local_rank(os.environ if env is None else env, "local_rank()")[0]


# --- secrets -------------------------------------------------------------------------


def read_secret_file(path: str | os.PathLike[str], what: str = "secret file") -> bytes:
    """The contents of a secret file, surrounding whitespace stripped.

    Raises :class:`~pccl.InvalidArgumentError` (``what`` names the file in the message)
    when the file cannot be read or holds nothing but whitespace.

    Example::

        import pathlib, tempfile
        from pccl.config import read_secret_file
        f = pathlib.Path(tempfile.mkdtemp()) / "secret"
        f.write_text("s3cret\\n")
        assert read_secret_file(f) == b"s3cret"
    """
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise InvalidArgumentError(
            f"cannot read the {what} {str(path)!r}: {e.strerror or e}") from None
    if not secret:
        raise InvalidArgumentError(f"the {what} {str(path)!r} is empty")
    return secret


def _secret(v: Variable, env: Env, want_bytes: bool,
            want_path: bool = False) -> tuple[bool, Any, str]:
    """(found, value, source) of a secret and its file variable. ``want_path``: the
    parameter takes the file itself (it re-reads it when it changes: a rotation), read
    once here so that an unreadable or empty file fails now."""
    assert v.file_name is not None
    value_set, file_set = v.name in env, v.file_name in env
    if value_set and file_set:
        raise InvalidArgumentError(
            f"both {v.name} and {v.file_name} are set: set one of them")
    if value_set:
        text = env[v.name].strip()
        if not text:
            raise InvalidArgumentError(
                f"{v.name} is set but empty: give the {SECRETS[v.param]}, or unset it")
        return True, text, v.name
    if file_set:
        path = env[v.file_name].strip()
        what = SECRETS[v.param] + " file"
        if not path:
            raise InvalidArgumentError(f"{v.file_name} is set but empty: give the path of "
                                       f"the {what}, or unset it")
        data = read_secret_file(path, what)
        if want_path:
            return True, Path(path), f"{v.file_name}={path!r}"
        if want_bytes:
            return True, data, f"{v.file_name}={path!r}"
        try:
            return True, data.decode(), f"{v.file_name}={path!r}"
        except UnicodeDecodeError:
            raise InvalidArgumentError(
                f"the {what} {path!r} ({v.file_name}) is not UTF-8 text") from None
    return False, None, ""


# --- the table -----------------------------------------------------------------------


def _parser(cls: type, param: str, hint: Any) -> tuple[Callable[[str, Env], tuple[Any, str]],
                                                        str]:
    if param == "peer_group":
        return _peer_group, "an integer, or `local_rank`"
    if param == "p2p_listen_port":
        return _port, "a port, or `BASE+local_rank` (e.g. `29600+local_rank`)"
    if param == "master":
        return _str, "text: `host:port`, or several separated by commas"
    args = set(typing.get_args(hint)) or {hint}
    optional = type(None) in args
    args.discard(type(None))
    if param in SECRETS and all(a in (str, bytes) or typing.get_origin(a) is os.PathLike
                                for a in args):
        return _str, f"text; `{env_name(param)}_FILE`: a file holding it"
    base: dict[Any, tuple[Callable[[str, Env], tuple[Any, str]], str]] = {
        bool: (_bool, "boolean: `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`"),
        int: (_int, "an integer"),
        float: (_float, "a number"),
        str: (_str, "text"),
    }
    if len(args) != 1 or next(iter(args)) not in base:
        raise TypeError(f"{cls.__name__}({param}: {hint}): pccl.config cannot read this type "
                        f"from the environment; teach it one (pccl/config.py, _parser)")
    parse, accepts = base[next(iter(args))]
    if optional:
        return _optional(parse), accepts + ", or `none`/`off`"
    return parse, accepts


@functools.cache
def variables(cls: type) -> tuple[Variable, ...]:
    """The variables of ``cls``'s constructor (``Communicator``, ``MasterNode`` or a
    subclass), in the order of its parameters.

    Example::

        import pccl
        from pccl.config import variables
        v = {v.param: v for v in variables(pccl.Communicator)}
        assert v["master"].name == "PCCL_MASTER" and v["secret"].file_name == "PCCL_SECRET_FILE"
    """
    init = cls.__init__  # type: ignore[misc]
    hints = typing.get_type_hints(init)
    out = []
    for p in list(inspect.signature(init).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{cls.__name__}.__init__ takes *{p.name}: pccl.config needs "
                            f"named parameters")
        parse, accepts = _parser(cls, p.name, hints.get(p.name, Any))
        name = env_name(p.name)
        out.append(Variable(name=name, param=p.name, accepts=accepts, default=p.default,
                            help=_HELP.get(p.name, ""),
                            file_name=name + "_FILE" if p.name in SECRETS else None,
                            parse=parse))
    return tuple(out)


#: The classes configured from the environment (``Communicator``, ``MasterNode``): each
#: registers itself where it is defined, so this module imports neither.
_CLASSES: list[type] = []


def register(cls: type[T]) -> type[T]:
    """Adds ``cls`` to the classes whose variables :func:`names` and
    :func:`markdown_table` list (a class decorator)."""
    if cls not in _CLASSES:
        _CLASSES.append(cls)
    return cls


def _classes() -> tuple[type, ...]:
    return tuple(_CLASSES)


def names() -> frozenset[str]:
    """Every environment variable pccl reads: those of ``Communicator`` and
    ``MasterNode`` (secret files included), ``PCCL_LOG_LEVEL`` and ``PCCL_LOG_FORMAT``.

    Example::

        from pccl.config import names
        assert {"PCCL_MASTER", "PCCL_SECRET_FILE", "PCCL_STATUS_LISTEN"} <= names()
    """
    out = {LOG_LEVEL, LOG_FORMAT}
    for cls in _classes():
        for v in variables(cls):
            out.add(v.name)
            if v.file_name:
                out.add(v.file_name)
    return frozenset(out)


def _shown_default(v: Variable) -> str:
    if v.default is inspect.Parameter.empty:
        return "(required)"
    if v.default is None:
        return "none"
    if isinstance(v.default, bool):
        return str(v.default).lower()
    return f"`{v.default}`"


def markdown_table() -> str:
    """The variables as a Markdown table (``python -m pccl env`` prints it)."""
    rows = ["| variable | sets | accepts | default | meaning |", "|---|---|---|---|---|"]
    owners: dict[str, list[str]] = {}
    table: dict[str, Variable] = {}
    for cls in _classes():
        for v in variables(cls):
            owners.setdefault(v.name, []).append(f"`{cls.__name__}({v.param}=)`")
            table.setdefault(v.name, v)
    for name, v in table.items():
        shown = f"`{name}`" + (f", `{v.file_name}`" if v.file_name else "")
        rows.append(f"| {shown} | {', '.join(owners[name])} | {v.accepts} | "
                    f"{_shown_default(v)} | {v.help} |")
    rows.append(f"| `{LOG_LEVEL}` | the `pccl` loggers, at `import pccl` | `debug`, `info`, "
                f"`warning`, `error`, `critical` or a number | unset | how much pccl logs |")
    rows.append(f"| `{LOG_FORMAT}` | pccl's own log handler and `pccl-master`, at `import "
                f"pccl` | `text`, `json` | `text` | one line per record (UTC timestamps), or "
                f"one JSON object per line |")
    return "\n".join(rows) + "\n"


# --- building ------------------------------------------------------------------------


def resolve(cls: type, env: Env | None = None,
            overrides: Mapping[str, Any] | None = None) -> tuple[dict[str, Any],
                                                                 dict[str, str]]:
    """The keyword arguments ``from_env()`` would give ``cls``: ``overrides`` first, then
    the variables that are set (parameters neither overridden nor set are left out, so
    the constructor's defaults apply), and where each came from (``"argument"`` or
    ``"PCCL_X='value'"``; a secret's value is never shown).

    Raises ``TypeError`` for an override ``cls`` has no parameter for and
    :class:`~pccl.InvalidArgumentError` for a value of the wrong form.
    """
    env = os.environ if env is None else env
    overrides = dict(overrides or {})
    table = variables(cls)
    unknown = sorted(set(overrides) - {v.param for v in table})
    if unknown:
        raise TypeError(f"{cls.__name__}.from_env() got an unexpected keyword argument "
                        f"{unknown[0]!r}")
    kwargs: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for v in table:
        if v.param in overrides:
            kwargs[v.param], sources[v.param] = overrides[v.param], "argument"
        elif v.file_name is not None:
            found, value, source = _secret(v, env, _takes_bytes(cls, v.param),
                                           _takes_path(cls, v.param))
            if found:
                kwargs[v.param], sources[v.param] = value, source
        elif is_set(env, v.name):
            raw = env[v.name].strip()
            try:
                value, note = v.parse(raw, env)
            except _Bad as e:
                raise InvalidArgumentError(
                    f"{v.name}={raw!r} is not valid: expected {e}") from None
            kwargs[v.param], sources[v.param] = value, f"{v.name}={raw!r}{note}"
    return kwargs, sources


def _takes_path(cls: type, param: str) -> bool:
    hint = typing.get_type_hints(cls.__init__).get(param)  # type: ignore[misc]
    return any(typing.get_origin(a) is os.PathLike for a in typing.get_args(hint))


def _takes_bytes(cls: type, param: str) -> bool:
    hint = typing.get_type_hints(cls.__init__).get(param)  # type: ignore[misc]
    return bytes in typing.get_args(hint) or hint is bytes


def from_env(cls: type[T], env: Env | None = None, **overrides: Any) -> T:
    """``cls(**arguments)`` with the arguments read from ``env`` (default:
    ``os.environ``) and ``overrides`` winning: what :meth:`pccl.Communicator.from_env`
    and :meth:`pccl.MasterNode.from_env` do. Logs the configuration at DEBUG level
    (secrets hidden).

    Example::

        import pccl
        from pccl.config import from_env
        master = from_env(pccl.MasterNode, {"PCCL_MASTER_LISTEN": "127.0.0.1:0"})
        assert master.listen == "127.0.0.1:0"
    """
    kwargs, sources = resolve(cls, env, overrides)
    try:
        obj = cls(**kwargs)
    except InvalidArgumentError as e:
        # The constructor names the parameter; say which variable gave it.
        blamed = [sources[p] for p in kwargs if sources[p] != "argument"
                  and re.search(rf"\b{re.escape(p)}\b", str(e))]
        if blamed:
            raise InvalidArgumentError(
                f"{e} (from the environment: {', '.join(blamed)})") from None
        raise
    if log.isEnabledFor(logging.DEBUG):
        shown = []
        for v in variables(typing.cast(type, cls)):
            value = kwargs.get(v.param, v.default)
            text = ("<hidden>" if value is not None else "None") if v.param in SECRETS \
                else repr(value)
            shown.append(f"{v.param}={text} ({sources.get(v.param, 'default')})")
        log.debug("%s.from_env(): %s", cls.__name__, ", ".join(shown))
    return obj

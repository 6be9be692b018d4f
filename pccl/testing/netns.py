"""Real test hosts: every peer (and the master) in its own Linux network namespace.

Loopback hides what real networks do: one address for everybody, no routing, no queues.
:class:`VirtualLan` builds a private switched LAN out of kernel objects instead::

    namespace <prefix>-br          namespaces <prefix>-h0, -h1, ...
    +--------------------------+    +----------------------------+
    | bridge br0               |    | eth0 10.47.0.1/24 (+ tc)   |
    |   h0 (veth) -------------+----+-- eth0 (the veth's peer)   |
    |   h1 (veth) ------------ ...  | lo                         |
    +--------------------------+    +----------------------------+

The bridge lives in a namespace of its own, so the root namespace's interfaces and
routes are never touched; every namespace name carries the pid and a random token, so
parallel or leftover runs cannot collide. Interface names are local to a namespace and
may repeat across LANs. Hosts talk through the bridge only: each gets an address of
``10.47.0.0/24``, and egress or ingress can be capped with ``tc`` (``tbf`` or ``htb``;
the CI kernel has no ``netem``). A link is cut at the kernel level by setting the
host's bridge port down (packets vanish, no reset is sent to anyone), or between two
hosts only (:meth:`VirtualLan.partition`: a u32 filter into a ``blackhole`` qdisc).

Processes are started inside a namespace with ``ip netns exec`` (which execs, so the
child *is* the Python process and signals reach it directly); they are driven over
stdin/stdout pipes, which do not care about network namespaces. Needs root and
iproute2 (``ip``, ``tc``): :func:`netns_unavailable` says why not, and the
``pccl_netns`` fixture skips with that reason.

Homes behind NAT (:meth:`VirtualLan.add_nat_host`): a router namespace on the LAN
(a public address) masquerades, with nftables, for a home namespace on a private
subnet of its own (``192.168.<n>.0/24``) behind it, and its stateful filter drops
connections from outside into the home (silently, without a reset, as most home routers
do), while replies to what the home opened come in. The home's LAN is a bridge in a
namespace of its own, so more hosts can share it (``add_nat_host(behind=home)``: one
NAT, one public address, a LAN between them that the router never filters)::

    LAN 10.47.0.0/24 -- eth0 [router: nft masquerade, forward: established only] lan0 --
        -- [home bridge br0] -- eth0 192.168.<n>.2 [home]
                             -- eth0 192.168.<n>.3 [a second host behind=home] ...

By default the router keeps a connection's source port when it can (Linux
masquerade), so two homes can punch a hole to each other: both connect from their p2p
port to the other's public address at once, and each router takes the other's SYN for
the reply to its own. With ``random_ports=True`` it maps each connection to a random
public port (``masquerade random``, a "symmetric" NAT): nobody outside can predict a
home's address for a connection, and hole punching fails. Needs ``nft`` (Debian's nftables) besides.

Everything created is removed by :meth:`VirtualLan.close` (processes first, then the
bridge ports and namespaces), which then checks that none of its namespaces is left;
an ``atexit`` hook removes what an interrupted run could not.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ipaddress
import itertools
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from pccl.testing.processes import PeerProcess, stop_process

__all__ = ["Host", "MasterProcess", "NetnsError", "VirtualLan", "nat_unavailable",
           "netns_unavailable"]

SUBNET = ipaddress.ip_network("10.47.0.0/24")
_IP_TIMEOUT = 15.0  # one ip/tc command; they take milliseconds
_lan_ids = itertools.count()
_live: set[str] = set()  # namespaces this process created and has not removed yet
_probe_result: list[str | None] = []


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed (its stderr is in the message)."""


def netns_unavailable() -> str | None:
    """Why namespaced hosts cannot be built here, or None if they can (cached).

    Checks root, ``ip`` and ``tc``, then builds and removes a throwaway namespace
    holding a bridge, a veth pair and a ``tbf`` qdisc, and runs Python inside it.
    """
    if not _probe_result:
        _probe_result.append(_probe())
    return _probe_result[0]


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    ns = f"pccl-probe-{os.getpid()}-{secrets.token_hex(3)}"
    steps = [["ip", "netns", "add", ns],
             ["ip", "-n", ns, "link", "add", "br0", "type", "bridge"],
             ["ip", "-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
             ["tc", "-n", ns, "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "10mbit",
              "burst", "32kb", "latency", "50ms"],
             ["ip", "netns", "exec", ns, sys.executable, "-c", "pass"]]
    try:
        for cmd in steps:
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=_IP_TIMEOUT)
            except (OSError, subprocess.TimeoutExpired) as e:
                return f"`{' '.join(cmd)}` failed: {e}"
            if r.returncode != 0:
                return f"`{' '.join(cmd)}` failed: {r.stderr.strip() or r.returncode}"
        return None
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_IP_TIMEOUT)


def nat_unavailable() -> str | None:
    """Why NAT'd homes cannot be built here (no namespaces, or no ``nft``), or None."""
    why = netns_unavailable()
    if why is None and shutil.which("nft") is None:
        why = "nft (nftables) is not installed: apt-get install nftables"
    return why


@atexit.register
def _remove_leftovers() -> None:
    """Last resort for a run interrupted before its LANs were closed."""
    for ns in sorted(_live):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_IP_TIMEOUT)
    _live.clear()


async def _run(*cmd: str, check: bool = True) -> str:
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(_IP_TIMEOUT):
            out, err = await proc.communicate()
    except BaseException:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        raise
    if check and proc.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` exited {proc.returncode}: "
                         f"{err.decode(errors='replace').strip()}")
    return out.decode()


@dataclass(frozen=True)
class Host:
    """One namespace with one address on the LAN."""

    label: str
    ns: str  # the namespace's name
    address: str  # its IPv4 address on the LAN
    port: str  # its bridge port (a veth) in the bridge namespace
    index: int

    @property
    def exec_prefix(self) -> list[str]:
        """Prepend to a command line to run it on this host."""
        return ["ip", "netns", "exec", self.ns]


class MasterProcess:
    """``python -m pccl master`` running on a host, its log parsed as it arrives.

    ``registered`` maps peer id -> the address the master saw it connect from;
    ``gone`` maps peer id -> the log line that says why it was dropped or left.
    """

    _REGISTERED = re.compile(r"peer (\d+) registered from (\S+)")
    # "peer 3 dropped: heartbeat timeout" (the server), "peer 3 (accepted, group 0)
    # dropped: connection closed" (the state's note)
    _GONE = re.compile(r"peer (\d+) (?:\([^)]*\) )?(dropped|disconnected)\b")

    def __init__(self, host: Host, *, port: int = 0, heartbeat_interval: float = 0.2,
                 heartbeat_timeout: float = 2.0, status: bool = False) -> None:
        self.host = host
        self.port = port
        # Whether it serves its status page (on its host's loopback: api_status()).
        self.status = status
        self.status_url = ""
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.address = ""
        self.registered: dict[int, str] = {}
        self.gone: dict[int, str] = {}
        self.log: list[str] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    async def start(self, timeout: float = 30.0) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.host.exec_prefix, sys.executable, "-m", "pccl", "master",
            "--listen", f"{self.host.address}:{self.port}",
            "--heartbeat-interval", str(self.heartbeat_interval),
            "--heartbeat-timeout", str(self.heartbeat_timeout), "--log-level", "INFO",
            "--status", "127.0.0.1:0" if self.status else "off",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._reader = asyncio.create_task(self._read_log())
        self.address = await self._next_line(r"listening on (\S+)", "did not start", timeout)
        if self.status:
            self.status_url = await self._next_line(r"status page on (http://\S+/)",
                                                    "serves no status page", timeout)

    async def _next_line(self, pattern: str, failure: str, timeout: float) -> str:
        """The first group of ``pattern`` in the master's next line of output."""
        assert self.proc is not None and self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            line = (await self.proc.stdout.readline()).decode()
        m = re.search(pattern, line)
        if m is None:
            raise NetnsError(f"the master on {self.host.label} {failure}: {line!r} "
                             f"{self.log[-5:]}")
        return m.group(1)

    async def api_status(self) -> Any:
        """Its ``/api/status`` document, fetched on its own host (its loopback)."""
        if not self.status_url:
            raise NetnsError("this master was started without a status page (status=True)")
        fetch = ("import sys, urllib.request; "
                 "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read()"
                 ".decode())")
        return json.loads(await _run(*self.host.exec_prefix, sys.executable, "-c", fetch,
                                     self.status_url + "api/status"))

    async def _read_log(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while raw := await self.proc.stderr.readline():
            line = raw.decode(errors="replace").rstrip()
            self.log.append(line)
            if m := self._REGISTERED.search(line):
                self.registered[int(m.group(1))] = m.group(2)
            elif m := self._GONE.search(line):
                self.gone.setdefault(int(m.group(1)), line)
            self._changed.set()
        self._changed.set()

    async def wait_for(self, pred: Callable[[MasterProcess], bool], timeout: float = 30.0) -> None:
        """Waits until ``pred(self)`` holds, re-checked after every log line."""
        async with asyncio.timeout(timeout):
            while not pred(self):
                if self._reader is None or self._reader.done():
                    raise NetnsError(f"the master exited; last log lines: {self.log[-5:]}")
                self._changed.clear()
                await self._changed.wait()

    def peer_host(self, peer_id: int) -> str:
        """The IP address peer ``peer_id`` connected from."""
        return self.registered[peer_id].rsplit(":", 1)[0]

    async def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (a graceful stop), SIGKILL after ``timeout``; then reaps it."""
        if self.proc is None:
            return
        await stop_process(self.proc, timeout)
        if self._reader is not None:
            await asyncio.wait({self._reader}, timeout=timeout)  # EOF follows the exit
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        transport = getattr(self.proc, "_transport", None)
        if transport is not None:
            transport.close()


class VirtualLan:
    """A private switched LAN of namespaced hosts; see the module docstring.

    Example::

        async with VirtualLan() as lan:
            m, a, b = [await lan.add_host(x) for x in ("master", "a", "b")]
            master = await lan.start_master(m)
            await lan.shape(b, rate_bps=50e6, qdisc="tbf")    # b's uplink: 50 Mbit/s
            pa = await lan.spawn_peer(a, master.address)
            await lan.set_link(b, up=False)                   # unplug b
    """

    def __init__(self) -> None:
        self.prefix = f"pccl-{os.getpid()}-{next(_lan_ids)}{secrets.token_hex(2)}"
        self.bridge_ns = f"{self.prefix}-br"
        self.hosts: list[Host] = []
        self.masters: list[MasterProcess] = []
        self.peers: list[PeerProcess] = []
        self._started = False
        self._homes: list[str] = []  # namespaces of NAT'd homes (behind a router host)
        # Per home LAN (by its router's bridge port): (n of 192.168.<n>.0/24, the
        # namespace of its bridge, hosts on it so far); per home host, (the namespace
        # of its LAN's bridge, its port there).
        self._home_lans: dict[str, tuple[int, str, int]] = {}
        self._home_ports: dict[str, tuple[str, str]] = {}
        self._blocked: dict[str, set[str]] = {}  # bridge port -> source addresses dropped
        self._port_shaped: set[str] = set()  # bridge ports with an ingress shaper

    async def start(self) -> None:
        _live.add(self.bridge_ns)
        self._started = True
        await _run("ip", "netns", "add", self.bridge_ns)
        await _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        await _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")

    async def add_host(self, label: str) -> Host:
        """A new namespace plugged into the bridge, with the next free address."""
        i = len(self.hosts)
        if i + 2 > SUBNET.num_addresses - 1:
            raise NetnsError("the LAN's subnet is full")
        host = Host(label=label, ns=f"{self.prefix}-h{i}", address=str(SUBNET[i + 1]),
                    port=f"h{i}", index=i)
        self.hosts.append(host)
        _live.add(host.ns)
        await _run("ip", "netns", "add", host.ns)
        # The pair is created in the bridge namespace; one end moves straight to the host.
        await _run("ip", "-n", self.bridge_ns, "link", "add", host.port, "type", "veth",
                   "peer", "name", "eth0", "netns", host.ns)
        await _run("ip", "-n", self.bridge_ns, "link", "set", host.port, "master", "br0")
        await _run("ip", "-n", self.bridge_ns, "link", "set", host.port, "up")
        await _run("ip", "-n", host.ns, "addr", "add",
                   f"{host.address}/{SUBNET.prefixlen}", "dev", "eth0")
        await _run("ip", "-n", host.ns, "link", "set", "eth0", "up")
        await _run("ip", "-n", host.ns, "link", "set", "lo", "up")
        return host

    async def add_nat_host(self, label: str, *, random_ports: bool = False,
                           behind: Host | None = None) -> Host:
        """A home namespace behind a NAT router (see the module docstring). The returned
        host's ``address`` is its private one; its ``port`` is the router's bridge port,
        so :meth:`set_link` unplugs the whole home. ``behind``: another host on the LAN
        of that home (returned by this method), behind its router, instead of a new
        home."""
        if behind is not None:
            if behind.port not in self._home_lans or random_ports:
                raise NetnsError(f"{behind.label} is not a home of this LAN (or random_ports "
                                 "was given for a home that has its router already)")
            return await self._add_home_host(label, behind.port, behind.index)
        router = await self.add_host(f"{label}-router")
        n = len(self._home_lans) + 1
        if n > 250:
            raise NetnsError("too many NAT'd homes")
        bridge = f"{self.prefix}-n{n}b"
        self._homes.append(bridge)
        _live.add(bridge)
        await _run("ip", "netns", "add", bridge)
        await _run("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        await _run("ip", "-n", bridge, "link", "set", "br0", "up")
        await _run("ip", "-n", bridge, "link", "add", "r", "type", "veth", "peer", "name",
                   "lan0", "netns", router.ns)
        await _run("ip", "-n", bridge, "link", "set", "r", "master", "br0")
        await _run("ip", "-n", bridge, "link", "set", "r", "up")
        await _run("ip", "-n", router.ns, "addr", "add", f"192.168.{n}.1/24", "dev", "lan0")
        await _run("ip", "-n", router.ns, "link", "set", "lan0", "up")
        await _run(*router.exec_prefix, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        self._home_lans[router.port] = (n, bridge, 0)
        masquerade = "masquerade random" if random_ports else "masquerade"
        ruleset = f"""
table ip nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "eth0" {masquerade}
    }}
}}
table ip filter {{
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan0" oifname "eth0" accept
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "eth0" ct state new drop
    }}
}}
"""
        proc = await asyncio.create_subprocess_exec(
            *router.exec_prefix, "nft", "-f", "-", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        async with asyncio.timeout(_IP_TIMEOUT):
            _, err = await proc.communicate(ruleset.encode())
        if proc.returncode != 0:
            raise NetnsError(f"nft on {router.label} failed: {err.decode().strip()}")
        return await self._add_home_host(label, router.port, router.index)

    async def _add_home_host(self, label: str, router_port: str, index: int) -> Host:
        """One more host on the home LAN behind the router at ``router_port``."""
        n, bridge, count = self._home_lans[router_port]
        if count >= 200:
            raise NetnsError("too many hosts in one home")
        self._home_lans[router_port] = (n, bridge, count + 1)
        home = Host(label=label, ns=f"{self.prefix}-n{n}h{count}",
                    address=f"192.168.{n}.{count + 2}", port=router_port, index=index)
        self._homes.append(home.ns)
        self._home_ports[home.ns] = (bridge, f"h{count}")
        _live.add(home.ns)
        await _run("ip", "netns", "add", home.ns)
        await _run("ip", "-n", bridge, "link", "add", f"h{count}", "type", "veth", "peer",
                   "name", "eth0", "netns", home.ns)
        await _run("ip", "-n", bridge, "link", "set", f"h{count}", "master", "br0")
        await _run("ip", "-n", bridge, "link", "set", f"h{count}", "up")
        await _run("ip", "-n", home.ns, "addr", "add", f"{home.address}/24", "dev", "eth0")
        await _run("ip", "-n", home.ns, "link", "set", "eth0", "up")
        await _run("ip", "-n", home.ns, "link", "set", "lo", "up")
        await _run("ip", "-n", home.ns, "route", "add", "default", "via", f"192.168.{n}.1")
        return home

    async def isolate_at_home(self, host: Host) -> None:
        """``host`` (behind NAT) no longer reaches the other isolated hosts of its home
        LAN (a bridge port flag: their packets to each other vanish), while it still
        reaches its router and through it everyone else: two networks behind one NAT,
        as far as its neighbours at home are concerned."""
        bridge, port = self._home_ports[host.ns]
        await _run("ip", "-n", bridge, "link", "set", "dev", port, "type", "bridge_slave",
                   "isolated", "on")

    async def shape(self, host: Host, rate_bps: float, *, qdisc: str = "tbf",
                    direction: str = "egress") -> None:
        """Caps ``host``'s ``egress`` (its eth0) or ``ingress`` (its bridge port, which
        sends towards it) at ``rate_bps`` bits/s with a ``tbf`` or ``htb`` qdisc."""
        if direction == "egress":
            ns, dev = host.ns, "eth0"
        elif direction == "ingress":
            if self._blocked.get(host.port):
                raise NetnsError(f"{host.label} is partitioned; shape its ingress first")
            ns, dev = self.bridge_ns, host.port
            self._port_shaped.add(host.port)
        else:
            raise ValueError(f"direction must be 'egress' or 'ingress', not {direction!r}")
        rate = f"{int(rate_bps)}bit"
        # A bucket of 10 ms at the rate, and never less than a few full-size packets.
        burst = str(max(int(rate_bps / 8 / 100), 32 * 1514))
        base = ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root"]
        if qdisc == "tbf":
            await _run(*base, "tbf", "rate", rate, "burst", burst, "latency", "100ms")
        elif qdisc == "htb":
            await _run(*base, "handle", "1:", "htb", "default", "1")
            await _run("tc", "-n", ns, "class", "replace", "dev", dev, "parent", "1:",
                       "classid", "1:1", "htb", "rate", rate, "ceil", rate, "burst", burst,
                       "quantum", "1514")
        else:
            raise ValueError(f"qdisc must be 'tbf' or 'htb', not {qdisc!r}")

    async def qdisc_stats(self, host: Host, direction: str = "egress") -> dict[str, Any]:
        """``tc -s`` statistics of the root qdisc shaping ``host`` in ``direction``."""
        ns, dev = (host.ns, "eth0") if direction == "egress" else (self.bridge_ns, host.port)
        out = json.loads(await _run("tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev,
                                    "root"))
        return out[0] if out else {}

    async def link_bytes(self, host: Host) -> tuple[int, int]:
        """(bytes ``host`` sent, bytes it received) as counted at its bridge port."""
        out = json.loads(await _run("ip", "-n", self.bridge_ns, "-s", "-j", "link", "show",
                                    "dev", host.port))
        stats = out[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    async def set_link(self, host: Host, *, up: bool) -> None:
        """Plugs ``host``'s bridge port in or out. Unplugged, every packet to or from it
        is dropped silently: its TCP connections stall, nobody gets a reset."""
        await _run("ip", "-n", self.bridge_ns, "link", "set", host.port,
                   "up" if up else "down")

    async def partition(self, a: Host, b: Host) -> None:
        """Cuts the link between ``a`` and ``b`` only: IP packets between them vanish
        (at the bridge ports, via a u32 filter into a ``blackhole`` qdisc), while both
        still reach everyone else, the master included."""
        for dst, src in ((a, b), (b, a)):
            if dst.port in self._port_shaped:
                raise NetnsError(f"{dst.label}'s ingress is shaped; it cannot be partitioned")
            self._blocked.setdefault(dst.port, set()).add(src.address)
            await self._install_blocks(dst.port)

    async def heal(self, a: Host, b: Host) -> None:
        """Undoes :meth:`partition` of ``a`` and ``b``."""
        for dst, src in ((a, b), (b, a)):
            self._blocked.get(dst.port, set()).discard(src.address)
            await self._install_blocks(dst.port)

    async def _install_blocks(self, port: str) -> None:
        # Rebuilt from scratch: htb with a pass-through default class and a class whose
        # leaf qdisc drops everything; one filter per blocked source address.
        tc = ["tc", "-n", self.bridge_ns]
        await _run(*tc, "qdisc", "del", "dev", port, "root", check=False)
        sources = sorted(self._blocked.get(port, ()))
        if not sources:
            return
        await _run(*tc, "qdisc", "add", "dev", port, "root", "handle", "1:", "htb",
                   "default", "1")
        for cls in ("1:1", "1:2"):
            await _run(*tc, "class", "add", "dev", port, "parent", "1:", "classid", cls,
                       "htb", "rate", "10gbit", "quantum", "1514")
        await _run(*tc, "qdisc", "add", "dev", port, "parent", "1:2", "handle", "20:",
                   "blackhole")
        for src in sources:
            await _run(*tc, "filter", "add", "dev", port, "parent", "1:", "protocol", "ip",
                       "prio", "1", "u32", "match", "ip", "src", f"{src}/32", "flowid", "1:2")

    async def start_master(self, host: Host, **kwargs: Any) -> MasterProcess:
        """A master process on ``host`` (kwargs: port, heartbeat_interval/_timeout,
        status)."""
        master = MasterProcess(host, **kwargs)
        self.masters.append(master)
        await master.start()
        return master

    async def spawn_peer(self, host: Host, master: str, **kwargs: Any) -> PeerProcess:
        """A :class:`PeerProcess` on ``host``; closed with the LAN."""
        peer = PeerProcess(master, command_prefix=host.exec_prefix, **kwargs)
        self.peers.append(peer)
        await peer.start()
        return peer

    async def close(self) -> None:
        """Kills and reaps every process, removes every port and namespace, and checks
        that none is left. Idempotent."""
        errors: list[str] = []
        for p in self.peers:
            try:
                await p.close()
            except Exception as e:  # keep going: the namespaces must go regardless
                errors.append(f"closing a peer: {e!r}")
        for m in self.masters:
            try:
                await m.stop()
            except Exception as e:
                errors.append(f"stopping the master: {e!r}")
        self.peers.clear()
        self.masters.clear()
        if not self._started:
            return
        mine = [h.ns for h in self.hosts] + self._homes + [self.bridge_ns]
        for h in self.hosts:
            await _run("ip", "-n", self.bridge_ns, "link", "del", h.port, check=False)
        for ns in mine:
            try:
                await _run("ip", "netns", "del", ns)
                _live.discard(ns)
            except NetnsError as e:
                errors.append(str(e))
        left = set((await _run("ip", "netns", "list")).split()) & set(mine)
        self._started = False
        if left or errors:
            raise NetnsError(f"cleanup of {self.prefix} incomplete: left {sorted(left)}; "
                             f"{errors}")

    async def __aenter__(self) -> VirtualLan:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def wait_until(pred: Callable[[], Any], timeout: float, what: str,
                     interval: float = 0.02) -> None:
    """Polls ``await pred()`` (or ``pred()``) until truthy; TimeoutError naming ``what``
    after ``timeout`` seconds. For conditions that raise no event (kernel counters)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = pred()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if loop.time() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


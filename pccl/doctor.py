"""``pccl doctor``: run on a peer's machine before joining a run, it checks what the
peer will need and says what to do about each problem.

Checks, in order (a failed check stops the ones that depend on it):

1. the master address parses and resolves;
2. a TCP connection to it opens (and how long that takes);
3. the transport handshake: encrypted or not, and whether the master and this machine
   agree on the shared secret and on ``insecure``;
4. the master's reachability check of this machine's p2p port (the master dials it
   back, as it does for every peer that registers), and the NAT it sees: this
   machine's address as the master sees it against its own;
5. round trips to the master (median of several pings), throughput both ways (a few
   MiB each), and the clock skew between the two machines.

The doctor never registers as a peer: it speaks the ``doctor_hello`` handshake, which a
master answers with a report and a few echo round trips, then forgets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import secrets
import socket
import statistics
import time

from pccl import _core
from pccl.errors import AuthenticationError, IdentityError, PCCLError, ProtocolError
from pccl.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, compatible, version_mismatch
from pccl.protocol import messages as m
from pccl.protocol.auth import master_mac, peer_mac, split_host_port
from pccl.protocol.transport import ConnectionClosed, FramedConnection

OK, INFO, WARN, FAIL = "ok", "info", "warn", "FAIL"
PINGS = 10
ECHO_BYTES = 4 << 20


@dataclasses.dataclass
class Finding:
    level: str
    check: str
    text: str
    advice: str = ""


@dataclasses.dataclass
class Report:
    master: str
    findings: list[Finding] = dataclasses.field(default_factory=list)

    def add(self, level: str, check: str, text: str, advice: str = "") -> None:
        self.findings.append(Finding(level, check, text, advice))

    @property
    def failed(self) -> bool:
        return any(f.level == FAIL for f in self.findings)

    def render(self) -> str:
        lines = [f"pccl doctor: master {self.master}"]
        for f in self.findings:
            lines.append(f"  [{f.level:>4}] {f.check}: {f.text}")
            if f.advice:
                lines.append(f"         -> {f.advice}")
        warns = sum(f.level == WARN for f in self.findings)
        if self.failed:
            verdict = "NOT READY: fix the FAIL lines above"
        elif warns:
            verdict = f"ready, with {warns} warning(s)"
        else:
            verdict = "ready"
        lines.append(f"verdict: {verdict}")
        return "\n".join(lines)


async def diagnose(master: str, secret: bytes | None = None, *, insecure: bool = False,
                   p2p_port: int = 0, timeout: float = 10.0,
                   identity: _core.Identity | None = None) -> Report:
    """Runs every check against ``master`` and returns the findings, as ``identity``
    (this node's key, certificate and trusted run keys; None: a fresh key)."""
    report = Report(master)
    # (One key for the master connection and the p2p listener: the master's dial-back
    # asks the listener for the key the connection proved.)
    identity = identity if identity is not None else _core.Identity()
    try:
        host, port = split_host_port(master)
    except PCCLError as e:
        report.add(FAIL, "address", str(e), "give the master as host:port")
        return report
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout)
    except (OSError, TimeoutError) as e:
        report.add(FAIL, "address", f"{host!r} does not resolve ({e})",
                   "check the host name (or use the master's IP address)")
        return report
    report.add(OK, "address", f"{host} resolves to {infos[0][4][0]}")

    started = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError) as e:
        report.add(FAIL, "connect", f"no TCP connection to {host}:{port} ({e or 'timed out'})",
                   "is the master running, listening on an address this machine can reach "
                   "(--listen 0.0.0.0:PORT), and is the port open in its firewall?")
        return report
    connect_ms = (time.perf_counter() - started) * 1e3
    report.add(OK, "connect", f"TCP connection opened in {connect_ms:.1f} ms")
    conn = FramedConnection(reader, writer)
    node: _core.P2PNode | None = None
    try:
        try:
            async with asyncio.timeout(timeout):
                await conn.dial(secret, insecure=insecure, identity=identity, group="master")
                challenge = await conn.recv()
        except IdentityError as e:
            report.add(FAIL, "identity", str(e),
                       "this machine needs a certificate from the run key the master trusts "
                       "(--key-file, --cert-file), and must trust the run key that signed "
                       "the master's (--trust); docs/security.md")
            return report
        except AuthenticationError as e:
            report.add(FAIL, "handshake", str(e),
                       "every node of a run needs the same secret (pccl-master --secret-file "
                       "FILE, Communicator(secret=...)) and the same insecure setting")
            return report
        except (PCCLError, ConnectionClosed, TimeoutError) as e:
            report.add(FAIL, "handshake", f"the master did not complete the handshake ({e})",
                       "is this a pccl master of the same version?")
            return report
        if not isinstance(challenge, m.Challenge):
            report.add(FAIL, "handshake", f"the master sent {challenge.TYPE}, not a challenge",
                       "is this a pccl master?")
            return report
        if not compatible((PROTOCOL_VERSION, MIN_PROTOCOL_VERSION),
                          (challenge.version, challenge.min_version or challenge.version)):
            report.add(FAIL, "handshake", version_mismatch(challenge),
                       "see docs/operations.md, Upgrading")
            return report
        if challenge.auth and secret is None:
            report.add(FAIL, "secret", "the master requires a shared secret and none was given",
                       "pass --secret-file FILE (the file the master was started with)")
            return report
        mode = "encrypted (Noise, AES-GCM)" if conn.encrypted else "CLEAR TEXT (insecure)"
        sockname = writer.get_extra_info("sockname")
        node = await _core.P2PNode.bind(0, sockname[0], p2p_port, secret, insecure=insecure,
                                        identity=identity)
        nonce = secrets.token_bytes(16)
        # (Encrypted, the handshake proved the secret: the MACs are for clear text.)
        mac = peer_mac(secret, challenge.nonce, nonce) if secret and not conn.encrypted else b""
        async with asyncio.timeout(timeout):
            await conn.send(m.DoctorHello(version=PROTOCOL_VERSION, nonce=nonce, mac=mac,
                                          p2p_port=int(node.port)))
            reply = await conn.recv()
        if isinstance(reply, m.Reject):
            report.add(FAIL, "secret", f"the master refused this machine: {reply.message}",
                       "use the secret the master was started with")
            return report
        if not isinstance(reply, m.DoctorReport):
            raise ProtocolError(f"expected doctor_report, got {reply.TYPE}")
        if secret is not None and not conn.encrypted and not hmac.compare_digest(
                reply.mac, master_mac(secret, challenge.nonce, nonce)):
            report.add(FAIL, "secret", "the master could not prove it knows the secret",
                       "someone else may be answering at this address")
            return report
        certified = identity.checks_certs
        authenticated = secret is not None or certified
        what = ", ".join(w for w, on in (("the shared secret matches", secret is not None),
                                         ("the certificates check out both ways", certified))
                         if on) or "nothing authenticated (anyone who can reach the master " \
                                   "may join)"
        report.add(OK if conn.encrypted and authenticated else WARN, "handshake",
                   f"{mode}; {what}",
                   "" if conn.encrypted and authenticated else
                   "give every node the same secret, or certificates; keep insecure=False "
                   "off trusted networks")
        _nat_findings(report, sockname, reply, int(node.port))
        await _measure(conn, report, timeout)
    except (ConnectionClosed, TimeoutError, PCCLError, OSError) as e:
        report.add(FAIL, "master", f"the connection to the master failed: {e}",
                   "the master dropped the connection: check its log")
    finally:
        if node is not None:
            await node.close()
        conn.abort()
    return report


def _nat_findings(report: Report, sockname: tuple[str, int], reply: m.DoctorReport,
                  p2p_port: int) -> None:
    seen_host, _, seen_port = reply.observed.rpartition(":")
    local = f"{sockname[0]}:{sockname[1]}"
    if seen_host == sockname[0]:
        report.add(OK, "nat", f"no NAT between here and the master (it sees {reply.observed})")
    else:
        kept = "its port kept" if seen_port == str(sockname[1]) else "its port changed"
        report.add(INFO, "nat", f"this machine is {local} here and {reply.observed} to the "
                   f"master: behind NAT ({kept})")
    if reply.reachable:
        report.add(OK, "reachability", f"the master dialed this machine's p2p port "
                   f"({seen_host}:{p2p_port}): other peers can connect to it directly")
    else:
        report.add(WARN, "reachability", f"the master could not dial this machine's p2p port "
                   f"({seen_host}:{p2p_port})",
                   "pccl works anyway (its ring neighbours are dialed from here instead, or "
                   "relayed through the master when both ends are behind NAT; relays are "
                   "slow). For direct links forward a TCP port to this machine and pass "
                   "p2p_listen_port=PORT and p2p_advertise_address='PUBLIC_IP:PORT'")


async def _measure(conn: FramedConnection, report: Report, timeout: float) -> None:
    rtts, skews = [], []
    for _ in range(PINGS):
        t0 = time.time()
        async with asyncio.timeout(timeout):
            await conn.send(m.DoctorEcho(payload=b"", reply_bytes=0))
            echo = await conn.recv()
        t1 = time.time()
        if not isinstance(echo, m.DoctorEcho):
            raise ProtocolError(f"expected doctor_echo, got {echo.TYPE}")
        rtts.append(t1 - t0)
        skews.append(echo.master_time - (t0 + t1) / 2)
    rtt = statistics.median(rtts) * 1e3
    report.add(OK if rtt < 250 else WARN, "latency", f"round trip to the master {rtt:.1f} ms "
               f"(median of {PINGS})", "" if rtt < 250 else
               "every collective waits for the master at least once: a closer master helps")
    skew = statistics.median(skews) * 1e3
    report.add(OK if abs(skew) < 1000 else WARN, "clock", f"clock skew to the master "
               f"{skew:+.0f} ms (± {rtt / 2:.0f})", "" if abs(skew) < 1000 else
               "pccl does not need synchronised clocks, but log times will not line up: "
               "run NTP (systemd-timesyncd, chrony)")
    rates = []
    for up in (True, False):
        t0 = time.perf_counter()
        async with asyncio.timeout(max(timeout, 60.0)):
            await conn.send(m.DoctorEcho(payload=b"\0" * ECHO_BYTES if up else b"",
                                         reply_bytes=0 if up else ECHO_BYTES))
            echo = await conn.recv()
        elapsed = time.perf_counter() - t0 - statistics.median(rtts)
        rates.append(ECHO_BYTES / max(elapsed, 1e-6) / 1e6)
        if not isinstance(echo, m.DoctorEcho):
            raise ProtocolError(f"expected doctor_echo, got {echo.TYPE}")
    report.add(OK, "throughput", f"to the master {rates[0]:.1f} MB/s, from it "
               f"{rates[1]:.1f} MB/s ({ECHO_BYTES >> 20} MiB each way over the control "
               "connection; the ring links between peers are what reduces use)")


__all__ = ["Finding", "Report", "diagnose"]

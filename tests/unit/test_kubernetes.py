"""deploy/: the Kubernetes manifests are valid against the Kubernetes schema (strict:
unknown fields are errors), use only real pccl variables with values pccl accepts, agree
with each other and with the Dockerfile on ports, names and secrets. (The image's
stand-in peer run against a master: tests/system/test_kubernetes_image.py.)

The schemas ship inside kubernetes-validate: nothing here needs a network or a cluster.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import pccl
from pccl import config
from pccl import identity as pccl_identity

# The oldest Kubernetes the manifests are meant for (the schema they are checked against).
KUBERNETES = "1.31.0"
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
DOCKERFILE = DEPLOY / "Dockerfile"
POD_IP = "10.244.1.7"  # stands in for the downward API's status.podIP

Doc = dict[str, Any]


def load() -> list[tuple[str, Doc]]:
    out = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


DOCS = load()


def one(kind: str, name: str) -> Doc:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


def pod(workload: Doc) -> Doc:
    return workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def container(workload: Doc) -> Doc:
    containers = pod(workload)["containers"]
    assert len(containers) == 1
    return containers[0]  # type: ignore[no-any-return]


def raw_env(c: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in c.get("env", [])}


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def container_port(c: Doc, ref: int | str) -> int:
    """A port reference (a number, or a name of one of the container's ports)."""
    if isinstance(ref, int):
        assert ref in [p["containerPort"] for p in c["ports"]], ref
        return ref
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ref in ports, (ref, ports)
    return ports[ref]


def secrets() -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["stringData"] for _, d in DOCS if d["kind"] == "Secret"}


def secret_behind(workload: Doc, c: Doc, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at ``path`` in the container."""
    mounts = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, path
    volume = next(v for v in pod(workload)["volumes"] if v["name"] == mounts[0]["name"])
    assert "items" not in volume["secret"]
    return volume["secret"]["secretName"], path[len(mounts[0]["mountPath"]) + 1:]


def pccl_env(workload: Doc, tmp_path: Path) -> dict[str, str]:
    """The container's environment as pccl would see it: plain values as they are, the
    pod IP for the downward API, and secret files written out from secret.yaml."""
    c = container(workload)
    env = {}
    for name, e in raw_env(c).items():
        if "valueFrom" in e:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, name
            env[name] = POD_IP
        elif name.endswith("_FILE"):
            secret, key = secret_behind(workload, c, e["value"])
            local = tmp_path / f"{secret}-{key}"
            value = secrets()[secret][key]
            if name == "PCCL_SECRET_FILE":
                # The placeholder is refused as it stands (a deployment that forgets to
                # replace it fails at start); the run uses what an operator puts there.
                with pytest.raises(pccl.InvalidArgumentError, match="too weak"):
                    pccl_identity.check_secret(value)
                value = pccl_identity.new_secret()
            local.write_text(value)
            env[name] = str(local)
        else:
            env[name] = e["value"]
    return env


# --- the schema -------------------------------------------------------------------------


def test_the_manifests() -> None:
    assert [p.name for p in MANIFESTS] == ["master.yaml", "peers.yaml", "secret.yaml"]
    assert sorted((d["kind"], d["metadata"]["name"]) for _, d in DOCS) == [
        ("Deployment", "pccl-master"),
        ("Secret", "pccl-secret"), ("Secret", "pccl-status-token"),
        ("Service", "pccl-master"), ("Service", "pccl-peers"), ("Service", "pccl-status"),
        ("StatefulSet", "pccl-peer"),
    ]


@pytest.mark.parametrize(("file", "doc"), DOCS,
                         ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCS])
def test_valid_against_the_kubernetes_schema(file: str, doc: Doc) -> None:
    # SchemaNotFoundError (a kind or apiVersion the pinned Kubernetes lacks) fails too.
    assert kubernetes_validate.validate(doc, KUBERNETES, strict=True) == "1.31"


def test_the_validation_is_strict() -> None:
    master = copy.deepcopy(one("Deployment", "pccl-master"))
    container(master)["enviroment"] = []  # a typo: kubectl would drop it silently
    with pytest.raises(kubernetes_validate.ValidationError) as e:
        kubernetes_validate.validate(master, KUBERNETES, strict=True)
    assert e.value.message == "Additional properties are not allowed ('enviroment' was " \
                              "unexpected)"
    master = copy.deepcopy(one("Deployment", "pccl-master"))
    container(master)["ports"][0]["containerPort"] = "48148"
    with pytest.raises(kubernetes_validate.ValidationError) as e:
        kubernetes_validate.validate(master, KUBERNETES, strict=True)
    assert list(e.value.path) == ["spec", "template", "spec", "containers", 0, "ports", 0,
                                  "containerPort"]
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate({**master, "kind": "Deploymnet"}, KUBERNETES, strict=True)


# --- pccl's variables -----------------------------------------------------------------------


def test_every_environment_variable_is_a_pccl_variable() -> None:
    workloads = [d for _, d in DOCS if d["kind"] in ("Deployment", "StatefulSet", "Job")]
    assert len(workloads) == 2
    for w in workloads:
        for c in pod(w)["containers"]:
            unknown = set(raw_env(c)) - config.names()
            assert not unknown, (w["metadata"]["name"], unknown)


def test_the_master_takes_its_configuration(tmp_path: Path) -> None:
    env = pccl_env(one("Deployment", "pccl-master"), tmp_path)
    master = pccl.MasterNode.from_env(env)
    assert (master.listen, master.status_listen) == ("0.0.0.0:48148", "0.0.0.0:48180")
    assert master.secret == Path(env["PCCL_SECRET_FILE"]).read_bytes()
    assert master.status_token == secrets()["pccl-status-token"]["token"]
    assert container(one("Deployment", "pccl-master"))["command"] == ["pccl-master"]


def test_the_peers_take_their_configuration(tmp_path: Path) -> None:
    env = pccl_env(one("StatefulSet", "pccl-peer"), tmp_path)
    comm = pccl.Communicator.from_env(env)
    assert (comm.master, comm.p2p_listen_port, comm.p2p_advertise_host, comm.peer_group,
            comm.reconnect_timeout, comm.metrics_listen) == (
        "pccl-master:48148", 48149, POD_IP, 0, 600.0, "0.0.0.0:9400")
    assert comm.secret == Path(env["PCCL_SECRET_FILE"]).read_bytes()
    assert comm.metrics_token == secrets()["pccl-status-token"]["token"]


def test_no_service_link_variable_lands_in_pccl_names() -> None:
    """Kubernetes adds NAME_SERVICE_HOST, NAME_PORT, ... for every Service (a Service
    called pccl-p2p would set PCCL_P2P_PORT=tcp://...). The pods turn that off, and no
    Service name would collide anyway."""
    for _, d in DOCS:
        if d["kind"] in ("Deployment", "StatefulSet"):
            assert pod(d)["enableServiceLinks"] is False
    for _, svc in DOCS:
        if svc["kind"] != "Service":
            continue
        prefix = svc["metadata"]["name"].upper().replace("-", "_")
        links = {f"{prefix}_SERVICE_HOST", f"{prefix}_SERVICE_PORT", f"{prefix}_PORT"}
        for p in svc["spec"]["ports"]:
            base = f"{prefix}_PORT_{p['port']}_{p.get('protocol', 'TCP')}"
            links |= {base, base + "_PROTO", base + "_PORT", base + "_ADDR",
                      f"{prefix}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"}
        assert not links & config.names(), svc["metadata"]["name"]


# --- the manifests agree with each other ----------------------------------------------------------


def selects(service: Doc, workload: Doc) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def test_the_master_ports_agree() -> None:
    master = one("Deployment", "pccl-master")
    c = container(master)
    env = {k: e["value"] for k, e in raw_env(c).items()}
    listen, status = port_of(env["PCCL_MASTER_LISTEN"]), port_of(env["PCCL_STATUS_LISTEN"])
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"pccl": listen,
                                                                   "status": status}
    assert master["spec"]["selector"]["matchLabels"].items() <= \
        master["spec"]["template"]["metadata"]["labels"].items()
    for name, port in (("pccl-master", listen), ("pccl-status", status)):
        svc = one("Service", name)
        assert selects(svc, master) and not selects(svc, one("StatefulSet", "pccl-peer"))
        [p] = svc["spec"]["ports"]
        assert container_port(c, p["targetPort"]) == port == p["port"]
    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/healthz" and container_port(c, get["port"]) == status
    # One master, never two at once.
    assert master["spec"]["replicas"] == 1
    assert master["spec"]["strategy"] == {"type": "Recreate"}


def test_the_peers_find_the_master_through_its_service() -> None:
    svc = one("Service", "pccl-master")
    address = raw_env(container(one("StatefulSet", "pccl-peer")))["PCCL_MASTER"]["value"]
    host, _, port = address.rpartition(":")
    assert host == svc["metadata"]["name"] or host.startswith(svc["metadata"]["name"] + ".")
    assert int(port) == svc["spec"]["ports"][0]["port"]


def test_the_peer_ports_agree() -> None:
    peers = one("StatefulSet", "pccl-peer")
    c = container(peers)
    p2p = int(raw_env(c)["PCCL_P2P_PORT"]["value"])
    metrics = port_of(raw_env(c)["PCCL_METRICS_LISTEN"]["value"])
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"p2p": p2p,
                                                                   "metrics": metrics}
    svc = one("Service", peers["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and selects(svc, peers)
    [p] = svc["spec"]["ports"]
    assert container_port(c, p["targetPort"]) == p2p == p["port"]
    assert peers["spec"]["selector"]["matchLabels"].items() <= \
        peers["spec"]["template"]["metadata"]["labels"].items()


def test_the_secrets_are_mounted_where_the_variables_point() -> None:
    used = set()
    for _, w in DOCS:
        if w["kind"] not in ("Deployment", "StatefulSet"):
            continue
        c = container(w)
        for name, e in raw_env(c).items():
            if name.endswith("_FILE"):
                secret, key = secret_behind(w, c, e["value"])
                assert key in secrets()[secret], (name, secret, key)
                used.add(secret)
        for m in c["volumeMounts"]:
            assert m["readOnly"] is True
        for v in pod(w)["volumes"]:
            assert v["secret"]["defaultMode"] == 0o440  # readable by fsGroup only
            assert pod(w)["securityContext"]["fsGroup"] == 10001
    assert used == set(secrets())


def test_the_dockerfile_agrees_with_the_manifests() -> None:
    text = DOCKERFILE.read_text()
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.MULTILINE)
               for p in line.split()}
    ports = {p["containerPort"] for _, w in DOCS if w["kind"] in ("Deployment", "StatefulSet")
             for p in container(w)["ports"]}
    assert exposed == ports
    user = re.search(r"^USER (\d+):(\d+)$", text, re.MULTILINE)
    assert user is not None
    for _, w in DOCS:
        if w["kind"] in ("Deployment", "StatefulSet"):
            ctx = pod(w)["securityContext"]
            assert (ctx["runAsUser"], ctx["runAsGroup"]) == (int(user[1]), int(user[2]))
            assert container(w)["image"] == "pccl:0.1.0"
    assert container(one("StatefulSet", "pccl-peer"))["command"] == ["python", "/app/peer.py"]
    assert 'COPY <<"EOF" /app/peer.py' in text



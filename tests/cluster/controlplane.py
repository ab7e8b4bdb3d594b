"""A real Kubernetes control plane on loopback for tests: etcd, kube-apiserver (self-signed serving
certificate, a service-account signing key, RBAC, the default admission plugins including
PodSecurity), kube-controller-manager, kube-scheduler, kwok simulating the kubelets of fake
nodes, and the LeaderWorkerSet controller (`start_lws()`, once its CRD is in). Built by
scripts/install-kube.sh (`make kube`); paths come from .tools/kube.json.

Every process gets its own free ports and a work folder; readiness is polled (`/readyz`,
`/healthz`, a node turning Ready), never slept for; `stop()` kills the whole process group of
each and waits for it, so nothing is left behind.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / ".tools" / "kube.json"
STAGES = Path(__file__).resolve().parent / "kwok-stages.yaml"
START_SECONDS = 120  # a deadline for a broken start, not a timing assertion
REQUEST_TIMEOUT = "60s"  # every kubectl call
HOLD = "pd-inference.test/held-terminating"  # the finalizer delete_pod_held holds a pod with


def manifest() -> dict[str, Any]:
    if not MANIFEST.exists():
        raise RuntimeError(f"the control plane is not built ({MANIFEST} missing): run `make kube` (or `make test`)")
    return json.loads(MANIFEST.read_text())


def versions() -> list[str]:
    return list(manifest()["kubernetes"])


def lws() -> dict[str, str]:
    """The LeaderWorkerSet build: version, bin, config (upstream's config/ files it needs)."""
    if "lws" not in manifest():
        raise RuntimeError(f"{MANIFEST} predates the LeaderWorkerSet controller: run `make kube` (builds only it)")
    return dict(manifest()["lws"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(20)


@dataclass
class ControlPlane:
    version: str
    workdir: Path
    procs: list[Process] = field(default_factory=list)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    lws_token: str = field(default_factory=lambda: secrets.token_hex(16))
    apiserver_port: int = 0

    @property
    def bin(self) -> Path:
        return Path(manifest()["kubernetes"][self.version])

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> ControlPlane:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        w = self.workdir
        w.mkdir(parents=True, exist_ok=True)
        etcd_port, etcd_peer = free_port(), free_port()
        self.apiserver_port = free_port()
        subprocess.run(
            ["openssl", "genrsa", "-out", str(w / "sa.key"), "2048"], check=True, capture_output=True, timeout=60
        )
        # The LWS controller gets its own user, bound to upstream's ClusterRole (start_lws): it
        # runs with the permissions it has in a real cluster, not as an admin.
        (w / "tokens.csv").write_text(
            f"{self.token},pd-admin,pd-admin,system:masters\n{self.lws_token},lws-controller,lws-controller\n"
        )
        self.kubeconfig.write_text(yaml.safe_dump(self._kubeconfig("pd-admin", self.token)))
        self._spawn(
            "etcd",
            [
                manifest()["etcd"],
                f"--data-dir={w / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync",  # a throwaway test store
            ],
        )
        self._wait(f"http://127.0.0.1:{etcd_port}/health", "etcd", tls=False)
        self._spawn(
            "kube-apiserver",
            [
                str(self.bin / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # The lease reconciler refuses a loopback address; nothing here needs the
                # `kubernetes` Service's endpoints.
                "--endpoint-reconciler-type=none",
                f"--secure-port={self.apiserver_port}",
                f"--cert-dir={w / 'certs'}",  # a self-signed serving certificate for 127.0.0.1
                f"--token-auth-file={w / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={w / 'sa.key'}",
                f"--service-account-signing-key-file={w / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/16",
                # efa.privileged is an opt-in the chart supports; admission (Pod Security) decides.
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                # It taints every new node not-ready until the node-lifecycle controller (off here:
                # kwok sends no heartbeats) clears it; the fake nodes are Ready from the start.
                "--disable-admission-plugins=TaintNodesByCondition",
            ],
        )
        self._wait(f"{self.server}/readyz", "kube-apiserver")
        # apiserver.crt holds the serving certificate, then the self-signed CA that issued it.
        pem = (w / "certs" / "apiserver.crt").read_text()
        blocks = [b + "-----END CERTIFICATE-----\n" for b in pem.split("-----END CERTIFICATE-----") if "BEGIN" in b]
        (w / "ca.crt").write_text(blocks[-1].lstrip())
        for name, extra in (
            (
                "kube-controller-manager",
                [
                    f"--service-account-private-key-file={w / 'sa.key'}",
                    f"--root-ca-file={w / 'ca.crt'}",
                    "--controllers=*,-node-ipam-controller,-node-lifecycle-controller",
                ],
            ),
            ("kube-scheduler", []),
        ):
            port = free_port()
            self._spawn(
                name,
                [
                    str(self.bin / name),
                    f"--kubeconfig={self.kubeconfig}",
                    f"--authentication-kubeconfig={self.kubeconfig}",
                    f"--authorization-kubeconfig={self.kubeconfig}",
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={port}",
                    f"--cert-dir={w / name}",
                    *extra,
                ],
            )
            self._wait(f"https://127.0.0.1:{port}/healthz", name, auth=False)
        self._spawn(
            "kwok",
            [
                manifest()["kwok"],
                f"--kubeconfig={self.kubeconfig}",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                f"--config={STAGES}",
                "--cidr=10.244.0.0/16",
                "--node-ip=127.0.0.1",
                f"--server-address=127.0.0.1:{free_port()}",
                "-v=DEBUG",
            ],
        )

    def start_lws(self) -> None:
        """The LeaderWorkerSet controller (kubernetes-sigs/lws) as upstream installs it, on loopback:
        upstream's ClusterRole bound to its own user, its webhooks served on a free port with a
        self-signed certificate for 127.0.0.1 and registered by URL. The webhooks are not optional:
        the reconciler relies on the LeaderWorkerSet defaults they set, and the pod webhook adds the
        group's labels and LWS_LEADER_ADDRESS. Its pod webhooks select only pods labelled
        leaderworkerset.sigs.k8s.io/name, so no other pod meets them. Call once the CRDs of ci/crds/
        (its LeaderWorkerSet) are Established; it installs its DisaggregatedSet CRD itself."""
        w, build = self.workdir / "lws", lws()
        config = Path(build["config"])
        w.mkdir(exist_ok=True)
        self.kubectl("apply", "--server-side", "--field-manager=pd-tests", "-f", str(config / "crd/bases"))
        self.wait_for_condition("crd", "Established")
        role = yaml.safe_load((config / "rbac/role.yaml").read_text())
        role["metadata"]["name"] = "lws-manager-role"  # upstream's kustomize namePrefix
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "lws-manager-rolebinding"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "lws-manager-role"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "lws-controller"}],
        }
        self.apply([role, binding])
        (w / "kubeconfig").write_text(yaml.safe_dump(self._kubeconfig("lws-controller", self.lws_token)))
        # One self-signed certificate for 127.0.0.1 is both the serving certificate and the CA
        # bundle the API server trusts for the webhook calls.
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
            + ["-keyout", str(w / "tls.key"), "-out", str(w / "tls.crt"), "-days", "7", "-subj", "/CN=lws-webhook"]
            + ["-addext", "subjectAltName=IP:127.0.0.1"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        webhook_port, health_port = free_port(), free_port()
        settings = {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},  # it would rotate certificates into a Secret
            "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(w)},
            "metrics": {"bindAddress": "0"},  # off: nothing scrapes it
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        }
        (w / "config.yaml").write_text(yaml.safe_dump(settings))
        self._spawn("lws", [build["bin"], f"--config={w / 'config.yaml'}", f"--kubeconfig={w / 'kubeconfig'}"])
        self._wait(f"http://127.0.0.1:{health_port}/readyz", "lws", tls=False)
        self.apply(self._lws_webhooks(config, f"https://127.0.0.1:{webhook_port}", (w / "tls.crt").read_bytes()))
        self._wait_lws_webhooks()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ clients
    def env(self) -> dict[str, str]:
        """Environment for kubectl and helm: this cluster only, no user config."""
        home = self.workdir / "home"
        home.mkdir(exist_ok=True)
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "KUBECONFIG": str(self.kubeconfig),
            "HELM_CACHE_HOME": str(home / "helm-cache"),
            "HELM_CONFIG_HOME": str(home / "helm-config"),
            "HELM_DATA_HOME": str(home / "helm-data"),
        }

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.bin / "kubectl"), f"--request-timeout={REQUEST_TIMEOUT}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=300,
            env=self.env(),
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def run(self, *args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """Any client (helm, kubectl) against this cluster; the caller checks the result."""
        return subprocess.run(
            [str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=self.env(), cwd=ROOT
        )

    def create_namespace(self, doc: dict[str, Any]) -> None:
        """Apply a test's namespace (fleet.namespace) once any earlier one of its name is gone
        (:meth:`drop_namespace` does not wait for it)."""
        name = doc["metadata"]["name"]
        # returns at once where there is none (kubectl's wait ignores NotFound for --for=delete)
        self.kubectl("wait", "--for=delete", f"namespace/{name}", "--timeout=120s")
        self.apply([doc])

    def drop_namespace(self, name: str) -> None:
        """Delete a test's namespace, its pods at once and the rest without waiting: the
        namespace controller waits 5 s before it even starts on a deleted namespace
        (namespaceDeletionGracePeriod, pkg/controller/namespace/namespace_controller.go), which
        cost each cluster test 5-12 s of teardown. The namespace first (terminating, it takes no
        new pod: a controller cannot recreate one), then its pods at once (`--grace-period=0
        --force`), so the shared fleet's capacity is free for the next test;
        :meth:`create_namespace` waits for a namespace of the same name."""
        self.kubectl("delete", "namespace", name, "--wait=false")
        self.kubectl("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", check=False)

    def apply(
        self, docs: list[dict[str, Any]] | str, *args: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Server-side apply with strict field validation."""
        text = docs if isinstance(docs, str) else yaml.safe_dump_all(docs)
        return self.kubectl(
            "apply",
            "--server-side",
            "--field-manager=pd-tests",
            "--validate=strict",
            "-f",
            "-",
            *args,
            input=text,
            check=check,
        )

    def get(self, kind: str, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", kind, "-o", "json", *args).stdout)

    def wait_for_condition(self, kind: str, condition: str, *args: str) -> None:
        """Every object of `kind` (in `args`' scope) has `condition` True. Polls: `kubectl wait`
        fails at once on an object whose status has no conditions yet."""

        def all_true() -> bool:
            items = self.get(kind, *args)["items"]
            return bool(items) and all(
                any(
                    c["type"] == condition and c["status"] == "True"
                    for c in ((i.get("status") or {}).get("conditions") or [])
                )
                for i in items
            )

        self.wait_until(f"every {kind} {condition}", all_true)

    def wait_until(self, what: str, cond: Any, deadline_s: float = START_SECONDS) -> Any:
        """Poll `cond()` until it returns something truthy (the deadline only stops a broken test)."""
        end = time.monotonic() + deadline_s
        while True:
            got = cond()
            if got:
                return got
            if time.monotonic() > end:
                raise AssertionError(f"never happened: {what}")
            time.sleep(0.2)

    def pod_going(self, ns: str, name: str, uid: str) -> bool:
        """The pod `name` that had `uid` is being deleted, or gone (a new one may have its name)."""
        pods = self.get("pods", "-n", ns, "--field-selector", f"metadata.name={name}")["items"]
        return not pods or pods[0]["metadata"]["uid"] != uid or "deletionTimestamp" in pods[0]["metadata"]

    def delete_pod_held(self, ns: str, name: str, until: str, cond: Any) -> Any:
        """Delete a pod and keep it Terminating until `cond()` holds, as a kubelet does for the
        pod's grace period; kwok's stage deletes it at once. Controllers that react to a pod's
        deletionTimestamp (LWS's group restart reads it from its cache: lws v0.9.0
        pod_controller.go, handleRestartPolicy) see it for as long as they need, however loaded
        the machine; without the hold the pod could be gone from the cache before the reconcile
        ran, and the controller would never learn it was deleted (a CI run saw exactly that).
        Releasing it clears the pod's finalizers: a kwok pod has none but this one."""
        self.kubectl(
            "patch", "pod", name, "-n", ns, "--type=merge", "-p", json.dumps({"metadata": {"finalizers": [HOLD]}})
        )
        self.kubectl("delete", "pod", name, "-n", ns, "--wait=false")
        try:
            return self.wait_until(until, cond)
        finally:
            self.kubectl("patch", "pod", name, "-n", ns, "--type=merge", "-p", '{"metadata": {"finalizers": null}}')

    def diagnose(self, ns: str) -> str:
        """What a failed install or upgrade in `ns` left behind, for its assertion message: each
        pod's phase, node, deletion and unmet conditions, each StatefulSet's status, the last
        events, and what the scheduler's and kwok's logs last said about it (a `--wait` that times out says
        only "not ready")."""
        lines = [f"--- what namespace {ns} holds:"]
        pods = json.loads(self.kubectl("get", "pods", "-n", ns, "-o", "json", check=False).stdout or '{"items": []}')
        for p in pods["items"]:
            st = p.get("status") or {}
            unmet = [
                f"{c['type']}={c['status']}({c.get('reason', '')}: {c.get('message', '')})"
                for c in st.get("conditions") or []
                if c["status"] != "True"
            ]
            deleting = p["metadata"].get("deletionTimestamp")
            lines.append(
                f"pod {p['metadata']['name']}: phase={st.get('phase')} node={p['spec'].get('nodeName')}"
                f"{' deleting since ' + deleting if deleting else ''} {' '.join(unmet)}"
            )
        sts = self.kubectl("get", "statefulsets", "-n", ns, "-o", "json", check=False).stdout or '{"items": []}'
        for s in json.loads(sts)["items"]:
            lines.append(f"statefulset {s['metadata']['name']}: {json.dumps(s.get('status'))}")
        events = self.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False)
        lines += ["--- events:", *events.stdout.splitlines()[-30:]]
        for proc in self.procs:
            if proc.name in ("kube-scheduler", "kwok", "lws") and proc.log.exists():
                mine = [ln for ln in proc.log.read_text(errors="replace").splitlines() if ns in ln]
                lines += [f"--- {proc.name}'s last lines naming {ns}:", *(ln[:400] for ln in mine[-15:])]
        return "\n".join(lines)

    # ------------------------------------------------------------------ internals
    def _kubeconfig(self, user: str, token: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "pd", "cluster": {"server": self.server, "insecure-skip-tls-verify": True}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "pd", "context": {"cluster": "pd", "user": user}}],
            "current-context": "pd",
        }

    @staticmethod
    def _lws_webhooks(config: Path, url: str, ca: bytes) -> list[dict[str, Any]]:
        """Upstream's webhook configurations as its kustomization builds them (manifests.yaml with
        the patches that give the pod webhooks their objectSelector, names prefixed `lws-`), each
        service reference replaced by this controller's URL and CA bundle."""
        docs = [d for d in yaml.safe_load_all((config / "webhook/manifests.yaml").read_text()) if d]
        patches = {
            "MutatingWebhookConfiguration": "mutating-patch.yaml",
            "ValidatingWebhookConfiguration": "validating-patch.yaml",
        }
        for doc in docs:
            for op in yaml.safe_load((config / "webhook" / patches[doc["kind"]]).read_text()):
                assert op["op"] == "replace" and op["path"].startswith("/webhooks/"), op
                doc["webhooks"][int(op["path"].rpartition("/")[2])] = op["value"]
            doc["metadata"]["name"] = "lws-" + doc["metadata"]["name"]
            for hook in doc["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": url + path, "caBundle": base64.b64encode(ca).decode()}
        return docs

    def _wait_lws_webhooks(self) -> None:
        """Until the API server calls the webhooks: a LeaderWorkerSet created in a dry run comes
        back with the defaults only the mutating webhook sets, and a name only the validating
        webhook refuses (not a DNS-1035 label) is refused. Before that, a LeaderWorkerSet would be
        stored without its defaults."""
        proc = self.procs[-1]

        def probe(name: str) -> subprocess.CompletedProcess[str]:
            obj = {
                "apiVersion": "leaderworkerset.x-k8s.io/v1",
                "kind": "LeaderWorkerSet",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {
                    "leaderWorkerTemplate": {"workerTemplate": {"spec": {"containers": [{"name": "c", "image": "c"}]}}}
                },
            }
            return self.kubectl(
                "create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(obj), check=False
            )

        def effective() -> bool:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"lws exited with {proc.popen.returncode}:\n{proc.tail()}")
            good = probe("webhook-probe")
            defaulted = good.returncode == 0 and "networkConfig" in json.loads(good.stdout)["spec"]
            return defaulted and "vleaderworkerset.kb.io" in probe("0-webhook-probe").stderr

        try:
            self.wait_until("the API server calling the LWS webhooks", effective)
        except AssertionError as e:
            raise RuntimeError(f"{e}:\n{proc.tail()}") from None

    def _spawn(self, name: str, args: list[str]) -> None:
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.procs.append(Process(name, popen, log))

    def _wait(self, url: str, name: str, tls: bool = True, auth: bool = True) -> None:
        proc = self.procs[-1]
        ctx = ssl._create_unverified_context() if tls else None  # the self-signed test certificate
        headers = {"Authorization": f"Bearer {self.token}"} if auth and tls else {}
        end = time.monotonic() + START_SECONDS
        while True:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.popen.returncode}:\n{proc.tail()}")
            try:
                req = urllib.request.Request(url, headers=headers)
                with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"{name} not ready at {url} within {START_SECONDS} s:\n{proc.tail()}")
            time.sleep(0.1)

"""A live stack on loopback built from what an environment renders: the router from the chart's
own router.yaml (pools, auth and limits pointed at loopback by PD_ROUTER__* overrides, the way
`make demo` does), simulated vLLM engines exporting vLLM's metrics, and a real Prometheus scraping
them through the scrape configs the Prometheus Operator would generate from the chart's monitors,
with the chart's PrometheusRule loaded. Then traffic that produces every event the chart's
queries select: short and long prompts, fallbacks, a rejection, and for LMCache a notification
timeout."""

from __future__ import annotations

import json
import secrets
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import yaml
from pd_router_dev.devstack import Stack, free_port

from tests import helm
from tests.observability import scrape
from tests.observability.prom import Prometheus

LONG = "Disaggregated serving splits the prefill of a long prompt from the decode of its answer. " * 120
ROLES = ("prefill", "decode")


def _post(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


class LiveStack:
    def __init__(self, name: str, docs: list[dict[str, Any]], workdir: Path) -> None:
        self.name = name
        self.docs = docs
        self.workdir = workdir
        self.stack = Stack(workdir)
        self.prometheus: Prometheus | None = None
        cm = helm.one(docs, "ConfigMap", "-router")
        self.router_config = yaml.safe_load(cm["data"]["router.yaml"])
        self.connector = self.router_config["routing"]["connector"]
        self.model = self.router_config["model"]["servedName"]
        self.namespace = cm["metadata"]["namespace"]
        self.release = cm["metadata"]["labels"]["app.kubernetes.io/instance"]
        self.secrets: dict[str, dict[str, str]] = {}
        self.api_key = ""
        self.metrics_token = ""

    # --- processes -------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.router_config
        env = {
            "PD_ROUTER__LISTEN__HOST": "127.0.0.1",
            "PD_ROUTER__LISTEN__PORT": "0",
            "PD_ROUTER__MODEL__TOKENIZERHUB__REPO": '""',  # no hub here: count with the engine
            "PD_ROUTER__HEALTH__INTERVALSECONDS": "1",
            # two slots and no queue, so one stalled pair of streams makes a deterministic 429
            "PD_ROUTER__LIMITS__MAXINFLIGHT": "2",
            "PD_ROUTER__LIMITS__MAXQUEUED": "0",
            "PD_ROUTER__LMCACHE__NOTIFYTIMEOUTSECONDS": "1",
        }
        auth = cfg["auth"]
        if auth["apiKeysFile"]:  # the Secrets the chart mounts, as files on loopback
            self.api_key = secrets.token_urlsafe(16)
            env["PD_ROUTER__AUTH__APIKEYSFILE"] = str(self._secret_file("api-keys", self.api_key + "\n"))
        if auth["metricsTokensFile"]:
            dep = helm.one(self.docs, "Deployment", "-router")
            vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "metrics-token")
            self.metrics_token = secrets.token_urlsafe(16)
            # A Secret created with --from-literal: no trailing newline (the operator sends it untrimmed)
            self.secrets[vol["secret"]["secretName"]] = {vol["secret"]["items"][0]["key"]: self.metrics_token}
            env["PD_ROUTER__AUTH__METRICSTOKENSFILE"] = str(self._secret_file("metrics-token", self.metrics_token))
        self.engines = self.start_engines(env)
        # the chart's metrics-only proxy next to each engine (engine.metricsProxy)
        self.proxies = {r: self.stack.metrics_proxy(f"{self.name}-{r}-metrics", self.engines[r].port) for r in ROLES}
        for r in ROLES:
            env[f"PD_ROUTER__POOLS__{r.upper()}__DISCOVERY"] = "static"
            env[f"PD_ROUTER__POOLS__{r.upper()}__STATIC"] = f"[{self.engine_url(r)}]"
        config = self.workdir / "router.yaml"
        config.write_text(yaml.safe_dump(cfg))
        self.router = self.stack.router(f"{self.name}-router", config, env)

    def start_engines(self, env: dict[str, str]) -> dict[str, Any]:
        """One simulated engine per role (the real-engine tier brings real ones instead)."""
        timing = ["--decode-step-ms", "2", "--vllm-version", "0.33", "--model", self.model]
        if self.connector == "lmcache":
            notify, init, alloc = free_port(), free_port(), free_port()
            env["PD_ROUTER__LMCACHE__NOTIFYPORT"] = str(notify)
            env["PD_ROUTER__LMCACHE__DECODERINITPORTS"] = f"[{init}]"
            env["PD_ROUTER__LMCACHE__DECODERALLOCPORTS"] = f"[{alloc}]"
            args = {
                "prefill": ["--kv-connector", "lmcache", "--lmcache-role", "sender", "--pd-proxy-port", str(notify)],
                "decode": ["--kv-connector", "lmcache", "--lmcache-role", "receiver",
                           "--pd-peer-init-port", str(init), "--pd-peer-alloc-port", str(alloc)],
            }  # fmt: skip
        else:
            args = {r: ["--kv-connector", "nixl"] for r in ROLES}
        return {r: self.stack.sim(f"{self.name}-{r}", *args[r], *timing) for r in ROLES}

    def engine_url(self, role: str) -> str:
        return self.engines[role].url()

    def _secret_file(self, name: str, content: str) -> Path:
        path = self.workdir / name
        path.write_text(content)
        return path

    def stop(self) -> None:
        if self.prometheus:
            self.prometheus.stop()
        self.stack.stop()

    # --- what Kubernetes SD would find --------------------------------------------------------

    def engine_targets(self) -> list[scrape.Target]:
        out = []
        for role, proc in self.engines.items():
            sts = helm.one(self.docs, "StatefulSet", f"-{role}")
            tmpl = sts["spec"]["template"]
            for c in tmpl["spec"]["containers"]:
                # the process behind the container: the metrics proxy, or the engine itself
                port_of = self.proxies[role].port if c["name"] == "metrics-proxy" else proc.port
                for port in c.get("ports", []):  # one target per named container port, as role: pod
                    out.append(scrape.Target(
                        address=f"127.0.0.1:{port_of}", namespace=self.namespace,
                        pod=f"{sts['metadata']['name']}-0", container=c["name"], port_name=port["name"],
                        pod_labels=tmpl["metadata"]["labels"],
                    ))  # fmt: skip
        return out

    def router_targets(self) -> list[scrape.Target]:
        svc = helm.one(self.docs, "Service", "-router")
        dep = helm.one(self.docs, "Deployment", "-router")
        tmpl = dep["spec"]["template"]
        return [
            scrape.Target(
                address=f"127.0.0.1:{self.router.port}", namespace=self.namespace,
                pod=f"{dep['metadata']['name']}-6d4f9c7b8-x2x9q", container=tmpl["spec"]["containers"][0]["name"],
                port_name=p["name"], pod_labels=tmpl["metadata"]["labels"],
                service=svc["metadata"]["name"], service_labels=svc["metadata"]["labels"],
            )
            for p in svc["spec"]["ports"]
        ]  # fmt: skip

    def start_prometheus(self, rule_files: list[Path]) -> Prometheus:
        configs = scrape.pod_monitor(helm.one(self.docs, "PodMonitor"), self.engine_targets())
        sm = helm.one(self.docs, "ServiceMonitor")
        configs += scrape.service_monitor(sm, self.router_targets(), self.secrets)
        if self.metrics_token:  # the negative control: the same monitor without its credentials
            configs += scrape.service_monitor(sm, self.router_targets(), self.secrets, drop_auth=True)
        self.prometheus = Prometheus(self.workdir, configs, rule_files)
        return self.prometheus

    # --- traffic ---------------------------------------------------------------------------------

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.router.url() + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=60
        )

    def _ask(self, content: str, stream: bool = False) -> str:
        c = self.client()
        msgs = [{"role": "user", "content": content}]
        if stream:
            with c.chat.completions.with_streaming_response.create(
                model=self.model, messages=msgs, max_tokens=8, stream=True
            ) as r:
                route = r.headers.get("x-pd-route", "")
                self.last_reason = r.headers.get("x-pd-reason", "")
                for _ in r.parse():
                    pass
                return route
        raw = c.chat.completions.with_raw_response.create(model=self.model, messages=msgs, max_tokens=8)
        self.last_reason = raw.headers.get("x-pd-reason", "")
        return raw.headers.get("x-pd-route", "")

    def _router_gauge(self, name: str) -> float:
        headers = {"Authorization": f"Bearer {self.metrics_token}"} if self.metrics_token else {}
        req = urllib.request.Request(self.router.url() + "/metrics", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0

    def drive(self) -> dict[str, int]:
        routes: dict[str, int] = {}
        for i in range(4):
            # each long prompt new from its first block on: none is a prefix-cache hit
            for content in ("What is disaggregated serving?", f"({i}) " + LONG):
                route = self._ask(content, stream=bool(i % 2))
                routes[route] = routes.get(route, 0) + 1
        # two fallbacks among six long prompts: the prefiller fails (with LMCache: once, and once
        # its notification never comes)
        faults = ["error", "no_notify"] if self.connector == "lmcache" else ["error", "error"]
        for n, fault in enumerate(faults):
            _post(self.engines["prefill"].url() + "/sim/fault", {"mode": fault, "count": 1})
            route = self._ask(f"({fault} {n}) " + LONG)
            assert route == "fallback", (fault, route, self.last_reason)
            routes["fallback"] = routes.get("fallback", 0) + 1
        # a rejection: two streams held by the decoder fill maxInFlight=2, the third gets 429
        _post(self.engines["decode"].url() + "/sim/fault", {"mode": "stall"})
        held = [threading.Thread(target=self._ask, args=("hold",), kwargs={"stream": True}) for _ in range(2)]
        for t in held:
            t.start()
        assert self.prometheus is not None
        self.prometheus.wait_for(lambda: self._router_gauge("pd_router_in_flight") >= 2, "2 requests in flight", 30)
        try:
            self._ask("rejected")
            raise AssertionError("the third request was not rejected")
        except openai.RateLimitError:
            pass
        _post(self.engines["decode"].url() + "/sim/release", {})
        for t in held:
            t.join(30)
        return routes


@contextmanager
def live_stack(name: str, docs: list[dict[str, Any]], workdir: Path, rule_files: list[Path]) -> Iterator[LiveStack]:
    s = LiveStack(name, docs, workdir)
    try:
        s.start()
        p = s.start_prometheus(rule_files)

        # traffic only once every target has a first sample, so its increases are seen as such
        def scraped_once() -> bool:
            targets = p.targets()  # empty until discovery has run
            return bool(targets) and all(t["health"] != "unknown" for t in targets)

        p.wait_for(scraped_once, "scraped every target once", 30)
        s.routes = s.drive()  # type: ignore[attr-defined]
        yield s
    finally:
        s.stop()

"""Test shim, loaded only by processes a test starts with this folder on PYTHONPATH: the names a
hosts file ($PD_TEST_HOSTS, "<ip> <name>" lines) lists resolve to its addresses, read afresh at
every lookup, as a headless Service's DNS answer changes when a pod turns not ready. A name
under ``.test`` or ``.cluster.local`` (names no resolver here knows) that the file does not list
fails as NXDOMAIN does (``EAI_NONAME``): CoreDNS's answer for a headless Service with no ready
endpoints (the Kubernetes DNS spec since kubernetes/dns PR 245). Every other name resolves as
usual. (A test cannot give one process its own DNS server otherwise.)"""

import os
import socket

_PATH = os.environ.get("PD_TEST_HOSTS")
_OURS = (".test", ".cluster.local")

if _PATH:
    _system = socket.getaddrinfo

    def _table() -> dict[str, list[str]]:
        table: dict[str, list[str]] = {}
        try:
            with open(_PATH) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 2 and not parts[0].startswith("#"):
                        table.setdefault(parts[1], []).append(parts[0])
        except OSError:
            pass
        return table

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        ips = _table().get(host) if isinstance(host, str) else None
        if ips is None:
            if isinstance(host, str) and host.rstrip(".").endswith(_OURS):
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return _system(host, port, family, type, proto, flags)
        return [
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, int(port)))
            for ip in ips
        ]

    socket.getaddrinfo = getaddrinfo

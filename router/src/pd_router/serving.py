"""What every serving loop of the router's processes shares, whichever HTTP server it runs
(the router's own ``http1``, aiohttp's for the sidecar and the metrics proxy): telling the
starter the bound port, and waiting for SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal


def write_port_file(path: str | None, port: int) -> None:
    """Tell whoever started this process the bound port: written atomically once listening
    (``--port-file``; the development stack waits for it)."""
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, path)


async def until_stopped() -> None:
    """Return at the first SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()

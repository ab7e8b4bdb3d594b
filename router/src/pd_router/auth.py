"""API-key authentication: Bearer keys from a mounted Secret file and/or PD_ROUTER_API_KEYS."""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from pathlib import Path

from pd_router.config import ConfigError

ENV_KEYS = "PD_ROUTER_API_KEYS"


class ApiKeys:
    """Holds the accepted keys; ``check`` compares in constant time against every key."""

    def __init__(
        self,
        keys_file: str = "",
        env: Mapping[str, str] | None = None,
        field: str = "auth.apiKeysFile",
        env_var: str = ENV_KEYS,
    ) -> None:
        self.keys_file = keys_file
        self.env = os.environ if env is None else env
        self.env_var = env_var
        self._mtime: float | None = None
        self._keys: list[bytes] = []
        try:
            self.reload()
        except (OSError, UnicodeDecodeError) as exc:
            msg = f"{field}: cannot read {keys_file!r}: {exc}"
            raise ConfigError(msg) from None

    def _read(self) -> list[str]:
        keys: list[str] = []
        if self.keys_file:
            text = Path(self.keys_file).read_text(encoding="utf-8")
            keys += [ln.strip() for ln in text.splitlines()]
        if self.env_var:
            keys += [k.strip() for k in self.env.get(self.env_var, "").split(",")]
        return [k for k in keys if k and not k.startswith("#")]

    def reload(self) -> None:
        """(Re)read the keys; the file is optional at runtime only if it was never readable."""
        self._keys = [k.encode() for k in self._read()]
        if self.keys_file:
            self._mtime = Path(self.keys_file).stat().st_mtime

    def maybe_reload(self) -> None:
        """Pick up a rotated Secret (kubelet swaps the file); keep old keys on read errors."""
        if not self.keys_file:
            return
        try:
            mtime = Path(self.keys_file).stat().st_mtime
            if mtime != self._mtime:
                self.reload()
        except OSError:
            pass

    def first(self) -> str | None:
        """The first key (what this router sends the routers it fronts: pd_router.remotes)."""
        return self._keys[0].decode("utf-8", "surrogateescape") if self._keys else None

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> bool:
        """True when the header carries one of the keys, or when there are no keys at all."""
        if not self._keys:
            return True
        return self.matches(authorization)

    def matches(self, authorization: str | None) -> bool:
        """True only when the header carries one of the keys (False when there are none)."""
        if not authorization or not authorization.startswith("Bearer "):
            return False
        # header bytes that are not UTF-8 arrive as surrogate escapes: compare them as bytes
        given = authorization[7:].strip().encode("utf-8", "surrogateescape")
        ok = False
        for key in self._keys:  # no early exit: time does not depend on which key matched
            ok |= hmac.compare_digest(given, key)
        return ok

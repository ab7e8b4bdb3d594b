"""KV-compatibility revisions: which prefiller may hand its KV to which decoder.

The chart computes one revision per release from everything that makes one engine's KV usable
by another (model and its revision, dtype and KV-cache dtype, block size, connector and its KV
layout, engine image: templates/_helpers.tpl ``pd-inference.kvRevision``) and has every engine
serve the model under a second name that carries it, ``<servedName>@kv-<revision>`` (vLLM
``--served-model-name`` takes several; every one is accepted and listed in ``/v1/models``, the
first is what answers carry: serve/engine/serving.py ``_check_model`` and models/serving.py,
0.31.0 and 0.33.0).

Decision, written down: the router learns an endpoint's revision from that ``/v1/models``
answer, once each time the endpoint comes up healthy (discovery), because the router discovers
pods by headless-Service DNS and has no Kubernetes API access to read their labels. It then
pairs a prefiller only with a decoder of the same revision, and sends both legs of a hand-off
to the revision's own name: an engine that is not of that revision (restarted on other bits
since the router last asked) answers vLLM's 404 ``model ... does not exist`` instead of
computing with foreign KV, and the router serves the client's request directly (fallback
``no_revision_pair``) and asks the engine anew. NIXL's own handshake hash covers the
``--model`` string, not ``--revision`` (``compute_nixl_compatibility_hash``, 0.31.0-0.33.0): a
model path that names its revision or digest makes vLLM refuse such a pair too (docs/operating.md).

An engine that serves no such name (not deployed by this chart: the simulator, a hand-started
vLLM) has the revision ``""``: it pairs with others that have none, as before revisions
existed. ``None`` means not known yet: it pairs with nothing.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

SEPARATOR = "@kv-"
_REVISION = re.compile(r"[0-9a-f]{8,64}")
NONE = ""  # an engine that serves no revision name


def alias(served: str, revision: str) -> str:
    """The name a revision's engines also serve the model under."""
    return f"{served}{SEPARATOR}{revision}"


def from_models(answer: Any, served: str) -> str:
    """The revision an engine's ``/v1/models`` answer names for ``served`` (``NONE`` when it
    names none). Raises ValueError for an answer that is not a model list, or that names two."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise ValueError("not a model list")
    prefix = served + SEPARATOR
    found = {
        c["id"][len(prefix) :]
        for c in data
        if isinstance(c, dict) and isinstance(c.get("id"), str) and c["id"].startswith(prefix)
    }
    found = {r for r in found if _REVISION.fullmatch(r)}
    if len(found) > 1:
        raise ValueError(f"names {len(found)} revisions of {served!r}: {sorted(found)}")
    return found.pop() if found else NONE


def of_alias(name: str, served: str) -> str | None:
    """The revision ``name`` is the served model's name of (``alias``), or None."""
    prefix = served + SEPARATOR
    if not name.startswith(prefix):
        return None
    rev = name[len(prefix) :]
    return rev if _REVISION.fullmatch(rev) else None


def pairs(prefill: str | None, decode: str | None) -> bool:
    """Whether a prefiller of revision ``prefill`` may hand KV to a decoder of ``decode``."""
    return prefill is not None and prefill == decode


def leg_model(body: dict[str, Any], served: str, revision: str | None) -> dict[str, Any]:
    """``body`` for a hand-off leg to an engine of ``revision``: the model named by its
    revision's own name, so that an engine of another revision refuses it (the client's own
    name otherwise: a LoRA adapter or another name the router does not rewrite)."""
    if not revision or body.get("model", served) != served:
        return body
    return {**body, "model": alias(served, revision)}


def is_refusal(status: int, sent: dict[str, Any], served: str) -> bool:
    """Whether an engine's ``status`` for ``sent`` is vLLM refusing the revision's name."""
    model = sent.get("model")
    return status == 404 and isinstance(model, str) and model.startswith(served + SEPARATOR)


UNKNOWN = "unknown"  # how a revision not read yet shows in metrics and /v1/models


def census(endpoints: Iterable[Any]) -> dict[str, int]:
    """Endpoints by revision (``UNKNOWN`` for those not read yet)."""
    return dict(Counter(UNKNOWN if e.revision is None else e.revision for e in endpoints))

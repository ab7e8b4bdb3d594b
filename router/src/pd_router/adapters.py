"""LoRA adapters: which ``model`` names the router serves, and which engines may take a request
for an adapter.

The engines serve the adapters the chart lists (``model.lora.adapters``, vLLM's static
``--lora-modules``), each named with the served model as its base, so that vLLM's
``/v1/models`` lists an adapter's card with ``parent`` = the served name (vLLM 0.31.0
``entrypoints/openai/models/serving.py``: ``parent`` is ``base_model_name`` when it names a
served model, else the first served name). The router reads that list from each engine when it
admits it, as it reads the engine's KV revision (pd_router.discovery), and sends a request for
an adapter only to engines that list it: both legs of a hand-off must hold the adapter, since
vLLM hashes an adapter's KV blocks with its name and path (``v1/core/kv_cache_utils.py``
``_gen_lora_extra_hash_keys``) and NixlConnector never looks at the adapter (a decode leg under
another model's name answers 200 with wrong tokens and keeps the foreign blocks in its prefix
cache: measured on vLLM 0.31.0's CPU build, docs/lora.md). A decoder that lists the adapter but
no prefiller that does: the request is served whole (fallback ``no_adapter_pair``). None that
lists it: 503.

Names the router accepts in ``model``: the served name, a configured adapter, or one of the
served name's KV revisions (``<servedName>@kv-<revision>``, pd_router.revision), which pins the
request to that revision's engines. Anything else is vLLM's 404 (the name quoted bounded). The
``model`` metric label takes only the served name and the configured adapters: a revision's
name counts as the served name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_router import revision

if TYPE_CHECKING:  # discovery reads the engines' lists with :func:`listed`
    from pd_router.discovery import Endpoint


@dataclass(frozen=True, slots=True)
class Wanted:
    """What the engines of a request must serve, beyond being healthy and admitted."""

    adapter: str | None = None  # a LoRA adapter's name, listed by the engine
    revision: str | None = None  # a KV revision the client named (``<served>@kv-<rev>``)

    def served_by(self, ep: Endpoint) -> bool:
        if self.adapter is not None and self.adapter not in ep.adapters:
            return False
        return self.revision is None or ep.revision == self.revision

    def engines(self, eps: Sequence[Endpoint]) -> Sequence[Endpoint]:
        return [e for e in eps if self.served_by(e)]

    def what(self) -> str:
        """How an error names it."""
        if self.adapter is not None:
            return f"LoRA adapter {self.adapter!r}"
        return f"KV revision {self.revision!r}"


class Names:
    """The ``model`` names one router serves (module docstring)."""

    def __init__(self, served: str, adapters: Sequence[str]) -> None:
        self.served = served
        self.adapters = frozenset(adapters)
        # the metric label's values, in the order the router presets them
        self.labels = (served, *adapters)
        self._wanted = {a: Wanted(adapter=a) for a in adapters}

    def wanted(self, model: Any) -> Wanted | None:
        """What the engines of a request for ``model`` must serve: None for the served model
        (``model`` absent or its name: any engine); KeyError for a name the router does not
        serve."""
        if model is None or model == self.served:
            return None
        if isinstance(model, str):
            w = self._wanted.get(model)
            if w is not None:
                return w
            rev = revision.of_alias(model, self.served)
            if rev is not None:
                return Wanted(revision=rev)
        raise KeyError(model)

    def serves(self, model: str) -> bool:
        """Whether ``model`` is one of this router's names (its model, a configured adapter,
        one of its KV revisions'): never another release's (pd_router.remotes)."""
        return (
            model == self.served
            or model in self.adapters
            or revision.of_alias(model, self.served) is not None
        )

    def label(self, model: Any) -> str:
        """The ``model`` metric label of a request served under ``model``."""
        return model if isinstance(model, str) and model in self.adapters else self.served


def listed(answer: Any, served: str) -> dict[str, str]:
    """The adapters of ``served`` in an engine's ``/v1/models`` answer (cards whose ``parent``
    is the served name), each with its ``root``: the path the engine loaded it from, which the
    chart makes the adapter's version (a hub adapter's folder names its commit); empty for an
    answer that lists none (or is not a model list)."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        return {}
    return {
        c["id"]: str(c.get("root"))
        for c in data
        if isinstance(c, dict) and c.get("parent") == served and isinstance(c.get("id"), str)
    }


def same_adapter(adapter: str) -> Callable[[Endpoint, Endpoint], bool]:
    """Whether a prefiller and a decoder hold one version of ``adapter`` (one ``root``): while
    pods roll to a new version under the same name, an old prefiller's KV would be decoded by
    a new adapter (NixlConnector never checks), and those blocks kept in the decoder's prefix
    cache under the new version's hashes."""

    def same(prefiller: Endpoint, decoder: Endpoint) -> bool:
        return prefiller.adapters.get(adapter) == decoder.adapters.get(adapter)

    return same


Usable = Callable[["Endpoint", "Endpoint"], bool]


def both(first: Usable | None, second: Usable) -> Usable:
    """A pair ``first`` (None: any) and ``second`` both allow."""
    if first is None:
        return second
    return lambda p, d: first(p, d) and second(p, d)

"""The KV hand-off connectors the router speaks (``routing.connector``), one entry each, with
what the rest of the router asks about them: the config's rules and name check, the hand-off
it builds (pd_router.handoff.build_route), the metrics it presets. No other module compares
``routing.connector`` to a name.

The chart keeps the same list with the facts it shares (charts/pd-inference/templates/
_connectors.tpl) and generates the schema's enum of ``kvTransfer.connector`` from this one
(ci/chartdoc.py); tests/test_connectors.py fails when the two differ.

A third connector: an entry here, its module in pd_router/handoff/ (``build_route``), its own
settings in pd_router.config if it has any, and its entry in the chart's list.

Standard library only: pd_router.config imports it, and the hand-off modules import the config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Connector:
    # its module in pd_router.handoff; ``build_route(cfg, legs, direct)`` there makes the route
    route: str
    # Why one engine cannot both send and receive its KV, which pools.layout flexible needs
    # (every engine prefills for another and decodes what another prefilled); "" = it can.
    fixed_roles: str
    # routing.decision goodput can drive it: its route hands the KV between the prefiller and
    # the decoder the decision named
    goodput: bool
    # The prefillers announce that the KV landed, received as lmcache.notificationReceiver
    # says: in the router (one process binds the socket) or in a sidecar of each prefill pod.
    notifications: bool
    # Why it cannot serve LoRA adapters (model.adapters); "" = it can.
    no_lora: str = ""


LMCACHE_NO_LORA = (
    "LMCache's cache key leaves the adapter out (LMCache 0.5.6 lmcache/utils.py CacheEngineKey: "
    "the model, world size, worker, the tokens' hash, dtype and tags; LMCache issue 2961, vLLM "
    "issue 44250), so a request for one adapter could be served another's KV or the base model's"
)


# In the order the router presets their series (pd_router_handoff_wait_seconds{connector}).
CONNECTORS: dict[str, Connector] = {
    "nixl": Connector(
        route="pd_router.handoff.nixl",
        fixed_roles="",
        goodput=True,
        notifications=False,
    ),
    "lmcache": Connector(
        route="pd_router.handoff.lmcache",
        fixed_roles="an LMCache PD engine is a sender or a receiver, never both",
        goodput=False,
        notifications=True,
        no_lora=LMCACHE_NO_LORA,
    ),
}
# what the config accepts, in the order its error names them
NAMES = tuple(sorted(CONNECTORS))
# the chart's default too (kvTransfer.connector): one default for router and chart
DEFAULT = "nixl"


def names_where(test: Callable[[Connector], bool]) -> str:
    """The connectors that pass ``test``, as an error names them: ``nixl``, or ``a or b``."""
    return " or ".join(name for name in NAMES if test(CONNECTORS[name]))

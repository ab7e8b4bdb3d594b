"""The goodput sweep (issue 33's judge): colocated serving, today's fixed prefill/decode split
and the goodput decision on the same engines, over a grid of prompt mixes x Poisson arrival
rates plus a multi-turn chat and a workload whose mix alternates, each request streamed and
timed token by token, each counted as good when it meets both SLOs (DistServe's goodput).

Modules: :mod:`.workload` (what is sent when), :mod:`.client` (sending it and timing every
token), :mod:`.slo` (the SLOs from the engines' unloaded latencies, goodput), :mod:`.sweep`
(the grid on one set of engines, any backend), :mod:`.report` (the table and the heatmap),
:mod:`.sim` (the simulated backend at GPU scale: ``python -m pd_router_dev.goodput.sim``). The
real-engine backend lives with the real-engine tier (``python -m tests.real_engine.goodput``),
whose tooling starts vLLM; ``make goodput`` runs both.
"""

// Command fastengine is the development benchmark's zero-delay engine and load generator
// (make bench; router/dev/src/pd_router_dev/bench.py builds it). Standard library only.
//
//	fastengine engine [-http N] [-sidecar] [-port-file F] ...
//	fastengine load -url URL -c N -d SECONDS [-warmup S] [-stream] (-body JSON | -body-file F)
//
// engine answers what a router needs of vLLM at once, with nothing simulated: the OpenAI
// completions and chat completions (whole or streamed), /tokenize, /health, /v1/models, a
// tiny /metrics, the NIXL prefill answer (kv_transfer_params.do_remote_decode in, top-level
// kv_transfer_params with the remote_* fields out), the LMCache prefill answer
// (kv_transfer_params.ret_first_tok or disagg_spec in, kv_transfer_params.first_tok out) and,
// with -sidecar, the LMCache notification sidecar's GET /v1/notifications/{req_id} answered 200
// at once. A stream goes out in one write (-flush request, the default), one write per SSE
// event (-flush token), or that with a pause before each token (-flush "token 5ms"); POST
// /fastengine/flush with the same words as its body switches it. Shapes
// follow the Python simulator (pd_router_dev.sim, vLLM 0.31.0). It is an HTTP/1.1 server of its
// own on package net (keep-alive, Content-Length and chunked bodies), so that the engine is
// never what a router benchmark measures.
//
// load runs N keep-alive HTTP/1.1 clients posting one fixed body for D seconds after a
// warm-up and prints one JSON object: requests completed in the window, errors, req/s,
// latency p50/p90/p99, and for streams the time to the first SSE event (TTFT), each stream
// read to its last chunk and checked for "data: [DONE]".
package main

import (
	"fmt"
	"os"
	"runtime/debug"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: fastengine engine|load [flags]")
		os.Exit(2)
	}
	// few, short-lived allocations per request: collect rarely
	debug.SetGCPercent(400)
	switch os.Args[1] {
	case "engine":
		os.Exit(engineMain(os.Args[2:]))
	case "load":
		os.Exit(loadMain(os.Args[2:]))
	default:
		fmt.Fprintf(os.Stderr, "fastengine: unknown command %q (engine or load)\n", os.Args[1])
		os.Exit(2)
	}
}

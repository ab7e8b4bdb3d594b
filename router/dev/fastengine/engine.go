package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"
)

// The simulator's toy tokenizer (pd_router_dev/sim/model.py): BOS, chat role and end tokens,
// one id per word or punctuation mark.
const (
	tokBOS       = 1
	tokUser      = 2
	tokAssistant = 3
	tokSystem    = 4
	tokEnd       = 5
	promptBase   = 100 + 102 // OUT_BASE + len(VOCAB_OUT)
	promptVocab  = 32000
	maxBodyBytes = 64 << 20
)

type engineCfg struct {
	model       string
	maxModelLen int
	word        string
	firstTok    int
	fingerprint string
	engineID    string
	host        string
}

type engine struct {
	cfg      engineCfg
	logLeft  atomic.Int64 // request heads and bodies still to print (-log-requests)
	perToken atomic.Bool  // streams: one write per SSE event (else one per stream)
	interval atomic.Int64 // per-token streams: nanoseconds before each token (0: none)
	seq      atomic.Uint64
	unknown  sync.Map // paths answered 404, reported once each
}

func engineMain(args []string) int {
	fs := flag.NewFlagSet("engine", flag.ExitOnError)
	host := fs.String("host", "127.0.0.1", "listen host")
	nHTTP := fs.Int("http", 1, "how many engine ports to open (each a separate engine address)")
	sidecar := fs.Bool("sidecar", false, "also open an LMCache notification sidecar port")
	portFile := fs.String("port-file", "", `write {"http": [ports], "sidecar": port} here once listening`)
	model := fs.String("model", "llama-3.3-70b", "served model name")
	mml := fs.Int("max-model-len", 32768, "max_model_len reported by /tokenize and /v1/models")
	word := fs.String("word", "tok ", "the text of every output token")
	flush := fs.String("flush", "request", "streams: write each SSE event as it is made (token), the same with a pause before each token (e.g. \"token 5ms\"), or the whole stream at once (request); POST /fastengine/flush with that as its body switches it")
	logN := fs.Int("log-requests", 0, "print the first N requests (path, X-Request-Id, body) to stderr")
	_ = fs.Parse(args)
	e := &engine{cfg: engineCfg{
		model:       *model,
		maxModelLen: *mml,
		word:        *word,
		firstTok:    100,
		fingerprint: "vllm-0.31.0-fa57e091",
		engineID:    fmt.Sprintf("fastengine-%d", os.Getpid()),
		host:        *host,
	}}
	e.logLeft.Store(int64(*logN))
	if err := e.setFlush(*flush); err != nil {
		fmt.Fprintln(os.Stderr, "fastengine:", err)
		return 2
	}
	var ports []int
	var lns []net.Listener
	for i := 0; i < *nHTTP; i++ {
		ln, err := net.Listen("tcp", net.JoinHostPort(*host, "0"))
		if err != nil {
			fmt.Fprintln(os.Stderr, "fastengine:", err)
			return 1
		}
		lns = append(lns, ln)
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	sidePort := 0
	if *sidecar {
		ln, err := net.Listen("tcp", net.JoinHostPort(*host, "0"))
		if err != nil {
			fmt.Fprintln(os.Stderr, "fastengine:", err)
			return 1
		}
		sidePort = ln.Addr().(*net.TCPAddr).Port
		go serveListener(ln, e.sidecar)
	}
	for _, ln := range lns {
		go serveListener(ln, e.handle)
	}
	if *portFile != "" {
		data, _ := json.Marshal(map[string]any{"http": ports, "sidecar": sidePort})
		tmp := *portFile + ".tmp"
		if err := os.WriteFile(tmp, data, 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "fastengine:", err)
			return 1
		}
		if err := os.Rename(tmp, *portFile); err != nil {
			fmt.Fprintln(os.Stderr, "fastengine:", err)
			return 1
		}
	}
	fmt.Printf("fastengine engine on %s ports %v sidecar %d model=%s\n", *host, ports, sidePort, *model)
	select {}
}

type handler func(r *request, bw *bufio.Writer) error

type request struct {
	method []byte
	path   []byte
	h      header
	body   []byte
	close  bool
	out    []byte // response scratch
	ev     []byte // SSE event scratch
}

func serveListener(ln net.Listener, h handler) {
	for {
		c, err := ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			fmt.Fprintln(os.Stderr, "fastengine: accept:", err)
			time.Sleep(10 * time.Millisecond) // out of descriptors: let others close
			continue
		}
		go serveConn(c, h)
	}
}

// An idle keep-alive connection is closed after this long.
const idleTimeout = 120 * time.Second

func serveConn(c net.Conn, h handler) {
	defer c.Close()
	// small buffers: hundreds of connections' buffers must stay in the CPU caches
	br := bufio.NewReaderSize(c, 8<<10)
	bw := bufio.NewWriterSize(c, 8<<10)
	r := &request{}
	lastDeadline := time.Time{}
	for {
		// moving the deadline costs a timer update: do it at most once a second
		if now := time.Now(); now.Sub(lastDeadline) > time.Second {
			_ = c.SetDeadline(now.Add(idleTimeout))
			lastDeadline = now
		}
		if err := readRequest(br, bw, r); err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !isTimeout(err) {
				writeSimple(bw, 400, "application/json", []byte(`{"detail":"bad request"}`), true)
				_ = bw.Flush()
			}
			return
		}
		if err := h(r, bw); err != nil {
			return
		}
		if br.Buffered() == 0 {
			if err := bw.Flush(); err != nil {
				return
			}
		}
		if r.close {
			_ = bw.Flush()
			return
		}
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func readRequest(br *bufio.Reader, bw *bufio.Writer, r *request) error {
	line, err := readLine(br)
	for err == nil && len(line) == 0 { // stray CRLF between requests
		line, err = readLine(br)
	}
	if err != nil {
		return err
	}
	sp := bytes.IndexByte(line, ' ')
	sp2 := bytes.LastIndexByte(line, ' ')
	if sp <= 0 || sp2 <= sp {
		return errBadMessage
	}
	r.method = append(r.method[:0], line[:sp]...)
	r.path = append(r.path[:0], line[sp+1:sp2]...)
	http10 := bytes.Equal(line[sp2+1:], []byte("HTTP/1.0"))
	if err := readHeaders(br, &r.h); err != nil {
		return err
	}
	r.close = r.h.close || (http10 && !r.h.keepAlive)
	if r.h.expect100 {
		_, _ = bw.WriteString("HTTP/1.1 100 Continue\r\n\r\n")
		if err := bw.Flush(); err != nil {
			return err
		}
	}
	r.body, err = readBody(br, &r.h, r.body, maxBodyBytes)
	return err
}

var statusText = map[int]string{
	200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error",
}

func writeHead(bw *bufio.Writer, status int, ctype string, n int, closing bool) {
	var b [160]byte
	h := append(b[:0], "HTTP/1.1 "...)
	h = strconv.AppendInt(h, int64(status), 10)
	h = append(h, ' ')
	h = append(h, statusText[status]...)
	h = append(h, "\r\nContent-Type: "...)
	h = append(h, ctype...)
	h = append(h, "\r\nContent-Length: "...)
	h = strconv.AppendInt(h, int64(n), 10)
	if closing {
		h = append(h, "\r\nConnection: close"...)
	}
	h = append(h, "\r\n\r\n"...)
	_, _ = bw.Write(h)
}

func writeSimple(bw *bufio.Writer, status int, ctype string, body []byte, closing bool) {
	writeHead(bw, status, ctype, len(body), closing)
	_, _ = bw.Write(body)
}

func (e *engine) handle(r *request, bw *bufio.Writer) error {
	if e.logLeft.Load() > 0 && e.logLeft.Add(-1) >= 0 {
		fmt.Fprintf(os.Stderr, "fastengine: %s %s x-request-id=%q %s\n", r.method, r.path, r.h.requestID, r.body)
	}
	path := r.path
	if q := bytes.IndexByte(path, '?'); q >= 0 {
		path = path[:q]
	}
	switch string(path) {
	case "/v1/chat/completions":
		if string(r.method) == "POST" {
			return e.generate(r, bw, true)
		}
	case "/v1/completions":
		if string(r.method) == "POST" {
			return e.generate(r, bw, false)
		}
	case "/tokenize":
		if string(r.method) == "POST" {
			return e.tokenize(r, bw)
		}
	case "/health":
		writeSimple(bw, 200, "application/json", nil, r.close)
		return nil
	case "/fastengine/flush":
		if err := e.setFlush(string(r.body)); err != nil {
			return e.apiError(r, bw, 400, err.Error())
		}
		writeSimple(bw, 200, "text/plain", r.body, r.close)
		return nil
	case "/v1/models":
		writeSimple(bw, 200, "application/json", e.models(), r.close)
		return nil
	case "/metrics":
		writeSimple(bw, 200, "text/plain; version=0.0.4; charset=utf-8", e.metrics(), r.close)
		return nil
	default:
		if _, seen := e.unknown.LoadOrStore(string(path), true); !seen {
			fmt.Fprintf(os.Stderr, "fastengine: %s %s answered 404\n", r.method, path)
		}
		writeSimple(bw, 404, "application/json", []byte(`{"detail":"Not Found"}`), r.close)
		return nil
	}
	writeSimple(bw, 405, "application/json", []byte(`{"detail":"Method Not Allowed"}`), r.close)
	return nil
}

// setFlush: "request", "token" or "token <duration>" (a pause before each token).
func (e *engine) setFlush(mode string) error {
	f := strings.Fields(mode)
	switch {
	case len(f) == 1 && f[0] == "request":
		e.perToken.Store(false)
		e.interval.Store(0)
	case len(f) >= 1 && len(f) <= 2 && f[0] == "token":
		var d time.Duration
		if len(f) == 2 {
			var err error
			if d, err = time.ParseDuration(f[1]); err != nil || d < 0 {
				return fmt.Errorf("bad pause %q", f[1])
			}
		}
		e.perToken.Store(true)
		e.interval.Store(int64(d))
	default:
		return fmt.Errorf("flush mode must be request, token or token <duration>, got %q", mode)
	}
	return nil
}

// sidecar: pd-router notify-sidecar's wait endpoint, every notification already there.
func (e *engine) sidecar(r *request, bw *bufio.Writer) error {
	path := r.path
	query := []byte(nil)
	if q := bytes.IndexByte(path, '?'); q >= 0 {
		path, query = path[:q], path[q+1:]
	}
	const prefix = "/v1/notifications/"
	if string(r.method) == "GET" && bytes.HasPrefix(path, []byte(prefix)) {
		count := 1
		for _, kv := range bytes.Split(query, []byte("&")) {
			if v, ok := bytes.CutPrefix(kv, []byte("count=")); ok {
				if n := atoi(v); n > 0 {
					count = n
				}
			}
		}
		out := append(r.out[:0], `{"req_id":`...)
		out = appendJSONString(out, string(path[len(prefix):]))
		out = append(out, `,"received":`...)
		out = strconv.AppendInt(out, int64(count), 10)
		out = append(out, '}')
		r.out = out
		writeSimple(bw, 200, "application/json", out, r.close)
		return nil
	}
	if string(path) == "/health" {
		writeSimple(bw, 200, "application/json", []byte(`{"status":"ok"}`), r.close)
		return nil
	}
	writeSimple(bw, 404, "application/json", []byte(`{"error":{"message":"no route","type":"not_found_error","param":null,"code":404}}`), r.close)
	return nil
}

// ------------------------------------------------------------------ request bodies

type msgContent struct{ text string }

func (c *msgContent) UnmarshalJSON(b []byte) error {
	switch {
	case len(b) == 0 || b[0] == 'n':
		c.text = ""
		return nil
	case b[0] == '"':
		return json.Unmarshal(b, &c.text)
	case b[0] == '[':
		var parts []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		}
		if err := json.Unmarshal(b, &parts); err != nil {
			return err
		}
		texts := make([]string, 0, len(parts))
		for _, p := range parts {
			if p.Type == "text" {
				texts = append(texts, p.Text)
			}
		}
		c.text = strings.Join(texts, " ")
		return nil
	}
	return errors.New("message content must be a string, a list of parts or null")
}

type message struct {
	Role    string     `json:"role"`
	Content msgContent `json:"content"`
}

type kvParams struct {
	DoRemoteDecode bool            `json:"do_remote_decode"`
	RetFirstTok    bool            `json:"ret_first_tok"`
	DisaggSpec     json.RawMessage `json:"disagg_spec"`
}

type genRequest struct {
	Model               string          `json:"model"`
	Messages            []message       `json:"messages"`
	Prompt              json.RawMessage `json:"prompt"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	Stream              bool            `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	KV                  *kvParams `json:"kv_transfer_params"`
	RequestID           string    `json:"request_id"`
	AddGenerationPrompt *bool     `json:"add_generation_prompt"`
	AddSpecialTokens    *bool     `json:"add_special_tokens"`
	ReturnTokenIDs      *bool     `json:"return_token_ids"`
}

func isWordRune(r rune) bool {
	return r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.IsMark(r)
}

// asciiClass: 1 a word byte (\w), 2 white space, 0 punctuation, for ASCII bytes.
var asciiClass = func() (t [128]byte) {
	for c := 0; c < 128; c++ {
		switch {
		case c == '_' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z':
			t[c] = 1
		case c == ' ' || c >= '\t' && c <= '\r' || c >= 0x1c && c <= 0x1f:
			t[c] = 2
		}
	}
	return t
}()

// textIDs appends the ids of text as the simulator's tokenize_text does (re \w+|[^\w\s],
// crc32 of each piece); with ids == nil only counts.
func textIDs(text string, ids []int, want bool) ([]int, int) {
	n := 0
	i := 0
	for i < len(text) {
		if c := text[i]; c < utf8.RuneSelf && !want { // ASCII, counting only: a table lookup
			switch asciiClass[c] {
			case 2:
				i++
			case 1:
				for i++; i < len(text) && text[i] < utf8.RuneSelf && asciiClass[text[i]] == 1; i++ {
				}
				if i < len(text) && text[i] >= utf8.RuneSelf {
					r, _ := utf8.DecodeRuneInString(text[i:])
					if isWordRune(r) { // a word going on in non-ASCII letters
						for i < len(text) {
							r2, s2 := utf8.DecodeRuneInString(text[i:])
							if !isWordRune(r2) {
								break
							}
							i += s2
						}
					}
				}
				n++
			default:
				i++
				n++
			}
			continue
		}
		r, size := rune(text[i]), 1
		if r >= utf8.RuneSelf {
			r, size = utf8.DecodeRuneInString(text[i:])
		}
		if unicode.IsSpace(r) {
			i += size
			continue
		}
		start := i
		i += size
		if isWordRune(r) {
			for i < len(text) {
				r2, s2 := rune(text[i]), 1
				if r2 >= utf8.RuneSelf {
					r2, s2 = utf8.DecodeRuneInString(text[i:])
				}
				if !isWordRune(r2) {
					break
				}
				i += s2
			}
		}
		n++
		if want {
			ids = append(ids, promptBase+int(crc32.ChecksumIEEE([]byte(text[start:i]))%promptVocab))
		}
	}
	return ids, n
}

func roleToken(role string) int {
	switch role {
	case "user":
		return tokUser
	case "assistant":
		return tokAssistant
	case "tool":
		return 7
	default: // system, developer and anything else
		return tokSystem
	}
}

// promptIDs: the prompt's ids (want) or only their count, as the simulator's chat template
// and tokenizer make them; a token-id prompt is itself.
func promptIDs(g *genRequest, chat bool, want bool) ([]int, int, error) {
	var ids []int
	n := 0
	if chat {
		if len(g.Messages) == 0 {
			return nil, 0, errors.New("messages must be a non-empty list")
		}
		n = 1
		if want {
			ids = append(ids, tokBOS)
		}
		for _, m := range g.Messages {
			if want {
				ids = append(ids, roleToken(m.Role))
			}
			var k int
			ids, k = textIDs(m.Content.text, ids, want)
			n += k + 2
			if want {
				ids = append(ids, tokEnd)
			}
		}
		if g.AddGenerationPrompt == nil || *g.AddGenerationPrompt {
			n++
			if want {
				ids = append(ids, tokAssistant)
			}
		}
		return ids, n, nil
	}
	p := bytes.TrimSpace(g.Prompt)
	if len(p) == 0 || p[0] == 'n' {
		return nil, 0, errors.New("prompt is required")
	}
	bos := !chat && (g.AddSpecialTokens == nil || *g.AddSpecialTokens)
	if p[0] == '"' {
		var s string
		if err := json.Unmarshal(p, &s); err != nil {
			return nil, 0, err
		}
		if bos {
			n = 1
			if want {
				ids = append(ids, tokBOS)
			}
		}
		var k int
		ids, k = textIDs(s, ids, want)
		return ids, n + k, nil
	}
	// a list: token ids, or strings / id lists (a batch: the first prompt, as the router's
	// tokenize_request asks)
	if want {
		if err := json.Unmarshal(p, &ids); err == nil {
			return ids, len(ids), nil
		}
	} else if k, ok := countInts(p); ok {
		return nil, k, nil
	}
	var many []json.RawMessage
	if err := json.Unmarshal(p, &many); err != nil || len(many) == 0 {
		return nil, 0, errors.New("'prompt' must be a string, an array of strings or an array of token ids")
	}
	g2 := *g
	g2.Prompt = many[0]
	return promptIDs(&g2, false, want)
}

// countInts counts the elements of a JSON array of integers without decoding it.
func countInts(p []byte) (int, bool) {
	if len(p) < 2 || p[0] != '[' || p[len(p)-1] != ']' {
		return 0, false
	}
	inner := bytes.TrimSpace(p[1 : len(p)-1])
	if len(inner) == 0 {
		return 0, true
	}
	n := 1
	for _, c := range inner {
		switch {
		case c == ',':
			n++
		case c >= '0' && c <= '9', c == ' ', c == '\n', c == '\t', c == '\r', c == '-':
		default:
			return 0, false
		}
	}
	return n, true
}

func (e *engine) apiError(r *request, bw *bufio.Writer, status int, msg string) error {
	out := append(r.out[:0], `{"error":{"message":`...)
	out = appendJSONString(out, msg)
	out = append(out, `,"type":"BadRequestError","param":null,"code":`...)
	out = strconv.AppendInt(out, int64(status), 10)
	out = append(out, "}}"...)
	r.out = out
	writeSimple(bw, status, "application/json", out, r.close)
	return nil
}

func (e *engine) tokenize(r *request, bw *bufio.Writer) error {
	var g genRequest
	if err := json.Unmarshal(r.body, &g); err != nil {
		return e.apiError(r, bw, 400, "invalid JSON: "+err.Error())
	}
	chat := g.Messages != nil
	ids, _, err := promptIDs(&g, chat, true)
	if err != nil {
		return e.apiError(r, bw, 400, err.Error())
	}
	out := append(r.out[:0], `{"count":`...)
	out = strconv.AppendInt(out, int64(len(ids)), 10)
	out = append(out, `,"max_model_len":`...)
	out = strconv.AppendInt(out, int64(e.cfg.maxModelLen), 10)
	out = append(out, `,"tokens":[`...)
	for i, t := range ids {
		if i > 0 {
			out = append(out, ',')
		}
		out = strconv.AppendInt(out, int64(t), 10)
	}
	out = append(out, `],"token_strs":null}`...)
	r.out = out
	writeSimple(bw, 200, "application/json", out, r.close)
	return nil
}

func (e *engine) models() []byte {
	now := time.Now().Unix()
	return []byte(fmt.Sprintf(`{"object":"list","data":[{"id":%q,"object":"model","created":%d,"owned_by":"vllm","root":%q,"parent":null,"max_model_len":%d,"permission":[{"id":"modelperm-fa57e0910000000a","object":"model_permission","created":%d,"allow_create_engine":false,"allow_sampling":true,"allow_logprobs":true,"allow_search_indices":false,"allow_view":true,"allow_fine_tuning":false,"organization":"*","group":null,"is_blocking":false}]}]}`,
		e.cfg.model, now, e.cfg.model, e.cfg.maxModelLen, now))
}

func (e *engine) metrics() []byte {
	m := e.cfg.model
	return []byte("# TYPE vllm:num_requests_running gauge\n" +
		`vllm:num_requests_running{engine="0",model_name="` + m + `"} 0.0` + "\n" +
		"# TYPE vllm:num_requests_waiting gauge\n" +
		`vllm:num_requests_waiting{engine="0",model_name="` + m + `"} 0.0` + "\n" +
		"# TYPE vllm:kv_cache_usage_perc gauge\n" +
		`vllm:kv_cache_usage_perc{engine="0",model_name="` + m + `"} 0.0` + "\n")
}

// ------------------------------------------------------------------ generation

type gen struct {
	chat           bool
	id             []byte
	created        int64
	promptTokens   int
	maxTokens      int
	includeUsage   bool
	nixlPrefill    bool
	lmcachePrefill bool
	promptIDs      []int // return_token_ids: the prompt's ids (whole answers only)
}

func (e *engine) generate(r *request, bw *bufio.Writer, chat bool) error {
	var g genRequest
	chatTokens, err := scanGen(r.body, &g)
	fast := err == nil
	if !fast {
		g = genRequest{}
		if err := json.Unmarshal(r.body, &g); err != nil {
			return e.apiError(r, bw, 400, "invalid JSON: "+err.Error())
		}
	}
	if g.Model != "" && g.Model != e.cfg.model {
		out := append(r.out[:0], `{"error":{"message":"The model `...)
		out = append(out, "`"...)
		out = append(out, g.Model...)
		out = append(out, "` does not exist.\",\"type\":\"NotFoundError\",\"param\":\"model\",\"code\":404}}"...)
		r.out = out
		writeSimple(bw, 404, "application/json", out, r.close)
		return nil
	}
	nPrompt := chatTokens
	if !chat || !fast {
		var err error
		if _, nPrompt, err = promptIDs(&g, chat, false); err != nil {
			return e.apiError(r, bw, 400, err.Error())
		}
	} else if len(g.Messages) == 0 {
		return e.apiError(r, bw, 400, "messages must be a non-empty list")
	}
	st := gen{chat: chat, created: time.Now().Unix(), promptTokens: nPrompt, maxTokens: 16}
	if chat && g.MaxCompletionTokens != nil {
		st.maxTokens = *g.MaxCompletionTokens
	} else if g.MaxTokens != nil {
		st.maxTokens = *g.MaxTokens
	}
	if st.maxTokens < 1 {
		return e.apiError(r, bw, 400, fmt.Sprintf("max_tokens must be at least 1, got %d.", st.maxTokens))
	}
	if g.KV != nil {
		if g.KV.DoRemoteDecode {
			st.nixlPrefill = true
		} else if g.KV.RetFirstTok || len(g.KV.DisaggSpec) > 0 {
			st.lmcachePrefill = true
			st.maxTokens = 1
		}
	}
	st.includeUsage = g.Stream && g.StreamOptions != nil && g.StreamOptions.IncludeUsage
	if g.ReturnTokenIDs != nil && *g.ReturnTokenIDs {
		if g.Stream {
			return e.apiError(r, bw, 400, "the fast engine returns token ids in whole answers only")
		}
		ids, _, err := promptIDs(&g, chat, true)
		if err != nil {
			return e.apiError(r, bw, 400, err.Error())
		}
		st.promptIDs = ids
	}
	// serve/engine/serving.py _base_request_id: X-Request-Id, else request_id, else random
	if chat {
		st.id = append(st.id[:0], "chatcmpl-"...)
	} else {
		st.id = append(st.id[:0], "cmpl-"...)
	}
	switch {
	case len(r.h.requestID) > 0:
		st.id = append(st.id, r.h.requestID...)
	case g.RequestID != "":
		st.id = append(st.id, g.RequestID...)
	default:
		st.id = appendHex16(st.id, e.seq.Add(1)^0x9e3779b97f4a7c15)
	}
	if g.Stream {
		return e.stream(r, bw, &st)
	}
	r.out = e.whole(r.out[:0], &st)
	writeSimple(bw, 200, "application/json", r.out, r.close)
	return nil
}

func appendHex16(dst []byte, v uint64) []byte {
	const hex = "0123456789abcdef"
	for i := 60; i >= 0; i -= 4 {
		dst = append(dst, hex[(v>>uint(i))&0xf])
	}
	return dst
}

func (e *engine) appendHead(out []byte, st *gen, object string) []byte {
	out = append(out, `{"id":`...)
	out = appendJSONBytes(out, st.id)
	out = append(out, `,"object":"`...)
	out = append(out, object...)
	out = append(out, `","created":`...)
	out = strconv.AppendInt(out, st.created, 10)
	out = append(out, `,"model":`...)
	out = appendJSONString(out, e.cfg.model)
	return out
}

func (e *engine) appendText(out []byte, n int) []byte {
	out = append(out, '"')
	for i := 0; i < n; i++ {
		out = appendJSONInner(out, e.cfg.word)
	}
	return append(out, '"')
}

func appendUsage(out []byte, prompt, completion int, details bool) []byte {
	out = append(out, `{"prompt_tokens":`...)
	out = strconv.AppendInt(out, int64(prompt), 10)
	out = append(out, `,"total_tokens":`...)
	out = strconv.AppendInt(out, int64(prompt+completion), 10)
	out = append(out, `,"completion_tokens":`...)
	out = strconv.AppendInt(out, int64(completion), 10)
	if details {
		out = append(out, `,"prompt_tokens_details":null,"completion_tokens_details":null`...)
	}
	return append(out, '}')
}

// appendKV: the answer's kv_transfer_params (NixlConnector request_finished on the prefiller,
// or LMCache's first token), else null.
func (e *engine) appendKV(out []byte, st *gen) []byte {
	switch {
	case st.nixlPrefill:
		computed := st.promptTokens + st.maxTokens - 1
		out = append(out, `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[`...)
		blocks := (computed + 15) / 16
		for i := 0; i < blocks; i++ {
			if i > 0 {
				out = append(out, ',')
			}
			out = strconv.AppendInt(out, int64(i), 10)
		}
		out = append(out, `]],"remote_engine_id":`...)
		out = appendJSONString(out, e.cfg.engineID)
		out = append(out, `,"remote_request_id":`...)
		out = appendJSONBytes(out, st.id)
		out = append(out, `,"remote_host":`...)
		out = appendJSONString(out, e.cfg.host)
		out = append(out, `,"remote_port":5600,"tp_size":1,"dcp_size":1,"pp_size":1,"remote_num_tokens":`...)
		out = strconv.AppendInt(out, int64(computed), 10)
		out = append(out, `,"remote_blocks_expiry_time":null,"transfer_mode":"pull"}`...)
	case st.lmcachePrefill:
		out = append(out, `{"first_tok":`...)
		out = strconv.AppendInt(out, int64(e.cfg.firstTok), 10)
		out = append(out, '}')
	default:
		out = append(out, "null"...)
	}
	return out
}

// whole: ChatCompletionResponse / CompletionResponse as vLLM 0.31 model_dump() writes them
// (the simulator's _full_response, one choice).
func (e *engine) whole(out []byte, st *gen) []byte {
	if st.chat {
		out = e.appendHead(out, st, "chat.completion")
		out = append(out, `,"choices":[{"index":0,"message":{"role":"assistant","content":`...)
		out = e.appendText(out, st.maxTokens)
		out = append(out, `,"refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":null},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":`...)
		out = e.appendOutIDs(out, st)
		out = append(out, `,"routed_experts":null}]`...)
	} else {
		out = e.appendHead(out, st, "text_completion")
		out = append(out, `,"choices":[{"index":0,"text":`...)
		out = e.appendText(out, st.maxTokens)
		out = append(out, `,"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":`...)
		out = e.appendOutIDs(out, st)
		out = append(out, `,"prompt_logprobs":null,"prompt_token_ids":`...)
		out = appendIDs(out, st.promptIDs)
		out = append(out, `,"routed_experts":null}]`...)
	}
	out = append(out, `,"service_tier":null,"system_fingerprint":`...)
	out = appendJSONString(out, e.cfg.fingerprint)
	out = append(out, `,"usage":`...)
	out = appendUsage(out, st.promptTokens, st.maxTokens, true)
	if st.chat {
		out = append(out, `,"prompt_logprobs":null,"prompt_token_ids":`...)
		out = appendIDs(out, st.promptIDs)
		out = append(out, `,"prompt_text":null`...)
	}
	out = append(out, `,"kv_transfer_params":`...)
	out = e.appendKV(out, st)
	return append(out, `,"ec_transfer_params":null,"metrics":null}`...)
}

// appendIDs: a JSON list of ids, or null for none (return_token_ids not asked).
func appendIDs(out []byte, ids []int) []byte {
	if ids == nil {
		return append(out, "null"...)
	}
	out = append(out, '[')
	for i, id := range ids {
		if i > 0 {
			out = append(out, ',')
		}
		out = strconv.AppendInt(out, int64(id), 10)
	}
	return append(out, ']')
}

// appendOutIDs: the output's ids with return_token_ids (every output token is the engine's
// one word, whose id is firstTok), else null.
func (e *engine) appendOutIDs(out []byte, st *gen) []byte {
	if st.promptIDs == nil {
		return append(out, "null"...)
	}
	ids := make([]int, st.maxTokens)
	for i := range ids {
		ids[i] = e.cfg.firstTok
	}
	return appendIDs(out, ids)
}

const sseHead = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n"

// stream: the SSE events of chat_completion_stream_generator / completion_stream_generator
// (vLLM 0.31, as the simulator writes them): the chat role chunk, one chunk per token, the
// last with finish_reason (and the fingerprint unless a usage chunk follows), the usage chunk
// with stream_options.include_usage, then data: [DONE]. A NIXL prefill asked to stream gets
// its kv_transfer_params on the last token's chunk.
func (e *engine) stream(r *request, bw *bufio.Writer, st *gen) error {
	_, _ = bw.WriteString(sseHead)
	if r.close {
		_, _ = bw.WriteString("Connection: close\r\n")
	}
	_, _ = bw.WriteString("\r\n")
	perToken := e.perToken.Load()
	pause := time.Duration(0)
	if perToken {
		pause = time.Duration(e.interval.Load())
	}
	flush := func() error {
		if perToken {
			return bw.Flush()
		}
		return nil
	}
	if err := flush(); err != nil { // per token: the headers at once, as vLLM sends them
		return err
	}
	send := func(ev []byte) error {
		r.out = appendChunk(r.out[:0], ev)
		_, _ = bw.Write(r.out)
		return flush()
	}
	object := "text_completion"
	if st.chat {
		object = "chat.completion.chunk"
		ev := append(r.ev[:0], "data: "...)
		ev = e.appendHead(ev, st, object)
		ev = append(ev, `,"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}`...)
		ev = append(ev, "\n\n"...)
		r.ev = ev
		if err := send(ev); err != nil {
			return err
		}
	}
	for i := 1; i <= st.maxTokens; i++ {
		if pause > 0 { // each token a step later, as an engine makes them
			time.Sleep(pause)
		}
		last := i == st.maxTokens
		ev := append(r.ev[:0], "data: "...)
		ev = e.appendHead(ev, st, object)
		if st.chat {
			ev = append(ev, `,"choices":[{"index":0,"delta":{"content":`...)
			ev = e.appendText(ev, 1)
			if last {
				ev = append(ev, `},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null}]`...)
			} else {
				ev = append(ev, `},"logprobs":null,"finish_reason":null,"token_ids":null}]`...)
			}
		} else {
			ev = append(ev, `,"choices":[{"index":0,"text":`...)
			ev = e.appendText(ev, 1)
			if last {
				ev = append(ev, `,"logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":null}]`...)
			} else {
				ev = append(ev, `,"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]`...)
			}
		}
		if last && !st.includeUsage {
			ev = append(ev, `,"system_fingerprint":`...)
			ev = appendJSONString(ev, e.cfg.fingerprint)
		}
		if last && (st.nixlPrefill || st.lmcachePrefill) {
			ev = append(ev, `,"kv_transfer_params":`...)
			ev = e.appendKV(ev, st)
		}
		ev = append(ev, "}\n\n"...)
		r.ev = ev
		if err := send(ev); err != nil {
			return err
		}
	}
	tail := append(r.ev[:0], ""...)
	if st.includeUsage {
		tail = append(tail, "data: "...)
		tail = e.appendHead(tail, st, object)
		tail = append(tail, `,"choices":[],"usage":`...)
		tail = appendUsage(tail, st.promptTokens, st.maxTokens, false)
		tail = append(tail, `,"system_fingerprint":`...)
		tail = appendJSONString(tail, e.cfg.fingerprint)
		tail = append(tail, "}\n\n"...)
	}
	tail = append(tail, "data: [DONE]\n\n"...)
	r.ev = tail
	r.out = appendChunk(r.out[:0], tail)
	r.out = append(r.out, "0\r\n\r\n"...)
	_, _ = bw.Write(r.out)
	return nil // the connection loop flushes
}

// ------------------------------------------------------------------ JSON strings

func appendJSONString(dst []byte, s string) []byte {
	dst = append(dst, '"')
	dst = appendJSONInner(dst, s)
	return append(dst, '"')
}

func appendJSONBytes(dst []byte, s []byte) []byte {
	return appendJSONString(dst, string(s))
}

func appendJSONInner(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			continue
		}
		dst = append(dst, s[start:i]...)
		switch c {
		case '"', '\\':
			dst = append(dst, '\\', c)
		case '\n':
			dst = append(dst, '\\', 'n')
		case '\r':
			dst = append(dst, '\\', 'r')
		case '\t':
			dst = append(dst, '\\', 't')
		default:
			dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		}
		start = i + 1
	}
	return append(dst, s[start:]...)
}

package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"runtime"
	"sort"
	"strconv"
	"sync"
	"time"
)

type loadResult struct {
	Conc       int      `json:"conc"`
	Duration   float64  `json:"duration_s"`
	Stream     bool     `json:"stream"`
	Requests   int      `json:"requests"`
	Errors     int      `json:"errors"`
	RPS        float64  `json:"rps"`
	P50        *float64 `json:"p50_ms"`
	P90        *float64 `json:"p90_ms"`
	P99        *float64 `json:"p99_ms"`
	Mean       *float64 `json:"mean_ms"`
	TTFTP50    *float64 `json:"ttft_p50_ms"`
	TTFTP99    *float64 `json:"ttft_p99_ms"`
	All        int      `json:"requests_all"`
	ErrorsAll  int      `json:"errors_all"`
	FirstError string   `json:"first_error,omitempty"`
	Connects   int      `json:"connects"`
}

type worker struct {
	lat, ttft    []float64
	n, errs      int
	all, errsAll int
	connects     int
	firstErr     string
	scratch      []byte
}

func loadMain(args []string) int {
	fs := flag.NewFlagSet("load", flag.ExitOnError)
	rawURL := fs.String("url", "", "http://host:port/path to POST to")
	conc := fs.Int("c", 1, "concurrent keep-alive clients")
	dur := fs.Float64("d", 2, "measured seconds")
	warm := fs.Float64("warmup", 0.5, "seconds of load before the measured window")
	stream := fs.Bool("stream", false, "the body asks for a stream: read the SSE body to its end")
	body := fs.String("body", "", "the JSON body")
	bodyFile := fs.String("body-file", "", "read the JSON body from this file")
	timeout := fs.Float64("timeout", 30, "seconds one request may take (connect included)")
	_ = fs.Parse(args)
	u, err := url.Parse(*rawURL)
	if err != nil || u.Scheme != "http" || u.Host == "" {
		fmt.Fprintln(os.Stderr, "fastengine load: -url must be http://host:port/path")
		return 2
	}
	data := []byte(*body)
	if *bodyFile != "" {
		if data, err = os.ReadFile(*bodyFile); err != nil {
			fmt.Fprintln(os.Stderr, "fastengine load:", err)
			return 2
		}
	}
	if len(data) == 0 || *conc < 1 || *dur <= 0 {
		fmt.Fprintln(os.Stderr, "fastengine load: need a body, -c >= 1 and -d > 0")
		return 2
	}
	path := u.RequestURI()
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "80")
	}
	var req []byte
	req = append(req, "POST "+path+" HTTP/1.1\r\nHost: "+u.Host+
		"\r\nContent-Type: application/json\r\nAccept: */*\r\nContent-Length: "+
		strconv.Itoa(len(data))+"\r\n\r\n"...)
	req = append(req, data...)
	to := time.Duration(*timeout * float64(time.Second))

	begin := time.Now()
	winStart := begin.Add(time.Duration(*warm * float64(time.Second)))
	winEnd := winStart.Add(time.Duration(*dur * float64(time.Second)))
	workers := make([]*worker, *conc)
	var wg sync.WaitGroup
	for i := range workers {
		w := &worker{scratch: make([]byte, 4<<10)}
		workers[i] = w
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.run(host, req, *stream, to, winStart, winEnd)
		}()
	}
	wg.Wait()

	res := loadResult{Conc: *conc, Duration: *dur, Stream: *stream}
	var lat, ttft []float64
	for _, w := range workers {
		lat = append(lat, w.lat...)
		ttft = append(ttft, w.ttft...)
		res.Requests += w.n
		res.Errors += w.errs
		res.All += w.all
		res.ErrorsAll += w.errsAll
		res.Connects += w.connects
		if res.FirstError == "" {
			res.FirstError = w.firstErr
		}
	}
	sort.Float64s(lat)
	sort.Float64s(ttft)
	res.RPS = float64(res.Requests) / *dur
	res.P50, res.P90, res.P99 = pct(lat, 0.5), pct(lat, 0.9), pct(lat, 0.99)
	res.Mean = mean(lat)
	res.TTFTP50, res.TTFTP99 = pct(ttft, 0.5), pct(ttft, 0.99)
	out, err := json.Marshal(res)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fastengine load:", err)
		return 1
	}
	fmt.Println(string(out))
	return 0
}

// pct and mean: nil (JSON null) without samples
func pct(s []float64, q float64) *float64 {
	if len(s) == 0 {
		return nil
	}
	i := int(float64(len(s)) * q)
	if i >= len(s) {
		i = len(s) - 1
	}
	v := s[i]
	return &v
}

func mean(s []float64) *float64 {
	if len(s) == 0 {
		return nil
	}
	t := 0.0
	for _, v := range s {
		t += v
	}
	t /= float64(len(s))
	return &t
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

// run: one closed-loop client. A request is counted when it finishes inside the window
// (latency from its start); requests finishing outside count only in requests_all.
func (w *worker) run(host string, req []byte, stream bool, to time.Duration, winStart, winEnd time.Time) {
	var conn net.Conn
	var br *bufio.Reader
	defer func() {
		if conn != nil {
			conn.Close()
		}
	}()
	for {
		t0 := time.Now()
		if !t0.Before(winEnd) {
			return
		}
		if conn == nil {
			c, err := net.DialTimeout("tcp", host, to)
			if err != nil {
				w.fail(t0, time.Now(), winStart, winEnd, err)
				// the target refuses: do not spin (a refused connect returns at once)
				time.Sleep(10 * time.Millisecond)
				continue
			}
			w.connects++
			conn = c
			if br == nil { // small: hundreds of clients' buffers must stay in the caches
				br = bufio.NewReaderSize(c, 8<<10)
			} else {
				br.Reset(c)
			}
		}
		_ = conn.SetDeadline(t0.Add(to))
		var ttft time.Duration
		status, closing, err := w.exchange(conn, br, req, stream, t0, &ttft)
		t1 := time.Now()
		if err == nil && status != 200 {
			err = fmt.Errorf("HTTP %d", status)
		}
		if err != nil || closing {
			conn.Close()
			conn = nil
		}
		w.all++
		if err != nil {
			w.fail(t0, t1, winStart, winEnd, err)
			continue
		}
		if !t1.Before(winStart) && t1.Before(winEnd) {
			w.n++
			w.lat = append(w.lat, ms(t1.Sub(t0)))
			if stream {
				w.ttft = append(w.ttft, ms(ttft))
			}
		}
		// let every other client send before this one sends again: a client whose answer is
		// already there would otherwise keep the CPU and starve the others (a server on the
		// same CPU answers it at once), and the load would be one client's, not N's
		runtime.Gosched()
	}
}

func (w *worker) fail(t0, t1, winStart, winEnd time.Time, err error) {
	w.errsAll++
	if w.firstErr == "" {
		w.firstErr = err.Error()
	}
	if !t1.Before(winStart) && t1.Before(winEnd) {
		w.errs++
	}
}

var errNoDone = errors.New("stream ended without data: [DONE]")

// exchange sends one request and reads its whole response: the status, whether the server
// closes the connection after it; for a stream the time to the end of its first SSE event.
func (w *worker) exchange(conn net.Conn, br *bufio.Reader, req []byte, stream bool, t0 time.Time, ttft *time.Duration) (int, bool, error) {
	if _, err := conn.Write(req); err != nil {
		return 0, true, err
	}
	line, err := readLine(br)
	if err != nil {
		return 0, true, err
	}
	// HTTP/1.1 200 OK
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) {
		return 0, true, errBadMessage
	}
	status := atoi(line[9:12])
	http10 := line[7] == '0'
	var h header
	if err := readHeaders(br, &h); err != nil {
		return status, true, err
	}
	closing := h.close || (http10 && !h.keepAlive)
	var tail [16]byte // the body's last bytes, for [DONE]
	tn := 0
	first := !stream
	prev := byte(0)
	consume := func(b []byte) {
		if !first {
			// the end of the first event: "\n\n" (possibly across reads)
			if prev == '\n' && len(b) > 0 && b[0] == '\n' || bytes.Contains(b, []byte("\n\n")) {
				first = true
				*ttft = time.Since(t0)
			}
		}
		if len(b) > 0 {
			prev = b[len(b)-1]
		}
		if len(b) >= len(tail) {
			copy(tail[:], b[len(b)-len(tail):])
			tn = len(tail)
		} else {
			keep := len(tail) - len(b)
			if tn < keep {
				keep = tn
			}
			copy(tail[:keep], tail[tn-keep:tn])
			copy(tail[keep:], b)
			tn = keep + len(b)
		}
	}
	readN := func(n int) error {
		if !stream {
			_, err := br.Discard(n)
			return err
		}
		for n > 0 {
			k := n
			if k > len(w.scratch) {
				k = len(w.scratch)
			}
			if _, err := io.ReadFull(br, w.scratch[:k]); err != nil {
				return err
			}
			if stream {
				consume(w.scratch[:k])
			}
			n -= k
		}
		return nil
	}
	switch {
	case h.chunked:
		for {
			n, err := readChunkSize(br)
			if err != nil {
				return status, true, err
			}
			if n == 0 {
				if err := skipTrailers(br); err != nil {
					return status, true, err
				}
				break
			}
			if err := readN(n); err != nil {
				return status, true, err
			}
			if err := readCRLF(br); err != nil {
				return status, true, err
			}
		}
	case h.contentLength >= 0:
		if err := readN(h.contentLength); err != nil {
			return status, true, err
		}
	default: // to the end of the connection
		closing = true
		for {
			k, err := br.Read(w.scratch)
			if stream {
				consume(w.scratch[:k])
			}
			if err == io.EOF {
				break
			}
			if err != nil {
				return status, true, err
			}
		}
	}
	if stream && status == 200 {
		if !bytes.Contains(tail[:tn], []byte("[DONE]")) {
			return status, closing, errNoDone
		}
		if !first {
			*ttft = time.Since(t0)
		}
	}
	return status, closing, nil
}

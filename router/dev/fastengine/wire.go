package main

// A minimal HTTP/1.1 wire: what the engine reads of a request and the load generator of a
// response. Keep-alive, Content-Length and chunked bodies, Connection: close, HTTP/1.0.

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"strconv"
)

var (
	errBadMessage = errors.New("malformed HTTP message")
	errTooLarge   = errors.New("HTTP body too large")
)

// readLine returns one line without its CRLF; valid until the next read of br.
func readLine(br *bufio.Reader) ([]byte, error) {
	line, err := br.ReadSlice('\n')
	if err != nil {
		if errors.Is(err, bufio.ErrBufferFull) {
			return nil, errBadMessage
		}
		return nil, err
	}
	n := len(line) - 1
	if n > 0 && line[n-1] == '\r' {
		n--
	}
	return line[:n], nil
}

func trimSpace(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t') {
		b = b[1:]
	}
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t') {
		b = b[:len(b)-1]
	}
	return b
}

func atoi(b []byte) int {
	n, err := strconv.Atoi(string(b))
	if err != nil {
		return -1
	}
	return n
}

// header is one parsed head's fields of interest.
type header struct {
	contentLength int
	chunked       bool
	close         bool
	keepAlive     bool
	expect100     bool
	requestID     []byte
}

// readHeaders reads header lines up to the empty line.
func readHeaders(br *bufio.Reader, h *header) error {
	h.contentLength = -1
	h.chunked, h.close, h.keepAlive, h.expect100 = false, false, false, false
	h.requestID = h.requestID[:0]
	for {
		line, err := readLine(br)
		if err != nil {
			return err
		}
		if len(line) == 0 {
			return nil
		}
		colon := bytes.IndexByte(line, ':')
		if colon <= 0 {
			return errBadMessage
		}
		name, val := line[:colon], trimSpace(line[colon+1:])
		switch len(name) {
		case 14:
			if bytes.EqualFold(name, []byte("content-length")) {
				if h.contentLength = atoi(val); h.contentLength < 0 {
					return errBadMessage
				}
			}
		case 17:
			if bytes.EqualFold(name, []byte("transfer-encoding")) {
				h.chunked = bytes.Contains(bytes.ToLower(val), []byte("chunked"))
			}
		case 10:
			if bytes.EqualFold(name, []byte("connection")) {
				lv := bytes.ToLower(val)
				h.close = h.close || bytes.Contains(lv, []byte("close"))
				h.keepAlive = bytes.Contains(lv, []byte("keep-alive"))
			}
		case 12:
			if bytes.EqualFold(name, []byte("x-request-id")) {
				h.requestID = append(h.requestID, val...)
			}
		case 6:
			if bytes.EqualFold(name, []byte("expect")) {
				h.expect100 = bytes.EqualFold(val, []byte("100-continue"))
			}
		}
	}
}

// readChunkSize reads a chunk-size line (extensions ignored).
func readChunkSize(br *bufio.Reader) (int, error) {
	line, err := readLine(br)
	if err != nil {
		return 0, err
	}
	if i := bytes.IndexByte(line, ';'); i >= 0 {
		line = line[:i]
	}
	n, err := strconv.ParseInt(string(trimSpace(line)), 16, 32)
	if err != nil || n < 0 {
		return 0, errBadMessage
	}
	return int(n), nil
}

// skipTrailers reads what follows the last chunk up to the empty line.
func skipTrailers(br *bufio.Reader) error {
	for {
		line, err := readLine(br)
		if err != nil {
			return err
		}
		if len(line) == 0 {
			return nil
		}
	}
}

// readCRLF consumes the CRLF after a chunk's data.
func readCRLF(br *bufio.Reader) error {
	line, err := readLine(br)
	if err != nil {
		return err
	}
	if len(line) != 0 {
		return errBadMessage
	}
	return nil
}

// readBody appends a whole request body (Content-Length or chunked) to buf.
func readBody(br *bufio.Reader, h *header, buf []byte, limit int) ([]byte, error) {
	buf = buf[:0]
	if h.chunked {
		for {
			n, err := readChunkSize(br)
			if err != nil {
				return buf, err
			}
			if n == 0 {
				return buf, skipTrailers(br)
			}
			if len(buf)+n > limit {
				return buf, errTooLarge
			}
			buf, err = appendN(br, buf, n)
			if err != nil {
				return buf, err
			}
			if err := readCRLF(br); err != nil {
				return buf, err
			}
		}
	}
	if h.contentLength <= 0 {
		return buf, nil
	}
	if h.contentLength > limit {
		return buf, errTooLarge
	}
	return appendN(br, buf, h.contentLength)
}

func appendN(br *bufio.Reader, buf []byte, n int) ([]byte, error) {
	start := len(buf)
	if cap(buf)-start < n {
		nb := make([]byte, start, start+n+start/2)
		copy(nb, buf)
		buf = nb
	}
	buf = buf[:start+n]
	_, err := io.ReadFull(br, buf[start:])
	return buf, err
}

func appendChunk(dst, payload []byte) []byte {
	dst = strconv.AppendInt(dst, int64(len(payload)), 16)
	dst = append(dst, '\r', '\n')
	dst = append(dst, payload...)
	return append(dst, '\r', '\n')
}

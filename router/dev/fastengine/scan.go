package main

// A single-pass reader of the generation request fields the engine uses, without reflection:
// encoding/json would be most of the engine's time per request. Anything it does not expect
// (a message content that is not a plain string, an escaped model name...) makes it give up,
// and the request is decoded with encoding/json instead.

import (
	"bytes"
	"errors"
	"strconv"
)

var errScan = errors.New("fast scan gave up")

type scanner struct {
	b []byte
	i int
}

func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

func (s *scanner) peek() byte {
	s.ws()
	if s.i >= len(s.b) {
		return 0
	}
	return s.b[s.i]
}

func (s *scanner) expect(c byte) error {
	if s.peek() != c {
		return errScan
	}
	s.i++
	return nil
}

// str reads a string; returns its raw contents and whether it holds escapes.
func (s *scanner) str() ([]byte, bool, error) {
	if s.peek() != '"' {
		return nil, false, errScan
	}
	s.i++
	start, esc := s.i, false
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case '\\':
			esc = true
			s.i += 2
			continue
		case '"':
			out := s.b[start:s.i]
			s.i++
			return out, esc, nil
		}
		s.i++
	}
	return nil, false, errScan
}

// value skips any JSON value and returns its raw bytes.
func (s *scanner) value() ([]byte, error) {
	c := s.peek()
	start := s.i
	switch {
	case c == '"':
		if _, _, err := s.str(); err != nil {
			return nil, err
		}
	case c == '{' || c == '[':
		depth := 0
		for s.i < len(s.b) {
			switch s.b[s.i] {
			case '"':
				if _, _, err := s.str(); err != nil {
					return nil, err
				}
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					s.i++
					return s.b[start:s.i], nil
				}
			}
			s.i++
		}
		return nil, errScan
	case c == 0:
		return nil, errScan
	default: // number, true, false, null
		for s.i < len(s.b) {
			switch s.b[s.i] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return s.b[start:s.i], nil
			}
			s.i++
		}
	}
	return s.b[start:s.i], nil
}

func (s *scanner) boolean() (bool, error) {
	v, err := s.value()
	switch {
	case err != nil:
		return false, err
	case string(v) == "true":
		return true, nil
	case string(v) == "false" || string(v) == "null":
		return false, nil
	}
	return false, errScan
}

// object calls f for each key of an object (f must consume the value).
func (s *scanner) object(f func(key []byte) error) error {
	if err := s.expect('{'); err != nil {
		return err
	}
	if s.peek() == '}' {
		s.i++
		return nil
	}
	for {
		key, esc, err := s.str()
		if err != nil || esc {
			return errScan
		}
		if err := s.expect(':'); err != nil {
			return err
		}
		if err := f(key); err != nil {
			return err
		}
		switch s.peek() {
		case ',':
			s.i++
		case '}':
			s.i++
			return nil
		default:
			return errScan
		}
	}
}

func (s *scanner) optInt() (*int, error) {
	v, err := s.value()
	if err != nil {
		return nil, err
	}
	if string(v) == "null" {
		return nil, nil
	}
	n, err := strconv.Atoi(string(v))
	if err != nil {
		return nil, errScan
	}
	return &n, nil
}

// scanGen fills g and the prompt's token count for a chat body (chatWords: the words of
// every message, counted as the simulator's tokenizer does).
func scanGen(body []byte, g *genRequest) (chatTokens int, err error) {
	s := &scanner{b: body}
	err = s.object(func(key []byte) error {
		switch string(key) {
		case "model":
			v, esc, err := s.str()
			if err != nil || esc {
				return errScan
			}
			g.Model = string(v)
		case "messages":
			if err := s.expect('['); err != nil {
				return err
			}
			g.Messages = g.Messages[:0]
			if s.peek() == ']' {
				s.i++
				return nil
			}
			for {
				var m message
				err := s.object(func(k []byte) error {
					switch string(k) {
					case "role":
						v, esc, err := s.str()
						if err != nil || esc {
							return errScan
						}
						m.Role = string(v)
					case "content":
						v, esc, err := s.str()
						if err != nil || esc {
							return errScan // parts, null or escapes: encoding/json
						}
						_, n := textIDs(string(v), nil, false)
						chatTokens += n + 2
					default:
						_, err := s.value()
						return err
					}
					return nil
				})
				if err != nil {
					return err
				}
				g.Messages = append(g.Messages, m)
				switch s.peek() {
				case ',':
					s.i++
				case ']':
					s.i++
					return nil
				default:
					return errScan
				}
			}
		case "prompt":
			v, err := s.value()
			if err != nil {
				return err
			}
			g.Prompt = v
		case "max_tokens":
			g.MaxTokens, err = s.optInt()
			return err
		case "max_completion_tokens":
			g.MaxCompletionTokens, err = s.optInt()
			return err
		case "stream":
			g.Stream, err = s.boolean()
			return err
		case "add_generation_prompt":
			b, err := s.boolean()
			g.AddGenerationPrompt = &b
			return err
		case "add_special_tokens":
			b, err := s.boolean()
			g.AddSpecialTokens = &b
			return err
		case "request_id":
			v, esc, err := s.str()
			if err != nil || esc {
				return errScan
			}
			g.RequestID = string(v)
		case "stream_options":
			if s.peek() == 'n' {
				_, err := s.value()
				return err
			}
			g.StreamOptions = &struct {
				IncludeUsage bool `json:"include_usage"`
			}{}
			return s.object(func(k []byte) error {
				if string(k) == "include_usage" {
					g.StreamOptions.IncludeUsage, err = s.boolean()
					return err
				}
				_, err := s.value()
				return err
			})
		case "return_token_ids":
			return errScan // rare: encoding/json fills it (and the messages' text it needs)
		case "kv_transfer_params":
			if s.peek() == 'n' {
				_, err := s.value()
				return err
			}
			g.KV = &kvParams{}
			return s.object(func(k []byte) error {
				switch string(k) {
				case "do_remote_decode":
					g.KV.DoRemoteDecode, err = s.boolean()
					return err
				case "ret_first_tok":
					v, err := s.value()
					g.KV.RetFirstTok = err == nil && !bytes.Equal(v, []byte("false")) && !bytes.Equal(v, []byte("null"))
					return err
				case "disagg_spec":
					v, err := s.value()
					if err == nil && string(v) != "null" {
						g.KV.DisaggSpec = v
					}
					return err
				}
				_, err := s.value()
				return err
			})
		default:
			_, err := s.value()
			return err
		}
		return nil
	})
	if err == nil {
		s.ws()
		if s.i != len(s.b) {
			err = errScan
		}
	}
	if len(g.Messages) > 0 {
		chatTokens++ // BOS
		if g.AddGenerationPrompt == nil || *g.AddGenerationPrompt {
			chatTokens++
		}
	}
	return chatTokens, err
}

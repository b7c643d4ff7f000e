"""Synthetic Llama GGUF files at real model sizes (random weights): the bytes a real file of that
type holds, for measuring memory, load time and decode speed where the demo model is too small to
tell (benchmarks/synthetic_gguf.py), and for tests that such files load (tests/model/test_quant.py).

Shapes are Llama-3.2-1B's and Llama-3.1-8B's (hidden 2048 / 4096, 16 / 32 layers, MLP 8192 /
14336, 32 heads, 8 KV heads), or a tiny one, with a given GGUF's tokenizer (and so its vocabulary)
copied in so that the file loads like any other. Codes are uniform random bytes and scales small
fp16 values: the bytes the kernels stream are those of a real file of that type (the outputs are
noise). Q4_K_M and Q5_K_M follow llama.cpp's recipe for those file types: Q4_K (Q5_K) everywhere
except the LM head, and attn_v / ffn_down of the first and last eighth of the layers and every third
in between, in Q6_K. Written block by block with the `gguf` package, no fp32 tensor in memory.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

SIZES = {  # hidden, layers, intermediate, heads, kv heads
    "tiny": (256, 2, 512, 4, 2),   # for the test that the files load (tests/model/test_quant.py)
    "1b": (2048, 16, 8192, 32, 8),
    "8b": (4096, 32, 14336, 32, 8),
}
# Bytes per block of weights: (weights per block, bytes).
BLOCK_BYTES = {"Q4_0": (32, 18), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
               "Q6_K": (256, 210)}
QTYPES = ("Q4_0", "Q5_1", "Q8_0", "Q2_K_M", "Q3_K_M", "Q4_K_M", "Q5_K_M")


def _blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str) -> np.ndarray:
    """[rows, cols / block * block bytes] uint8: random codes and sub-block scales, small fp16
    (super-)block scales, so that weights are ~ 1/sqrt(cols)."""
    per, bs = BLOCK_BYTES[qtype]
    nb = cols // per
    data = rng.integers(0, 256, size=(rows, nb, bs), dtype=np.uint8)
    where = {"Q2_K": slice(80, 84), "Q3_K": slice(108, 110), "Q4_K": slice(0, 4), "Q5_K": slice(0, 4),
             "Q6_K": slice(208, 210), "Q5_1": slice(0, 4)}.get(qtype, slice(0, 2))  # d (and dmin; Q5_1: m)
    span = {"Q2_K": 2 / (8 * 4 * np.sqrt(cols)), "Q3_K": 2 / (32 * 4 * np.sqrt(cols)), "Q4_K": 2 / (8 * 40 * np.sqrt(cols)),
            "Q5_K": 2 / (16 * 40 * np.sqrt(cols)),
            "Q6_K": 2 / (32 * 80 * np.sqrt(cols)), "Q5_1": 2 / (16 * np.sqrt(cols))}.get(qtype, 2 / (8 * np.sqrt(cols)))
    count = (where.stop - where.start) // 2
    scale = (rng.random((rows, nb, count), dtype=np.float32) * span).astype(np.float16)
    data[:, :, where] = scale.view(np.uint8).reshape(rows, nb, 2 * count)
    return data.reshape(rows, nb * bs)


def tensor_type(name: str, qtype: str, layers: int) -> str:
    """The type of tensor `name` in a file of `qtype` (Q4_K_M, Q5_K_M: llama.cpp's choice per tensor;
    Q3_K_M: a simplification of it, Q3_K with attn_v, attn_output and ffn_down in Q4_K; Q2_K_M: the
    same one step lower, Q2_K with those in Q3_K, like llama.cpp's Q2_K file type)."""
    if qtype not in ("Q2_K_M", "Q3_K_M", "Q4_K_M", "Q5_K_M"):
        return qtype
    base = qtype[:4]
    if name == "output.weight":
        return "Q6_K"
    if base in ("Q2_K", "Q3_K"):
        more = "Q3_K" if base == "Q2_K" else "Q4_K"
        return more if name.endswith(("attn_v.weight", "attn_output.weight", "ffn_down.weight")) else base
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        i = int(name.split(".")[1])
        more_bits = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        return "Q6_K" if more_bits else base
    return base


def write(size: str, qtype: str, out: Path, tokenizer_from: Path) -> Path:
    """Write `out`/synthetic-llama-`size`-`qtype`.gguf with the tokenizer and chat template of the
    GGUF file `tokenizer_from` (the demo model's, usually), and return its path."""
    hidden, layers, inter, heads, kv_heads = SIZES[size]
    demo = gguf.GGUFReader(str(tokenizer_from))
    vocab = len(demo.fields["tokenizer.ggml.tokens"].contents())
    path = out / f"synthetic-llama-{size}-{qtype}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"synthetic llama {size}")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(vocab)
    for name, field in demo.fields.items():   # the demo model's tokenizer and chat template
        if name.startswith("tokenizer."):
            value = field.contents()
            vtype = field.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_key_value(name, value, vtype, sub_type=field.types[-1])
            else:
                w.add_key_value(name, value, vtype)
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_gate.weight": (inter, hidden),
                       f"blk.{i}.ffn_up.weight": (inter, hidden), f"blk.{i}.ffn_down.weight": (hidden, inter)})
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}.weight" for i in range(layers) for n in ("attn_norm", "ffn_norm")]
    for name, (rows, cols) in shapes.items():
        kind = tensor_type(name, qtype, layers)
        per, bs = BLOCK_BYTES[kind]
        w.add_tensor_info(name, (rows, cols * bs // per), np.dtype(np.uint8), rows * cols * bs // per,
                          raw_dtype=gguf.GGMLQuantizationType[kind])
    for name in norms:
        w.add_tensor_info(name, (hidden,), np.dtype(np.float32), hidden * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, (rows, cols) in shapes.items():
        w.write_tensor_data(_blocks(rng, rows, cols, tensor_type(name, qtype, layers)))
    for _ in norms:
        w.write_tensor_data(np.ones(hidden, dtype=np.float32))
    w.close()
    return path

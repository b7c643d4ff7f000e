"""Synthetic Llama GGUF files at real model sizes (random weights): the bytes a real file of that
type holds, for measuring memory, load time and decode speed where the demo model is too small to
tell (benchmarks/synthetic_gguf.py), and for tests that such files load (tests/model/test_quant.py).

Shapes are Llama-3.2-1B's and Llama-3.1-8B's (hidden 2048 / 4096, 16 / 32 layers, MLP 8192 /
14336, 32 heads, 8 KV heads), or a tiny one; MoE files (`write_moe`, "qwen3moe") have
Qwen3-30B-A3B's layers (hidden 2048, 32 heads of 128, 4 KV heads, 128 experts of 768, top-8) but
fewer of them, so that they fit a small machine's memory with room for the KV cache; with a given GGUF's tokenizer (and so its vocabulary)
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
MOE_SIZES = {  # hidden, layers, experts, expert width, top-k, heads, kv heads, head dim
    "moe-tiny": (256, 2, 8, 256, 2, 4, 2, 64),
    "moe-16l": (2048, 16, 128, 768, 8, 32, 4, 128),   # Qwen3-30B-A3B's layers, 16 of its 48: 10B parameters
}


def _blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str, gain: float = 1.0) -> np.ndarray:
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
    scale = (rng.random((rows, nb, count), dtype=np.float32) * (span * gain)).astype(np.float16)
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
    if name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")):
        i = int(name.split(".")[1])
        more_bits = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        return "Q6_K" if more_bits else base
    return base


def write(size: str, qtype: str, out: Path, tokenizer_from: Path) -> Path:
    """Write `out`/synthetic-llama-`size`-`qtype`.gguf with the tokenizer and chat template of the
    GGUF file `tokenizer_from` (the demo model's, usually), and return its path."""
    hidden, layers, inter, heads, kv_heads = SIZES[size]
    path = out / f"synthetic-llama-{size}-{qtype}.gguf"
    w, vocab = _writer(path, "llama", f"synthetic llama {size}", tokenizer_from, layers, hidden, heads, kv_heads)
    w.add_feed_forward_length(inter)
    w.add_rope_freq_base(500000.0)
    head_dim = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_gate.weight": (inter, hidden),
                       f"blk.{i}.ffn_up.weight": (inter, hidden), f"blk.{i}.ffn_down.weight": (hidden, inter)})
    norms = {n: hidden for n in ["output_norm.weight"] + [f"blk.{i}.{n}.weight" for i in range(layers)
                                                          for n in ("attn_norm", "ffn_norm")]}
    _write_tensors(w, {k: (v, tensor_type(k, qtype, layers)) for k, v in shapes.items()}, norms, {})
    return path


def _writer(path: Path, arch: str, name: str, tokenizer_from: Path, layers: int, hidden: int, heads: int,
            kv_heads: int) -> tuple[gguf.GGUFWriter, int]:
    """A writer with the common keys and the tokenizer and chat template of the GGUF file
    `tokenizer_from`; and the vocabulary size."""
    demo = gguf.GGUFReader(str(tokenizer_from))
    vocab = len(demo.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    for key, field in demo.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            vtype = field.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, value, vtype, sub_type=field.types[-1])
            else:
                w.add_key_value(key, value, vtype)
    return w, vocab


def _write_tensors(w: gguf.GGUFWriter, matrices: dict[str, tuple[tuple[int, ...], str]], ones: dict[str, int],
                   f32: dict[str, tuple[int, int]], gains: dict[str, float] | None = None) -> None:
    """Write the file: `matrices` (name -> ((experts,) rows, cols), type) as random blocks (their
    weights scaled by `gains`' factor where named), `ones` (name -> length) as F32 ones (norms),
    `f32` (name -> (rows, cols)) as small random F32 (routers). One tensor at a time: none in fp32."""
    rng = np.random.default_rng(0)
    for name, (shape, kind) in matrices.items():
        per, bs = BLOCK_BYTES[kind]
        *lead, rows, cols = shape
        raw = (*lead, rows, cols * bs // per)
        w.add_tensor_info(name, raw, np.dtype(np.uint8), int(np.prod(raw)), raw_dtype=gguf.GGMLQuantizationType[kind])
    for name, n in ones.items():
        w.add_tensor_info(name, (n,), np.dtype(np.float32), n * 4)
    for name, (rows, cols) in f32.items():
        w.add_tensor_info(name, (rows, cols), np.dtype(np.float32), rows * cols * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, (shape, kind) in matrices.items():
        *lead, rows, cols = shape
        n = int(np.prod(lead))   # experts (1: a matrix)
        gain = (gains or {}).get(name, 1.0)
        w.write_tensor_data(_blocks(rng, n * rows, cols, kind, gain).reshape(*lead, rows, -1))
    for n in ones.values():
        w.write_tensor_data(np.ones(n, dtype=np.float32))
    for rows, cols in f32.values():   # rows of zero mean: blind to what every token's stream has in common
        r = rng.standard_normal((rows, cols), dtype=np.float32)
        w.write_tensor_data(((r - r.mean(axis=1, keepdims=True)) / np.sqrt(cols)).astype(np.float32))
    w.close()


def write_moe(size: str, qtype: str, out: Path, tokenizer_from: Path) -> Path:
    """Write `out`/synthetic-qwen3moe-`size`-`qtype`.gguf (llama.cpp's "qwen3moe" layout: merged
    expert tensors ffn_{gate,up,down}_exps, an F32 router ffn_gate_inp, q/k norms) and return its path."""
    hidden, layers, experts, width, top_k, heads, kv_heads, head_dim = MOE_SIZES[size]
    path = out / f"synthetic-qwen3moe-{size}-{qtype}.gguf"
    w, vocab = _writer(path, "qwen3moe", f"synthetic qwen3moe {size}", tokenizer_from, layers, hidden, heads, kv_heads)
    w.add_feed_forward_length(6 * width)   # (the dense MLP width of the original; no layer here has one)
    w.add_expert_feed_forward_length(width)
    w.add_expert_count(experts)
    w.add_expert_used_count(top_k)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1000000.0)
    q = heads * head_dim
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_q.weight": (q, hidden), f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, q), f"blk.{i}.ffn_gate_exps.weight": (experts, width, hidden),
                       f"blk.{i}.ffn_up_exps.weight": (experts, width, hidden),
                       f"blk.{i}.ffn_down_exps.weight": (experts, hidden, width)})
    ones = {"output_norm.weight": hidden}
    for i in range(layers):
        ones.update({f"blk.{i}.attn_norm.weight": hidden, f"blk.{i}.ffn_norm.weight": hidden,
                     f"blk.{i}.attn_q_norm.weight": head_dim, f"blk.{i}.attn_k_norm.weight": head_dim})
    routers = {f"blk.{i}.ffn_gate_inp.weight": (experts, hidden) for i in range(layers)}
    # Random blocks have a common component (codes 0-15 times positive scales, less the minima), and
    # with every weight random the layers' outputs soon dominate the residual stream and look alike
    # for every token: the routers then sent all tokens to the same few experts (at 32 tokens 24-37
    # distinct experts of 128 per layer). Trained routers spread a batch over the experts (training
    # balances their load): routers of zero-mean rows and outputs scaled down 20x (each token's
    # embedding stays in the stream) bring that back (benchmarks/moe.py reports the distinct experts).
    gains = {k: 0.05 for k in shapes if k.endswith(("attn_output.weight", "ffn_down_exps.weight"))}
    _write_tensors(w, {k: (v, tensor_type(k, qtype, layers)) for k, v in shapes.items()}, ones, routers, gains)
    return path

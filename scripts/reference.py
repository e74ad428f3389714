#!/usr/bin/env python3
"""Reference fixtures for gpu-offload's parity tests.

Builds small random models with Hugging Face transformers, records what transformers computes
for them, writes the same weights as GGUF files the way llama.cpp's converter lays them out, and
records gguf-py's decoding of random GGML quant blocks. CI has no Python ML stack, so everything
this script writes is committed under tests/fixtures/ (see tests/fixtures/README.md).

Usage (the venv holds torch, transformers, safetensors, tokenizers, numpy, gguf-py):

    /root/.cache/gpu-offload/pyref/bin/python scripts/reference.py            # everything
    /root/.cache/gpu-offload/pyref/bin/python scripts/reference.py hf gguf   # some parts
    /root/.cache/gpu-offload/pyref/bin/python scripts/reference.py check-llamacpp

Parts: `hf` (tests/fixtures/hf/*), `gguf` (tests/fixtures/gguf/*, needs hf), `qwen3`, `moe`, `qwen2-moe`
(one family each, HF and GGUF), `quant`
(tests/fixtures/quant/*), `check-llamacpp` (not a fixture: runs llama-cpp-python on the GGUF files
and compares with the references; needs the llama_cpp package).

Deterministic: every random number comes from a seeded numpy Generator, torch runs on one CPU
thread with deterministic algorithms, and nothing time- or path-dependent is written. Running it
twice gives byte-identical files (with the same library versions).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
HF_DIR = FIXTURES / "hf"
GGUF_DIR = FIXTURES / "gguf"
QUANT_DIR = FIXTURES / "quant"

GREEDY_TOKENS = 24
PROMPT_LEN = 20  # tokens in reference.json "input_ids" for the id-driven models
GREEDY_PROMPT_LEN = 8


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


def r7(x: float) -> float:
    """Round to 7 significant digits (the precision the fixtures promise)."""
    x = float(x)
    if x == 0.0 or not math.isfinite(x):
        return x
    return float(f"{x:.7g}")


def _scalar(v) -> str:
    return json.dumps(v, ensure_ascii=False)


def dump_json(obj, indent: int = 0) -> str:
    """JSON with objects spread over lines and lists of scalars kept on one line, so that a
    logits matrix is one line per position: readable diffs, modest size."""
    pad = "  " * indent
    inner = "  " * (indent + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{inner}{_scalar(str(k))}: {dump_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)):
        if all(not isinstance(v, (dict, list, tuple)) for v in obj):
            return "[" + ", ".join(_scalar(v) for v in obj) + "]"
        items = [inner + dump_json(v, indent + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return _scalar(obj)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_json(obj) + "\n", encoding="utf-8")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --------------------------------------------------------------------------------------------
# torch setup
# --------------------------------------------------------------------------------------------


def torch_setup():
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)  # nothing should draw from it, but make it fixed if something does
    import transformers

    transformers.logging.set_verbosity_error()
    try:  # quiet the "Writing model shards" progress bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:
        pass
    return torch


# --------------------------------------------------------------------------------------------
# Hugging Face models (hf/)
# --------------------------------------------------------------------------------------------

# Standard deviations of the random weights. Linear weights at 0.1 (fan-in 64..256) keep
# activations O(1); embeddings and the output head are wider so that logits spread over a few
# units (clear argmax margins for greedy decoding) instead of sitting near 0.
STD_LINEAR = 0.1
STD_EMBED = 0.4
STD_HEAD = 0.25
STD_POS = 0.3
STD_NORM_NOISE = 0.1  # norm weights are 1 + N(0, this)
STD_BIAS = 0.05
TIED_STDS = {"std_embed": 0.2, "std_out": 0.3}  # see randomize()


# Output projections of the residual branches (attention output, FFN down).
OUT_PROJ = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "fc2.weight")


def randomize(model, seed: int, std_embed: float = STD_EMBED, std_out: float = STD_LINEAR) -> None:
    """Overwrite every parameter of `model` with seeded numpy draws, in sorted name order.

    Tied parameters appear once in named_parameters(), so a tied head stays tied. Tied models
    use a smaller embedding and larger residual-branch outputs (`std_out`): otherwise the token
    just read dominates the final hidden state and, read back through the same embedding,
    wins the argmax again and again (greedy decoding degenerates into a one-token loop).
    """
    import torch

    rng = np.random.default_rng(seed)
    params = dict(model.named_parameters())
    for name in sorted(params):
        p = params[name]
        shape = tuple(p.shape)
        if len(shape) == 1:
            if name.endswith(".bias"):
                v = rng.normal(0.0, STD_BIAS, shape)
            else:  # RMSNorm / LayerNorm weight
                v = 1.0 + rng.normal(0.0, STD_NORM_NOISE, shape)
        elif "embed_positions" in name:
            v = rng.normal(0.0, STD_POS, shape)
        elif "embed_tokens" in name:
            v = rng.normal(0.0, std_embed, shape)
        elif name.startswith("lm_head"):
            v = rng.normal(0.0, STD_HEAD, shape)
        elif name.endswith(OUT_PROJ):
            v = rng.normal(0.0, std_out, shape)
        else:
            v = rng.normal(0.0, STD_LINEAR, shape)
        with torch.no_grad():
            p.copy_(torch.from_numpy(v.astype(np.float32)))


def make_f16_exact_bf16(model) -> None:
    """Cast to bfloat16 and flush the values an f16 cannot hold exactly (|x| < 2^-14, where f16
    goes subnormal) to zero, so the bf16 checkpoint converts to an f16 GGUF without loss."""
    import torch

    model.to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            small = p.abs() < 2.0**-14
            p[small] = 0.0
            assert torch.equal(p.to(torch.float16).to(torch.bfloat16), p)


def seeded_ids(seed: int, n: int, vocab: int, avoid: set[int]) -> list[int]:
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < n:
        t = int(rng.integers(0, vocab))
        if t not in avoid:
            out.append(t)
    return out


def forward_logits(model, ids: list[int]):
    import torch

    with torch.no_grad():
        x = torch.tensor([ids], dtype=torch.long)
        out = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
    return out.logits[0].float()


def greedy(model, prompt: list[int], n: int):
    """model.generate(do_sample=False) with EOS stopping disabled, checked against a cache-free
    argmax loop; returns (generated ids, smallest top-1/top-2 logit margin over the steps)."""
    import torch

    x = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            num_beams=1,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=prompt[0],
        )
    gen = [int(t) for t in out[0, len(prompt):]]
    assert len(gen) == n, gen
    # Independent check: full forward each step, no KV cache.
    ids = list(prompt)
    margins = []
    for want in gen:
        last = forward_logits(model, ids)[-1]
        top = torch.topk(last, 2)
        assert int(top.indices[0]) == want, (ids, want, int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(want)
    return gen, min(margins)


# A random model's greedy continuation is only a useful test when it is not a one-token loop,
# stays clear of EOS/BOS (an engine stops there) and has no near-ties (which any summation-order
# difference could flip). Weight seeds are tried in order from a fixed start until one passes.
MIN_DISTINCT = 8
MIN_MARGIN = 0.02
SEED_TRIES = 64


def greedy_ok(gen: list[int], margin: float, stop_ids: set[int]) -> bool:
    return (not stop_ids.intersection(gen) and len(set(gen)) >= MIN_DISTINCT
            and margin >= MIN_MARGIN)


def logits_json(logits) -> list[list[float]]:
    return [[r7(v) for v in row] for row in logits.tolist()]


def reference_for(model, input_ids, greedy_prompt, dtype_name, notes, stop_ids, extra=None,
                  greedy_result=None):
    logits = forward_logits(model, input_ids)
    gen, margin = greedy_result or greedy(model, greedy_prompt, GREEDY_TOKENS)
    hits = sorted(stop_ids.intersection(gen))
    std = float(logits.std())
    notes = (
        f"{notes} Logits std {std:.3f}. Greedy = model.generate(do_sample=False, "
        f"max_new_tokens={GREEDY_TOKENS}) in float32 with EOS stopping disabled; "
        + (f"it contains special id(s) {hits}; " if hits else "no EOS/BOS occurs in it; ")
        + f"smallest top-1/top-2 logit margin over its steps {margin:.4f}. Eager attention."
    )
    ref = {
        "input_ids": list(input_ids),
        "logits": logits_json(logits),
        "greedy": {"prompt_ids": list(greedy_prompt), "generated_ids": gen},
        "dtype": dtype_name,
        "notes": notes,
    }
    if extra:
        ref.update(extra)
    return ref


def build_hf_model(name, cls, cfg, *, seed0, prepare, input_ids, greedy_prompt, stop_ids,
                   dtype_name, notes, post_save=None, extra=None, stds=None):
    """Try weight seeds seed0, seed0+1, ... until the greedy continuation is a useful test, then
    write the checkpoint and reference.json. Returns the float32 model loaded from the files."""
    out = HF_DIR / name
    for seed in range(seed0, seed0 + SEED_TRIES):
        model = cls(cfg)
        randomize(model, seed, **(stds or {}))
        prepare(model)
        save_model(model, out)
        if post_save:
            post_save(out)
        m = load_f32(cls, out)
        g = greedy(m, greedy_prompt, GREEDY_TOKENS)
        if greedy_ok(*g, stop_ids):
            break
    else:
        raise RuntimeError(f"{name}: no seed in {SEED_TRIES} tries gives a usable greedy run")
    ref = reference_for(m, input_ids, greedy_prompt, dtype_name,
                        f"{notes} Weight seed {seed} (numpy PCG64).", stop_ids, extra, g)
    if extra:  # keep the small keys ahead of the big logits block
        ref = {k: ref[k] for k in [k for k in ref if k != "logits"] + ["logits"]}
    write_json(out / "reference.json", ref)
    return m


def save_model(model, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)


def load_f32(cls, out: Path):
    """The stored weights upcast to float32: the reference is an exact function of the files."""
    import torch

    m = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    m.eval()
    for p in m.parameters():
        assert p.dtype == torch.float32
    return m


def to_old_config_style(path: Path) -> None:
    """Rewrite a transformers-5 config.json in the pre-5 key style: top-level `rope_theta`
    (+ `rope_scaling`: null) instead of `rope_parameters`, `torch_dtype` instead of `dtype`."""
    cfg = json.loads(path.read_text())
    rp = cfg.pop("rope_parameters")
    assert rp.get("rope_type", "default") == "default", rp
    cfg["rope_theta"] = rp["rope_theta"]
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.pop("dtype")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        rope_theta=10000.0,
    )
    base.update(kw)
    theta = base.pop("rope_theta")
    base["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return LlamaConfig(**base)


def build_llama_gqa(torch):
    from transformers import LlamaForCausalLM

    cfg = llama_config()
    ids = seeded_ids(2001, PROMPT_LEN, cfg.vocab_size, {0, 1, 2})

    def post_save(out: Path) -> None:
        to_old_config_style(out / "config.json")

    m = build_hf_model(
        "llama-gqa", LlamaForCausalLM, cfg, seed0=1000, prepare=lambda m: None,
        input_ids=ids, greedy_prompt=ids[:GREEDY_PROMPT_LEN], stop_ids={1, 2},
        dtype_name="float32", post_save=post_save,
        notes="LlamaForCausalLM, 2 layers, hidden 64, intermediate 128, 4 heads / 2 KV heads "
        "(GQA), head_dim 16, SwiGLU (silu), untied lm_head, rope_theta 10000, rms_norm_eps 1e-5, "
        "stored float32. config.json rewritten in the old key style (top-level rope_theta / "
        "rope_scaling, torch_dtype).",
    )
    assert m.config.rope_parameters["rope_theta"] == 10000.0


def build_relu_llama(torch):
    from transformers import LlamaForCausalLM

    cfg = llama_config(
        vocab_size=320, intermediate_size=256, num_hidden_layers=3, hidden_act="relu",
        rope_theta=500000.0, rms_norm_eps=1e-6,
    )
    ids = seeded_ids(2002, PROMPT_LEN, cfg.vocab_size, {0, 1, 2})
    build_hf_model(
        "relu-llama", LlamaForCausalLM, cfg, seed0=2000, prepare=lambda m: m.to(torch.float16),
        input_ids=ids, greedy_prompt=ids[:GREEDY_PROMPT_LEN], stop_ids={1, 2},
        dtype_name="float16",
        notes="LlamaForCausalLM with hidden_act relu (ReGLU: down(relu(gate x) * up x), as "
        "ReluLLaMA / ProSparse), 3 layers, hidden 64, intermediate 256, 4 heads / 2 KV heads, "
        "head_dim 16, untied, rope_theta 500000, rms_norm_eps 1e-6, stored float16 (reference = "
        "the float16 weights upcast to float32). config.json in the new key style "
        "(rope_parameters, dtype).",
    )


def build_qwen2_bias(torch):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=True,
        use_sliding_window=False,
        max_window_layers=2,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    ids = seeded_ids(2003, PROMPT_LEN, cfg.vocab_size, {0, 1, 2})

    def prepare(model):
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        make_f16_exact_bf16(model)

    build_hf_model(
        "qwen2-bias", Qwen2ForCausalLM, cfg, seed0=3000, prepare=prepare, stds=TIED_STDS,
        input_ids=ids, greedy_prompt=ids[:GREEDY_PROMPT_LEN], stop_ids={1, 2},
        dtype_name="bfloat16",
        notes="Qwen2ForCausalLM: q/k/v projections with bias, o_proj without, tied embeddings "
        "(no lm_head.weight in the file), 2 layers, hidden 64, intermediate 96, 4 heads / 2 KV "
        "heads, head_dim 16, rope_theta 1e6 (rotate-halves / NEOX rope), rms_norm_eps 1e-6, "
        "stored bfloat16 (reference = the bf16 weights upcast to float32). Values with "
        "|x| < 2^-14 were flushed to 0 before saving so every weight is exact in f16 too.",
    )


def build_qwen3(torch):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        max_window_layers=2,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    ids = seeded_ids(2004, PROMPT_LEN, cfg.vocab_size, {0, 1, 2})
    build_hf_model(
        "qwen3", Qwen3ForCausalLM, cfg, seed0=4000, prepare=lambda m: None,
        input_ids=ids, greedy_prompt=ids[:GREEDY_PROMPT_LEN], stop_ids={1, 2},
        dtype_name="float32",
        notes="Qwen3ForCausalLM: RMSNorm over each head of q and of k (q_norm, k_norm, weights "
        "head_dim long) before the rotation, head_dim 32 with hidden 64 and 4 heads / 2 KV heads "
        "(q is 128 wide, not hidden), no biases, untied lm_head, 2 layers, intermediate 96, "
        "rope_theta 1e6 (rotate-halves / NEOX rope), rms_norm_eps 1e-6, stored float32.",
    )


def routed_experts(model, input_ids, k: int) -> list[list[list[int]]]:
    """The experts transformers' router picks, per layer and position: the top `k` of the
    softmax over the router's logits, in ascending id order."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([input_ids]), output_router_logits=True)
    layers = []
    for logits in out.router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(probs, k, dim=-1)
        layers.append([sorted(int(e) for e in row) for row in top.indices])
        # Ties would make the choice depend on the kernel; the fixture must not have any.
        kth = top.values[:, -1]
        rest = probs.masked_fill(torch.zeros_like(probs, dtype=torch.bool).scatter(1, top.indices, True), -1)
        assert bool((kth - rest.max(dim=-1).values > 1e-4).all()), "near tie in the routing"
    return layers


def build_moe(torch, name, cls, cfg, seed0, id_seed, k, notes):
    ids = seeded_ids(id_seed, PROMPT_LEN, cfg.vocab_size, {0, 1, 2})
    m = build_hf_model(
        name, cls, cfg, seed0=seed0, prepare=lambda m: None,
        input_ids=ids, greedy_prompt=ids[:GREEDY_PROMPT_LEN], stop_ids={1, 2},
        dtype_name="float32", notes=notes,
    )
    ref_path = HF_DIR / name / "reference.json"
    ref = json.loads(ref_path.read_text())
    ref = {"experts": routed_experts(m, ids, k), **ref}
    ref = {key: ref[key] for key in [key for key in ref if key != "logits"] + ["logits"]}
    write_json(ref_path, ref)


def build_qwen3_moe(torch):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=128, rms_norm_eps=1e-6, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
        bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    build_moe(
        torch, "qwen3-moe", Qwen3MoeForCausalLM, cfg, 5000, 2005, 2,
        "Qwen3MoeForCausalLM: 8 experts of 32 neurons, top 2, norm_topk_prob (the two weights "
        "renormalised), per-head q/k norm, head_dim 32 with hidden 64 and 4 heads / 2 KV heads, "
        "2 layers, untied lm_head, rope_theta 1e6, rms_norm_eps 1e-6, stored float32. "
        "`experts`: the top-2 expert ids per layer and input position, ascending.",
    )


def build_mixtral(torch):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=384, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    build_moe(
        torch, "mixtral", MixtralForCausalLM, cfg, 6000, 2006, 2,
        "MixtralForCausalLM: 4 experts (w1 gate, w3 up, w2 down) of 64 neurons, top 2, always "
        "renormalised, 2 layers, hidden 64, 4 heads / 2 KV heads, head_dim 16, untied lm_head, "
        "rope_theta 1e6, rms_norm_eps 1e-5, stored float32. `experts`: the top-2 expert ids per "
        "layer and input position, ascending.",
    )


def build_qwen2_moe(torch):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=128,
        rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
        use_sliding_window=False, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    build_moe(
        torch, "qwen2-moe", Qwen2MoeForCausalLM, cfg, 7000, 2007, 2,
        "Qwen2MoeForCausalLM: 8 routed experts of 32 neurons, top 2, not renormalised "
        "(norm_topk_prob false), and a shared expert of 64 neurons weighted by the sigmoid of "
        "its own gate; q/k/v with bias, hidden 64, 4 heads / 2 KV heads, head_dim 16, 2 layers, "
        "untied lm_head, rope_theta 1e6, rms_norm_eps 1e-6, stored float32. `experts`: the "
        "top-2 routed expert ids per layer and input position, ascending.",
    )


def run_qwen2_moe():
    """Only the Qwen2-MoE fixtures (hf/qwen2-moe, gguf/qwen2-moe-f32.gguf)."""
    from gguf import GGMLQuantizationType as T

    torch = torch_setup()
    HF_DIR.mkdir(parents=True, exist_ok=True)
    build_qwen2_moe(torch)
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((HF_DIR / "qwen2-moe" / "config.json").read_text())
    tensors = gguf_moe_tensors(hf_tensors("qwen2-moe"), cfg, "qwen2moe")
    write_gguf(GGUF_DIR / "qwen2-moe-f32.gguf", "qwen2moe", "qwen2-moe", cfg, tensors, T.F32)


def run_moe():
    """Only the mixture-of-experts fixtures (hf/qwen3-moe, hf/mixtral)."""
    torch = torch_setup()
    HF_DIR.mkdir(parents=True, exist_ok=True)
    build_qwen3_moe(torch)
    build_mixtral(torch)
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    write_moe_ggufs()


def build_opt(torch):
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        vocab_size=256,
        hidden_size=64,
        word_embed_proj_dim=64,
        ffn_dim=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        do_layer_norm_before=True,
        activation_function="relu",
        enable_bias=True,
        layer_norm_elementwise_affine=True,
        tie_word_embeddings=True,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )
    ids = seeded_ids(2004, PROMPT_LEN, cfg.vocab_size, {0, 1, 2})

    def prepare(model):
        assert model.lm_head.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
        model.to(torch.float16)

    build_hf_model(
        "opt", OPTForCausalLM, cfg, seed0=4000, prepare=prepare, stds=TIED_STDS,
        input_ids=ids, greedy_prompt=ids[:GREEDY_PROMPT_LEN], stop_ids={2},
        dtype_name="float16",
        notes="OPTForCausalLM: pre-LayerNorm (do_layer_norm_before true) with a final layer "
        "norm, learned positions (table of 128 + 2 rows; position p reads row p + 2), ReLU FFN "
        "(ffn_dim 256), biases on every projection and norm, tied output (lm_head = "
        "embed_tokens, no bias), 2 layers, hidden 64, 4 heads, head_dim 16, stored float16 "
        "(reference = the f16 weights upcast to float32). The prompts avoid the pad id 1 "
        "(transformers would mask it); attention is plain causal.",
    )


TOKENIZER_CORPUS = [
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker. Every morning he opened his shop, wound the clocks on the wall, and waited for "
    "the first customer of the day. The children of the village liked to press their noses to "
    "the window and count the pendulums swinging back and forth.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
    "How vexingly quick daft zebras jump; the five boxing wizards jump quickly.",
    "Numbers matter too: 0, 1, 2, 3, 42, 100, 2024, 3.14159 and 1,000,000. Dates like "
    "2023-11-05 and times like 12:30 show up in logs, tables, and receipts.",
    "def main():\n    print(\"hello, world\")\n    for i in range(10):\n        total += i\n"
    "    return total\n\nif __name__ == \"__main__\":\n    main()\n",
    "Caf\u00e9 au lait, cr\u00e8me br\u00fbl\u00e9e, na\u00efve fa\u00e7ade, \u00fcber, "
    "se\u00f1or. \u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002 "
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0393\u03b5\u03b9\u03ac "
    "\u03c3\u03bf\u03c5 \u03ba\u03cc\u03c3\u03bc\u03b5. Emoji: \U0001f980 \U0001f680 "
    "\u2764\ufe0f.",
    "User: What is the capital of France?\nAssistant: The capital of France is Paris.\n"
    "User: And of Italy?\nAssistant: Rome is the capital of Italy.\n",
    "  Indented lines, trailing spaces   \n\tand tabs\tin between.\n\n\nThree newlines above.",
]

TOKENIZER_PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces and two trailing  ",
    "line one\nline two\n\nline four\n",
    "Caf\u00e9 na\u00efve \u6771\u4eac \U0001f980 \u041f\u0440\u0438\u0432\u0435\u0442",
    "<|im_start|>user\nHi there!<|im_end|>\n",
    "\ttabs\tand 12345 numbers, punctuation?!",
    "",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CHAT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]

TOK_VOCAB = 384
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOK_VOCAB,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    assert tok.get_vocab_size() == TOK_VOCAB, tok.get_vocab_size()
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i
    # BOS prepended by the post-processor, as in Llama tokenizer.json files.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        add_bos_token=True,
        chat_template=CHAT_TEMPLATE,
        model_max_length=128,
        clean_up_tokenization_spaces=False,
    )
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json (the layout most
    # published checkpoints have) rather than a separate chat_template.jinja.
    fast.save_pretrained(out, save_jinja_files=False)
    # transformers 5 drops add_bos_token on save (BOS lives in tokenizer.json's post_processor);
    # older files carry it, so put it back.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def tokenizer_reference(out: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    cases = []
    for text in TOKENIZER_PROMPTS:
        with_sp = tok(text, add_special_tokens=True)["input_ids"]
        without = tok(text, add_special_tokens=False)["input_ids"]
        assert with_sp == [0] + without, (text, with_sp, without)
        assert tok.decode(without) == text, (text, tok.decode(without))
        cases.append({
            "text": text,
            "ids_add_special": with_sp,
            "ids_no_special": without,
            "tokens_no_special": tok.convert_ids_to_tokens(without),
        })
    rendered = tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
    chat_ids = tok(rendered, add_special_tokens=False)["input_ids"]
    return tok, {
        "tokenization": cases,
        "chat": {
            "messages": CHAT_MESSAGES,
            "add_generation_prompt": True,
            "rendered": rendered,
            "ids_no_special": chat_ids,
        },
    }


def build_llama_tok(torch):
    from transformers import LlamaForCausalLM

    cfg = llama_config(vocab_size=TOK_VOCAB, bos_token_id=0, eos_token_id=1)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = Path(tmp)
        build_tokenizer(tok_dir)
        tok, tok_ref = tokenizer_reference(tok_dir)
        tok_files = {f.name: f.read_bytes() for f in sorted(tok_dir.iterdir())}
    prompt = "The children of the village liked the window."
    ids = tok(prompt)["input_ids"]
    assert 16 <= len(ids) <= 24, len(ids)
    gprompt = "Once upon a time"
    gids = tok(gprompt)["input_ids"]

    def post_save(out: Path) -> None:
        for fname, data in tok_files.items():
            (out / fname).write_bytes(data)

    extra = {"prompt": prompt, "greedy_prompt": gprompt}
    extra.update(tok_ref)
    build_hf_model(
        "llama-tok", LlamaForCausalLM, cfg, seed0=5000, prepare=lambda m: None,
        input_ids=ids, greedy_prompt=gids, stop_ids={0, 1}, dtype_name="float32",
        post_save=post_save, extra=extra,
        notes="LlamaForCausalLM like llama-gqa (vocab 384, bos 0 = <s>, eos 1 = </s>, new config "
        "key style) with a byte-level BPE tokenizer.json trained by `tokenizers` on the corpus "
        "in scripts/reference.py (GPT-2 regex pre-tokenizer, no prefix space, BOS added by the "
        "post-processor); tokenizer_config.json holds a ChatML chat_template. input_ids = "
        "tokenizer(prompt) (with BOS); greedy.prompt_ids = tokenizer(greedy_prompt). "
        "`tokenization` holds each text's ids with add_special_tokens True and False; `chat` the "
        "chat template rendering (add_generation_prompt=True) and its ids "
        "(add_special_tokens=False).",
    )


def run_hf():
    torch = torch_setup()
    HF_DIR.mkdir(parents=True, exist_ok=True)
    build_llama_gqa(torch)
    build_relu_llama(torch)
    build_qwen2_bias(torch)
    build_qwen3(torch)
    build_qwen3_moe(torch)
    build_mixtral(torch)
    build_opt(torch)
    build_llama_tok(torch)


# --------------------------------------------------------------------------------------------
# GGUF files in llama.cpp's layout (gguf/)
# --------------------------------------------------------------------------------------------


def rope_halves_to_pairs(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of a Q or K projection (or its bias) from HF's rotate-halves rope layout
    to GGML's adjacent-pairs layout.

    Within each head of size d, HF rotates dimension i together with i + d/2; GGML's normal rope
    rotates 2i with 2i+1. So output row 2i of a head takes input row i, and output row 2i+1 takes
    input row i + d/2: view the head's rows as [2, d/2] (half, index) and transpose to
    [d/2, 2]."""
    rows = w.shape[0]
    assert rows % n_head == 0 and (rows // n_head) % 2 == 0
    half = rows // n_head // 2
    rest = w.shape[1:]
    return w.reshape(n_head, 2, half, *rest).swapaxes(1, 2).reshape(w.shape)


def rope_pairs_to_halves(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of rope_halves_to_pairs."""
    rows = w.shape[0]
    half = rows // n_head // 2
    rest = w.shape[1:]
    return w.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(name: str) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out = {}
    with safe_open(str(HF_DIR / name / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            out[k] = f.get_tensor(k).float().numpy()  # bf16/f16 -> f32 exactly
    return out


def gguf_llama_tensors(sd: dict[str, np.ndarray], cfg: dict) -> list[tuple[str, np.ndarray]]:
    """HF llama tensor names -> GGUF names, Q/K permuted for GGML's rope (arch `llama`)."""
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = [("token_embd.weight", sd["model.embed_tokens.weight"])]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", sd[p + "input_layernorm.weight"]),
            (b + "attn_q.weight", rope_halves_to_pairs(sd[p + "self_attn.q_proj.weight"], n_head)),
            (b + "attn_k.weight", rope_halves_to_pairs(sd[p + "self_attn.k_proj.weight"], n_kv)),
            (b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"]),
            (b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"]),
            (b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]),
            (b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"]),
            (b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"]),
            (b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"]),
        ]
    out.append(("output_norm.weight", sd["model.norm.weight"]))
    if "lm_head.weight" in sd:
        out.append(("output.weight", sd["lm_head.weight"]))
    return out


def gguf_qwen2_tensors(sd: dict[str, np.ndarray], cfg: dict) -> list[tuple[str, np.ndarray]]:
    """HF qwen2 tensor names -> GGUF names (arch `qwen2`: NEOX rope, no permutation)."""
    out = [("token_embd.weight", sd["model.embed_tokens.weight"])]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])]
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v")):
            out += [
                (b + gg + ".weight", sd[p + f"self_attn.{hf}.weight"]),
                (b + gg + ".bias", sd[p + f"self_attn.{hf}.bias"]),
            ]
        out += [
            (b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"]),
            (b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]),
            (b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"]),
            (b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"]),
            (b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"]),
        ]
    out.append(("output_norm.weight", sd["model.norm.weight"]))
    assert "lm_head.weight" not in sd  # tied: llama.cpp reuses token_embd
    return out


def gguf_qwen3_tensors(sd: dict[str, np.ndarray], cfg: dict) -> list[tuple[str, np.ndarray]]:
    """HF qwen3 tensor names -> GGUF names (arch `qwen3`: NEOX rope, no permutation, the
    per-head norms as `attn_q_norm` / `attn_k_norm`)."""
    out = [("token_embd.weight", sd["model.embed_tokens.weight"])]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", sd[p + "input_layernorm.weight"]),
            (b + "attn_q.weight", sd[p + "self_attn.q_proj.weight"]),
            (b + "attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"]),
            (b + "attn_k.weight", sd[p + "self_attn.k_proj.weight"]),
            (b + "attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"]),
            (b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"]),
            (b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"]),
            (b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]),
            (b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"]),
            (b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"]),
            (b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"]),
        ]
    out.append(("output_norm.weight", sd["model.norm.weight"]))
    out.append(("output.weight", sd["lm_head.weight"]))
    return out


def write_qwen3_gguf():
    from gguf import GGMLQuantizationType as T

    cfg = json.loads((HF_DIR / "qwen3" / "config.json").read_text())
    tensors = gguf_qwen3_tensors(hf_tensors("qwen3"), cfg)
    write_gguf(GGUF_DIR / "qwen3-f32.gguf", "qwen3", "qwen3", cfg, tensors, T.F32)


def gguf_moe_tensors(sd, cfg, arch: str) -> list[tuple[str, np.ndarray]]:
    """A mixture-of-experts checkpoint's tensors under llama.cpp's names: each layer's experts as
    3-D `ffn_{gate,up,down}_exps` (expert-major), the router as `ffn_gate_inp`. Arch `qwen3moe`
    keeps HF's rope layout and has the per-head q/k norms; `qwen2moe` keeps the layout, has q/k/v
    biases and the shared expert (`ffn_*_shexp`, its gate the vector `ffn_gate_inp_shexp`);
    Mixtral (arch `llama`) permutes Q/K."""
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n_exp = cfg.get("num_experts") or cfg["num_local_experts"]
    qwen = arch in ("qwen3moe", "qwen2moe")
    block, (g, u, d) = ("mlp", ("gate_proj", "up_proj", "down_proj")) if qwen else (
        "block_sparse_moe", ("w1", "w3", "w2"))
    out = [("token_embd.weight", sd["model.embed_tokens.weight"])]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if not qwen:
            q, k = rope_halves_to_pairs(q, n_head), rope_halves_to_pairs(k, n_kv)
        out += [(b + "attn_norm.weight", sd[p + "input_layernorm.weight"]),
                (b + "attn_q.weight", q), (b + "attn_k.weight", k)]
        if arch == "qwen2moe":
            out += [(b + f"attn_{x}.bias", sd[p + f"self_attn.{x}_proj.bias"]) for x in "qkv"]
        if arch == "qwen3moe":
            out += [(b + "attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"]),
                    (b + "attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])]
        out += [
            (b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"]),
            (b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"]),
            (b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]),
            (b + "ffn_gate_inp.weight", sd[p + f"{block}.gate.weight"]),
        ]
        for name, hf in (("ffn_gate_exps", g), ("ffn_up_exps", u), ("ffn_down_exps", d)):
            out.append((b + name + ".weight", np.stack(
                [sd[p + f"{block}.experts.{e}.{hf}.weight"] for e in range(n_exp)])))
        if arch == "qwen2moe":
            out.append((b + "ffn_gate_inp_shexp.weight",
                        sd[p + "mlp.shared_expert_gate.weight"].reshape(-1)))
            for name, hf in (("ffn_gate_shexp", g), ("ffn_up_shexp", u), ("ffn_down_shexp", d)):
                out.append((b + name + ".weight", sd[p + f"mlp.shared_expert.{hf}.weight"]))
    out.append(("output_norm.weight", sd["model.norm.weight"]))
    out.append(("output.weight", sd["lm_head.weight"]))
    return out


def write_moe_ggufs():
    from gguf import GGMLQuantizationType as T

    for name, arch in (("qwen3-moe", "qwen3moe"), ("mixtral", "llama")):
        cfg = json.loads((HF_DIR / name / "config.json").read_text())
        tensors = gguf_moe_tensors(hf_tensors(name), cfg, arch)
        write_gguf(GGUF_DIR / f"{name}-f32.gguf", arch, name, cfg, tensors, T.F32)


def run_qwen3():
    """Only the Qwen3 fixtures (hf/qwen3, gguf/qwen3-f32.gguf): the others stay as they are."""
    torch = torch_setup()
    HF_DIR.mkdir(parents=True, exist_ok=True)
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    build_qwen3(torch)
    write_qwen3_gguf()
    write_moe_ggufs()


def write_gguf(path: Path, arch: str, name: str, cfg: dict, tensors, qtype) -> dict:
    """Write `tensors` (name, f32 array) with llama.cpp's metadata for `arch`. Vectors (norms,
    biases) stay F32 as llama.cpp's converter keeps them; matrices become `qtype`. Returns the
    decoded (dequantized) matrices, name -> f32 array, for references."""
    import gguf
    from gguf import GGMLQuantizationType as T

    ftype = {T.F32: 0, T.F16: 1, T.Q4_1: 3, T.Q8_0: 7}[qtype]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg["rope_theta"]}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_file_type(ftype)
    if qtype not in (T.F32, T.F16):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    n_exp = cfg.get("num_experts") or cfg.get("num_local_experts")
    if n_exp:
        w.add_expert_count(n_exp)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    # No vocabulary: the model is driven by token ids. llama.cpp refuses a file without
    # tokenizer.ggml.model; "none" is its marker for a vocab-less model (LLAMA_VOCAB_TYPE_NONE,
    # size from {arch}.vocab_size).
    w.add_tokenizer_model("none")
    decoded = {}
    for tname, arr in tensors:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 1 or qtype == T.F32:
            w.add_tensor(tname, arr)
            decoded[tname] = arr
        elif qtype == T.F16:
            h = arr.astype(np.float16)
            assert np.array_equal(h.astype(np.float32), arr), f"{tname} is not exact in f16"
            w.add_tensor(tname, h)
            decoded[tname] = arr
        else:
            q = gguf.quants.quantize(arr, qtype)
            w.add_tensor(tname, q, raw_dtype=qtype)
            decoded[tname] = gguf.quants.dequantize(q, qtype).reshape(arr.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


def quantized_reference(decoded: dict, cfg: dict, base_ref: dict, qname: str) -> dict:
    """transformers' logits for llama-gqa with the GGUF's dequantized weights (Q/K permuted
    back), i.e. the exact function a correct engine computes from the quantized file."""
    import torch
    from transformers import LlamaForCausalLM

    m = load_f32(LlamaForCausalLM, HF_DIR / "llama-gqa")
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    sd = {"model.embed_tokens.weight": decoded["token_embd.weight"],
          "model.norm.weight": decoded["output_norm.weight"],
          "lm_head.weight": decoded["output.weight"]}
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        sd[p + "input_layernorm.weight"] = decoded[b + "attn_norm.weight"]
        sd[p + "self_attn.q_proj.weight"] = rope_pairs_to_halves(decoded[b + "attn_q.weight"], n_head)
        sd[p + "self_attn.k_proj.weight"] = rope_pairs_to_halves(decoded[b + "attn_k.weight"], n_kv)
        sd[p + "self_attn.v_proj.weight"] = decoded[b + "attn_v.weight"]
        sd[p + "self_attn.o_proj.weight"] = decoded[b + "attn_output.weight"]
        sd[p + "post_attention_layernorm.weight"] = decoded[b + "ffn_norm.weight"]
        sd[p + "mlp.gate_proj.weight"] = decoded[b + "ffn_gate.weight"]
        sd[p + "mlp.up_proj.weight"] = decoded[b + "ffn_up.weight"]
        sd[p + "mlp.down_proj.weight"] = decoded[b + "ffn_down.weight"]
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    ref = reference_for(
        m, base_ref["input_ids"], base_ref["greedy"]["prompt_ids"], qname,
        f"transformers' output for llama-gqa-{qname.lower()}.gguf: the llama-gqa model with every "
        f"matrix (token_embd and output included) replaced by gguf-py's dequantization of its "
        f"{qname} blocks in the file (Q/K rows permuted back to HF order); norms F32 as stored.",
        {1, 2},
    )
    return ref


def run_gguf():
    torch_setup()
    from gguf import GGMLQuantizationType as T

    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((HF_DIR / "llama-gqa" / "config.json").read_text())
    base_ref = json.loads((HF_DIR / "llama-gqa" / "reference.json").read_text())
    tensors = gguf_llama_tensors(hf_tensors("llama-gqa"), cfg)
    write_gguf(GGUF_DIR / "llama-gqa-f32.gguf", "llama", "llama-gqa", cfg, tensors, T.F32)
    for qt, label in ((T.Q8_0, "q8_0"), (T.Q4_1, "q4_1")):
        dec = write_gguf(GGUF_DIR / f"llama-gqa-{label}.gguf", "llama", "llama-gqa", cfg,
                         tensors, qt)
        ref = quantized_reference(dec, cfg, base_ref, label.upper())
        write_json(GGUF_DIR / f"llama-gqa-{label}.reference.json", ref)

    qcfg = json.loads((HF_DIR / "qwen2-bias" / "config.json").read_text())
    qtensors = gguf_qwen2_tensors(hf_tensors("qwen2-bias"), qcfg)
    write_gguf(GGUF_DIR / "qwen2-bias-f16.gguf", "qwen2", "qwen2-bias", qcfg, qtensors, T.F16)
    write_qwen3_gguf()


# --------------------------------------------------------------------------------------------
# GGML quant blocks (quant/)
# --------------------------------------------------------------------------------------------

# (name, GGML type id, number of blocks, byte offsets of the f16 scale fields in a block)
QUANT_TYPES = [
    ("Q4_0", 2, 8, (0,)),
    ("Q4_1", 3, 8, (0, 2)),
    ("Q5_0", 6, 8, (0,)),
    ("Q5_1", 7, 8, (0, 2)),
    ("Q8_0", 8, 8, (0,)),
    ("Q4_K", 12, 3, (0, 2)),
    ("Q5_K", 13, 3, (0, 2)),
    ("Q6_K", 14, 3, (208,)),
]


def scale_f16(rng, block: int, field: int) -> np.float16:
    """Sane f16 scales: block 0 positive normal, block 1 negative, block 2 subnormal (first
    field), the rest random sign and magnitude in [2^-12, 4)."""
    if block == 0:
        v = rng.uniform(0.01, 1.0)
    elif block == 1:
        v = -rng.uniform(0.01, 1.0)
    elif block == 2 and field == 0:
        v = rng.choice([-1.0, 1.0]) * rng.uniform(1e-7, 6e-5)  # f16 subnormal range
    else:
        v = rng.choice([-1.0, 1.0]) * 2.0 ** rng.uniform(-12, 2)
    h = np.float16(v)
    assert np.isfinite(h)
    return h


def run_quant():
    import gguf
    from gguf import GGMLQuantizationType as T

    QUANT_DIR.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3001)
    entries = {}
    for name, type_id, n_blocks, scale_offsets in QUANT_TYPES:
        qt = T(type_id)
        assert qt.name == name
        block_len, block_bytes = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
        for b in range(n_blocks):
            for fi, off in enumerate(scale_offsets):
                raw[b, off:off + 2] = np.frombuffer(scale_f16(rng, b, fi).tobytes(), np.uint8)
        values = gguf.quants.dequantize(raw.reshape(-1), qt).astype(np.float32).reshape(-1)
        assert values.shape == (n_blocks * block_len,)
        assert np.all(np.isfinite(values))
        entries[name] = {
            "type_id": type_id,
            "block_len": block_len,
            "block_bytes": block_bytes,
            "n_blocks": n_blocks,
            "n": n_blocks * block_len,
            "bytes_hex": raw.tobytes().hex(),
            # f32 bit patterns, little-endian words as 8 hex digits each: exact, signed zeros kept
            "values_bits_hex": "".join(f"{int(u):08x}" for u in values.view(np.uint32)),
            "values": [float(v) for v in values],
        }
    doc = {
        "generator": "scripts/reference.py quant (gguf-py " + gguf_version() + ")",
        "format": "per GGML type: raw block bytes as one hex string; gguf-py's "
                  "gguf.quants.dequantize of them as f32, both as f32 bit patterns "
                  "(values_bits_hex, 8 hex digits per value, big-endian digit order of the u32) "
                  "and as JSON numbers (values, exact: every f32 is a double)",
        "types": entries,
    }
    write_json(QUANT_DIR / "blocks.json", doc)


def gguf_version() -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:
        return "?"


# --------------------------------------------------------------------------------------------
# llama.cpp cross-check (not a fixture)
# --------------------------------------------------------------------------------------------


def llamacpp_run(path: Path, ids: list[int], greedy_prompt: list[int]):
    """llama.cpp's logits for every position of `ids`, and its greedy continuation of
    `greedy_prompt` (argmax, token by token through the KV cache)."""
    from llama_cpp import Llama

    # f32 KV cache and no flash attention: llama.cpp's defaults (f16 K/V) alone cost ~3e-4
    # relative error, which would hide a small layout mistake.
    llm = Llama(model_path=str(path), vocab_only=False, logits_all=True, n_ctx=128, n_threads=2,
                n_batch=128, verbose=False, seed=0, type_k=0, type_v=0, flash_attn=False)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
    llm.reset()
    llm.eval(greedy_prompt)
    gen = []
    for _ in range(GREEDY_TOKENS):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        gen.append(t)
        llm.eval([t])
    llm.close()
    return logits, gen


def compare(got: np.ndarray, want: np.ndarray) -> dict:
    diff = np.abs(got - want)
    return {
        "max_abs": float(diff.max()),
        "rel_max": float(diff.max() / np.abs(want).max()),  # max |diff| / max |reference|
        "rel_l2": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
        "argmax_agree": float(np.mean(got.argmax(-1) == want.argmax(-1))),
    }


def run_check_llamacpp():
    """llama.cpp (llama-cpp-python, CPU) on the GGUF fixtures against the references. The
    unquantized files must match to < 1e-3 relative; the quantized ones differ by llama.cpp's
    own activation quantization (it multiplies Q8_0/Q4_1 weights by Q8-quantized activations),
    so their figures are printed only."""
    from gguf import GGMLQuantizationType as T

    with tempfile.TemporaryDirectory() as tmp:
        # qwen2-bias again as F32, so llama.cpp's f16 activation rounding does not blur the check.
        qcfg = json.loads((HF_DIR / "qwen2-bias" / "config.json").read_text())
        q32 = Path(tmp) / "qwen2-bias-f32.gguf"
        write_gguf(q32, "qwen2", "qwen2-bias", qcfg,
                   gguf_qwen2_tensors(hf_tensors("qwen2-bias"), qcfg), T.F32)
        cases = [
            (GGUF_DIR / "llama-gqa-f32.gguf", HF_DIR / "llama-gqa" / "reference.json", 1e-3),
            (GGUF_DIR / "llama-gqa-q8_0.gguf", GGUF_DIR / "llama-gqa-q8_0.reference.json", None),
            (GGUF_DIR / "llama-gqa-q4_1.gguf", GGUF_DIR / "llama-gqa-q4_1.reference.json", None),
            (GGUF_DIR / "qwen2-bias-f16.gguf", HF_DIR / "qwen2-bias" / "reference.json", 1e-3),
            (q32, HF_DIR / "qwen2-bias" / "reference.json", 1e-3),
            (GGUF_DIR / "qwen3-f32.gguf", HF_DIR / "qwen3" / "reference.json", 1e-3),
            (GGUF_DIR / "qwen3-moe-f32.gguf", HF_DIR / "qwen3-moe" / "reference.json", 1e-3),
            (GGUF_DIR / "mixtral-f32.gguf", HF_DIR / "mixtral" / "reference.json", 1e-3),
            (GGUF_DIR / "qwen2-moe-f32.gguf", HF_DIR / "qwen2-moe" / "reference.json", 1e-3),
        ]
        ok = True
        for path, ref_path, tol in cases:
            ref = json.loads(ref_path.read_text())
            want = np.array(ref["logits"], dtype=np.float64)
            got, gen = llamacpp_run(path, ref["input_ids"], ref["greedy"]["prompt_ids"])
            c = compare(got, want)
            same = sum(a == b for a, b in zip(gen, ref["greedy"]["generated_ids"]))
            print(f"{path.name:22s} vs {rel(ref_path)}: "
                  + ", ".join(f"{k} {v:.3g}" for k, v in c.items())
                  + f", greedy {same}/{GREEDY_TOKENS} tokens equal")
            if tol is not None:
                ok &= c["rel_max"] < tol and same == GREEDY_TOKENS
    if not ok:
        sys.exit("llama.cpp disagrees with the HF reference on an unquantized GGUF")


def main(argv: list[str]) -> None:
    parts = argv or ["hf", "gguf", "quant"]
    for p in parts:
        {"hf": run_hf, "gguf": run_gguf, "quant": run_quant, "qwen3": run_qwen3, "moe": run_moe,
         "qwen2-moe": run_qwen2_moe,
         "check-llamacpp": run_check_llamacpp}[p]()
    if {"hf", "gguf", "quant", "qwen3", "moe", "qwen2-moe"} & set(parts):
        total = sum(f.stat().st_size for d in (HF_DIR, GGUF_DIR, QUANT_DIR) if d.exists()
                    for f in d.rglob("*") if f.is_file())
        print(f"fixtures: {total / 1e6:.2f} MB under hf/ gguf/ quant/")


if __name__ == "__main__":
    main(sys.argv[1:])

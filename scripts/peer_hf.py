#!/usr/bin/env python3
"""Decode speed of the same model under Hugging Face transformers (+ accelerate offload), the
peer gpu-offload is compared with in one run (scripts/gpu-check.sh).

    python3 scripts/peer_hf.py MODEL_DIR [--prompt-tokens 32] [--tokens 16] [--max-gpu-mem 4GiB]
                                         [--prompts 128,2048]

Without --max-gpu-mem the whole model goes to GPU 0 in its stored dtype. With it, accelerate's
device_map="auto" places what fits in that budget on the GPU and the rest in CPU memory
(max_memory={0: BUDGET, "cpu": ...}), as a user of HF accelerate would run it.
Greedy decoding of random prompt ids (seeded); TTFT = generate(max_new_tokens=1); decode
tokens/s = (tokens - 1) / (time(generate(tokens)) - TTFT). With --prompts, also the TTFT of a
prompt of each length, the best of two ("prefill": [{"prompt_tokens", "ttft_s"}]). Prints one JSON line
(`gpu-offload bench suite --peer-hf PYTHON` runs this script and reads that line).
"""

import argparse
import json
import time

import torch
import transformers
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--max-gpu-mem")
    ap.add_argument("--cpu-mem", default="120GiB")
    ap.add_argument("--prompts", default="", help="comma-separated prompt lengths for TTFT")
    a = ap.parse_args()

    kw = {"torch_dtype": "auto"}
    if a.max_gpu_mem:
        kw.update(device_map="auto", max_memory={0: a.max_gpu_mem, "cpu": a.cpu_mem})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, **kw)
    if not a.max_gpu_mem:
        model = model.to("cuda:0")
    model.eval()
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (1, a.prompt_tokens), generator=g).to("cuda:0")

    def run(n, prompt=None):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids if prompt is None else prompt, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(2)  # warm-up
    ttft = min(run(1) for _ in range(2))
    total = run(a.tokens)
    prefill = []
    for p in [int(x) for x in a.prompts.split(",") if x.strip()]:
        long_ids = torch.randint(3, model.config.vocab_size, (1, p), generator=g).to("cuda:0")
        # The best of two, as for our runs (the first at a length also picks its GEMM kernels).
        prefill.append({"prompt_tokens": p, "ttft_s": min(run(1, long_ids) for _ in range(2))})
    print(json.dumps({
        "peer": "transformers" + (" + accelerate offload" if a.max_gpu_mem else ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0),
        "max_gpu_mem": a.max_gpu_mem,
        "load_s": load_s,
        "ttft_s": ttft,
        "decode_tokens_per_s": (a.tokens - 1) / max(total - ttft, 1e-9),
        "gpu_peak_bytes": torch.cuda.max_memory_allocated(),
        "prefill": prefill,
    }))


if __name__ == "__main__":
    main()

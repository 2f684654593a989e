"""Synthetic LoRA files from the command line (storyboard_cli/bench/synthetic_lora.py).

    python benchmarks/loras.py example OUT.safetensors     # the committed tiny example (jobs/loras/README.md)
    python benchmarks/loras.py time MODEL DEVICE RANK      # median seconds of a swap, one JSON record
                                                           # e.g. time sdxl-random cuda 32, or time tiny cpu 4
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from storyboard_cli.bench.synthetic_lora import random_factors, save_kohya
from storyboard_cli.models.loader import load_sdxl
from storyboard_cli.models.lora import LoraApplier, read_lora


def write_example(out: str) -> None:
    """The committed example: a rank-4 "character" LoRA on the tiny preset, UNet + both text encoders,
    in sd-scripts' format, stored in fp16 (as trainers save)."""
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    factors = random_factors(models, seed=10, rank=4, text_encoders=True)
    factors = {k: (d.half(), u.half()) for k, (d, u) in factors.items()}
    metadata = {"ss_network_module": "networks.lora", "ss_network_dim": "4", "ss_network_alpha": "4",
                "ss_base_model_version": "sdxl_base_v1-0", "ss_output_name": "mei",
                "bcg_note": "random factors for the tiny preset: storyboard_cli/bench/synthetic_lora.py, seed 10"}
    save_kohya(Path(out), factors, models.unet.config.layers_per_block, alpha=4.0, metadata=metadata)


def time_swaps(spec: str, device: str, rank: int, rounds: int = 5) -> dict:
    """Median seconds of a swap between two LoRAs (UNet + both text encoders) and back to none."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    models = load_sdxl(spec, None, device, dtype)
    lpb = models.unet.config.layers_per_block
    with tempfile.TemporaryDirectory() as tmp:
        loras = {}
        for name, seed in (("a", 1), ("b", 2)):
            factors = {k: (d.half(), u.half()) for k, (d, u) in random_factors(models, seed, rank).items()}
            path = save_kohya(Path(tmp) / f"{name}.safetensors", factors, lpb, alpha=rank)
            loras[name] = read_lora(name, path, models.unet.config)
        applier = LoraApplier(models)
        for w in loras.values():
            applier.register(w)
        for _ in range(rounds):
            applier.apply({"a": (loras["a"], 0.8)})
            applier.apply({"b": (loras["b"], 0.6)})
            applier.apply({"a": (loras["a"], 0.5), "b": (loras["b"], 0.5)})
            applier.apply({})
    swaps = applier.swaps[4:]  # the first round warms up
    return {"model": spec, "device": device, "rank": rank, "layers": len(loras["a"].layers),
            "median_s": statistics.median(s.seconds for s in swaps), "max_s": max(s.seconds for s in swaps),
            "swaps": len(swaps), "w0_bytes": applier.resident_bytes()}


if __name__ == "__main__":
    if sys.argv[1] == "example":
        write_example(sys.argv[2])
    else:
        print(json.dumps(time_swaps(sys.argv[2], sys.argv[3], int(sys.argv[4]))))

"""Synthetic LoRA files from the command line (storyboard_cli/models/synthetic_lora.py).

    python bench/loras.py example OUT.safetensors     # the committed tiny example (jobs/loras/README.md)
    python bench/loras.py time MODEL DEVICE RANK      # median seconds of a swap, one JSON record
                                                      # e.g. time sdxl-random cuda 32, or time tiny cpu 4
"""

from __future__ import annotations

import json
import sys

from storyboard_cli.models.synthetic_lora import time_swaps, write_example

if __name__ == "__main__":
    if sys.argv[1] == "example":
        write_example(sys.argv[2])
    else:
        print(json.dumps(time_swaps(sys.argv[2], sys.argv[3], int(sys.argv[4]))))

"""The models stage: SDXL weights loaded, LoRAs written into them in place; the tiny preset and the tokenizers (base)."""

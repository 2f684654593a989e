"""storyboard-cli: batch SDXL storyboard rendering with a persistent CUDA-graph denoising loop."""

__version__ = "0.1.0"

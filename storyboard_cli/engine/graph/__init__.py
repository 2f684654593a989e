"""The engine stage's CUDA graphs: the graph runner, its static buffers, its keys and the first-replay check."""

"""The engine's CUDA graphs: the graph runner, its static buffers and the keys and stats of its graphs."""

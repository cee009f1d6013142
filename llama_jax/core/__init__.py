"""The compute core's data: the config (static, hashable), the table of every array (`arrays`), the weights pytrees
and their ggml blocks (`weights`, `quantized`), the KV cache, length buckets and padded blocks, and the shardings
over a mesh."""

"""The pieces of a Llama layer, each a pure function in the spec's F32 order (transformers' modeling_llama.py)."""

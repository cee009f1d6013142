"""The passes over the model: the checks at their boundaries (`checks`), the layer scan and the pure forward pass
(`forward`), the passes that write a KV cache (`cached`: prefill, decode_step, extend), the spec's sampler
(`sampling`), generation (`generate`) and batch scoring (`score`)."""

"""Reading and writing checkpoints: the GGUF and safetensors readers, the tensors into the weights pytrees (`tensors`),
whole checkpoints (`checkpoint`), GGUF → Hugging Face conversion (`convert`) and the default model with its
converted copy (`default_model`)."""

"""The worker side: the model runner (KV cache, step inputs and metadata), CUDA graphs, tensor-parallel workers."""

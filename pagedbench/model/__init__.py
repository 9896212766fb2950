"""The model: its config, the Llama-family decoder, tensor-parallel sharding, loading, presets and tokenizers."""

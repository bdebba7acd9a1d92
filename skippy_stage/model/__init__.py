"""The model layer: llama.cpp and one layer range of a GGUF — slicing, loading, the runtime,
lanes and KV admission, sampling, the tokenizer. Knows nothing of the network."""

"""Model shapes the GPU benchmarks build with random weights (no download); imported by the scripts beside it."""

# Llama-3.1-8B-Instruct's config.json, rope scaling included
LLAMA3_1_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})

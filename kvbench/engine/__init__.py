"""Running the model: prefill, compression, decoding (one sample, a batch, beams) and teacher-forced
streams (perplexity, lm-eval)."""

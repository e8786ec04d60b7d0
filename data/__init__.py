"""Data: tokenizers, preprocessing to .bin/.idx, the mmap reader (ours and Megatron-LM's) and GPT samples.

Bottom layer: imports nothing of the project but itself (errors are data.indexed.DataError).
"""

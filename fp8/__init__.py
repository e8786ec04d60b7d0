"""FP8-LM mixed precision (SPEC §4, seed 001): formats and scaling, FP8 linear layers, FP8 gradient
communication with the auto-scaling factor mu, the FP8 AdamW, and the data-parallel strategy that
ties them to ZeRO's whole-tensor distribution."""

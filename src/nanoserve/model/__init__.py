"""The model: its config, the checkpoint loader (fusion, packing), the Llama forward pass with its
matmuls, attention over the paged cache and the CPU's one-call decode step. Knows no engine."""

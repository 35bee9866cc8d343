"""What the benchmarks compare the training path against, and training itself never calls.

Each module here is an op the library once used or tried (a kernel, a PyTorch path, an
optimizer), kept because a benchmark times it and the tests check it still computes what it
claims: the Triton router top-k, the Triton grouped GEMM, the argsort permutation, the
weighted combine, and a ``torch.optim`` AdamW on the fused update. They import ``moe_kernels``
(shared launch helpers and references), never the reverse.
"""

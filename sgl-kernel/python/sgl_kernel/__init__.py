"""sgl_kernel: the project's Triton kernels (batch-1 decode fast paths), each with a torch reference."""

"""Python entry points to fast kernels (Triton, CUDA C++). Each has a plain-PyTorch reference with
the same signature, chosen automatically when the kernel cannot run (CPU, missing build)."""

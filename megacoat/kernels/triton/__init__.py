"""Triton kernels. Import them only through a dispatching entry point that falls back to the
torch reference (no Triton, no GPU); under TRITON_INTERPRET=1 they also run on the CPU."""

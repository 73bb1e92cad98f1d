"""kernels: @triton.jit code only."""

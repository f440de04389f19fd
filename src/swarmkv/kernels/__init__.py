"""GPU kernels in Triton, each beside its torch reference; imported only when the triton backend runs, so triton stays optional."""

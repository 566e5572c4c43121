"""CuTe DSL device code: kernels and the arch-neutral epilogue. No torch, no file I/O."""

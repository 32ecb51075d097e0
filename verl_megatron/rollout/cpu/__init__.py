"""Compiled and lean CPU decoding: the kernels, packed linears and lean layers the native engine uses on CPU."""

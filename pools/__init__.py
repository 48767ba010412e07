"""Memory pools: own the KV / state tensors and export their memory layout.

Standalone: imports neither ``transport`` nor ``kvtransfer``.
"""
